"""Series reads: its steps and runs, and each head's values by step with its formation step per role (SPEC 11)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

from sqlalchemy.orm import Session

from ingest.series import formation_step
from ingest.types import ROLES
from service.errors import InvalidInput
from service.series import repository
from service.series.schemas import (
    DetectionSummary,
    HeadTrajectory,
    SeriesDetail,
    SeriesHeads,
    SeriesRead,
    SeriesStep,
    TrajectoryPoint,
)

# What ``score=`` may read from ``head_trajectories``: the detector scores, the features' scalars, the margin.
SCORES = (*ROLES, "entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep", "margin")
ORDERS = ("formed_at", "-formed_at")


def list_series(session: Session) -> list[SeriesRead]:
    return [
        SeriesRead(name=s.name, architecture=s.architecture, stacks=s.stacks, steps=count, first_step=first,
                   last_step=last, created_at=s.created_at)
        for s, count, first, last in repository.list_all(session)
    ]  # fmt: skip


def series_detail(session: Session, name: str) -> SeriesDetail:
    series = repository.require(session, name)
    models = repository.steps(session, series.id)
    runs = {row.model_id: row for row in repository.current_runs(session, series.id)}
    items = []
    for model in models:
        run = runs[model.id]
        detection = None
        if run.detection_run is not None:
            detection = DetectionSummary(id=run.detection_run, repeat_gain=run.repeat_gain, loss_first=run.loss_first,
                                         loss_later=run.loss_later, config=run.config)  # fmt: skip
        assert model.step is not None
        items.append(SeriesStep(step=model.step, model=model.name, source=model.source, revision=model.revision,
                                requested_revision=model.requested_revision, feature_run=run.feature_run,
                                detection_run=detection, clustering=model.current_clustering_id))  # fmt: skip
    steps = [item.step for item in items]
    return SeriesDetail(name=series.name, architecture=series.architecture, stacks=series.stacks, steps=len(items),
                        first_step=steps[0] if steps else None, last_step=steps[-1] if steps else None,
                        created_at=series.created_at, items=items)  # fmt: skip


def formed_at(rows: Sequence[Any]) -> dict[str, int | None]:
    """Per role, the head's formation step over the steps of ``rows`` (one head, in step order) that have a
    detection run; a role reads the run's own ``roles`` (its score at or above the run's threshold)."""
    detected = [row for row in rows if row.roles is not None]
    steps = [row.step for row in detected]
    return {role: formation_step(steps, [role in row.roles for row in detected]) for role in ROLES}


def series_heads(
    session: Session,
    name: str,
    *,
    score: str = "induction",
    stack: str | None = None,
    layer: int | None = None,
    head: int | None = None,
    order: str | None = None,
) -> SeriesHeads:
    if score not in SCORES:
        raise InvalidInput(f"score: unknown score {score!r}; known: {', '.join(SCORES)}", field="score")
    if order is not None and order not in ORDERS:
        raise InvalidInput(f"order: unknown order {order!r}; known orders: {', '.join(ORDERS)}", field="order")
    if order is not None and score not in ROLES:
        raise InvalidInput(f"order: formed_at is per role; score {score!r} is not one ({', '.join(ROLES)})",
                           field="order")  # fmt: skip
    series = repository.require(session, name)
    rows = repository.trajectories(session, series.id, stack=stack, layer=layer, head=head)
    if not rows and (layer is not None or head is not None or stack is not None):
        where = " ".join(f"{k} {v}" for k, v in (("stack", stack), ("layer", layer), ("head", head)) if v is not None)
        raise InvalidInput(f"head: series {name!r} has no head at {where}", field="head" if head is not None
                           else "layer" if layer is not None else "stack")  # fmt: skip
    items: list[HeadTrajectory] = []
    for (s, la, he), group in groupby(rows, key=lambda row: (row.stack, row.layer, row.head)):
        points = list(group)
        items.append(HeadTrajectory(
            stack=s, layer=la, head=he, formed_at=formed_at(points),
            values=[TrajectoryPoint(step=p.step, value=getattr(p, score), roles=None if p.roles is None
                                    else list(p.roles), type=p.type, margin=p.margin) for p in points],
        ))  # fmt: skip
    if order is not None:
        never = 2**63  # null (never formed) last either way
        sign = -1 if order.startswith("-") else 1
        items.sort(key=lambda h: (h.formed_at[score] is None, sign * (h.formed_at[score] or never)))
    steps = sorted({row.step for row in rows if row.roles is not None})
    return SeriesHeads(series=name, score=score, steps=steps, items=items)
