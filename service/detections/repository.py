"""SQL for detection runs and their per-head scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.orm import CatalogModel, DetectionRun, Head, HeadDetection


def head_ids(session: Session, model_id: int) -> dict[tuple[str, int, int], int]:
    rows = session.execute(select(Head.stack, Head.layer, Head.head, Head.id).where(Head.model_id == model_id))
    return {(stack, layer, head): head_id for stack, layer, head, head_id in rows}


def runs(session: Session, model_id: int) -> Sequence[DetectionRun]:
    return session.scalars(
        select(DetectionRun)
        .where(DetectionRun.model_id == model_id, DetectionRun.status == "complete")
        .order_by(DetectionRun.id.desc())
    ).all()


def heads(session: Session, model_id: int, run_id: int) -> Sequence[Any]:
    """Every head of a run with its scores and roles, by stack, layer and head."""
    return session.execute(
        select(Head.stack, Head.layer, Head.head, HeadDetection.induction, HeadDetection.duplicate_token,
               HeadDetection.previous_token, HeadDetection.sink, HeadDetection.roles)
        .join(Head, (Head.model_id == HeadDetection.model_id) & (Head.id == HeadDetection.head_id))
        .where(HeadDetection.model_id == model_id, HeadDetection.detection_run_id == run_id)
        .order_by(Head.stack, Head.layer, Head.head)
    ).all()  # fmt: skip


def example_map(session: Session, model_id: int, run_id: int, stack: str, layer: int, head: int) -> list[float] | None:
    return session.scalar(
        select(HeadDetection.example_map)
        .join(Head, (Head.model_id == HeadDetection.model_id) & (Head.id == HeadDetection.head_id))
        .where(
            HeadDetection.model_id == model_id,
            HeadDetection.detection_run_id == run_id,
            Head.stack == stack,
            Head.layer == layer,
            Head.head == head,
        )
    )


def latest_heads(session: Session, model_id: int) -> dict[tuple[str, int, int], tuple[list[float | None], list[str]]]:
    """``{(stack, layer, head): ([induction, duplicate_token, previous_token, sink], roles)}`` of the model's current
    detection run (``service/current.py``); empty when it has none."""
    latest = select(CatalogModel.current_detection_run_id).where(CatalogModel.id == model_id).scalar_subquery()
    rows = session.execute(
        select(Head.stack, Head.layer, Head.head, HeadDetection.induction, HeadDetection.duplicate_token,
               HeadDetection.previous_token, HeadDetection.sink, HeadDetection.roles)
        .join(Head, (Head.model_id == HeadDetection.model_id) & (Head.id == HeadDetection.head_id))
        .where(HeadDetection.model_id == model_id, HeadDetection.detection_run_id == latest)
    )  # fmt: skip
    return {(r.stack, r.layer, r.head): ([r.induction, r.duplicate_token, r.previous_token, r.sink], list(r.roles))
            for r in rows}  # fmt: skip
