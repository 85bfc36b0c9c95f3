"""SQL for series: a series by name, its steps, and the ``head_trajectories`` view's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from service.errors import NotFound, known
from service.orm import CatalogModel, Series


def require(session: Session, name: str, *, field: str = "name") -> Series:
    """The series called ``name``, or a 404 that lists the known names."""
    series = session.scalar(select(Series).where(Series.name == name))
    if series is None:
        names = session.scalars(select(Series.name).order_by(Series.name).limit(50)).all()
        raise NotFound(f"{field}: no series named {name!r}; known series: {known(names)}", field=field)
    return series


def list_all(session: Session) -> Sequence[Any]:
    """Every series with its step count and first and last step, by name."""
    return session.execute(
        select(Series, func.count(CatalogModel.id), func.min(CatalogModel.step), func.max(CatalogModel.step))
        .outerjoin(CatalogModel, CatalogModel.series_id == Series.id)
        .group_by(Series.id)
        .order_by(Series.name)
    ).all()


def steps(session: Session, series_id: int) -> Sequence[CatalogModel]:
    """The series' models in step order."""
    return session.scalars(
        select(CatalogModel).where(CatalogModel.series_id == series_id).order_by(CatalogModel.step)
    ).all()


def step_model(session: Session, series: Series, step: int) -> CatalogModel:
    found = session.scalar(select(CatalogModel).where(CatalogModel.series_id == series.id, CatalogModel.step == step))
    if found is None:
        have = session.scalars(
            select(CatalogModel.step).where(CatalogModel.series_id == series.id).order_by(CatalogModel.step)
        ).all()
        raise NotFound(f"step: series {series.name!r} has no step {step}; its steps: {known([str(s) for s in have])}",
                       field="step")  # fmt: skip
    return found


def current_runs(session: Session, series_id: int) -> Sequence[Any]:
    """Per step: its model id, current feature run id and current detection run (id, gains, config)."""
    return session.execute(
        text("""
SELECT m.id AS model_id,
       m.current_feature_run_id AS feature_run,
       r.id AS detection_run, r.repeat_gain, r.loss_first, r.loss_later, r.config
FROM models m
LEFT JOIN detection_runs r ON r.id = m.current_detection_run_id
WHERE m.series_id = :series
"""),
        {"series": series_id},
    ).all()


def trajectories(
    session: Session, series_id: int, *, stack: str | None = None, layer: int | None = None, head: int | None = None
) -> Sequence[Any]:
    """The view's rows of the series (one head, or every head), by stack, layer, head and step; a filter left None
    selects every value."""
    return session.execute(
        text("""
SELECT * FROM head_trajectories
WHERE series_id = :series
  AND (CAST(:stack AS text) IS NULL OR stack = CAST(:stack AS text))
  AND (CAST(:layer AS integer) IS NULL OR layer = CAST(:layer AS integer))
  AND (CAST(:head AS integer) IS NULL OR head = CAST(:head AS integer))
ORDER BY stack, layer, head, step
"""),
        {"series": series_id, "stack": stack, "layer": layer, "head": head},
    ).all()
