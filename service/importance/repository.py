"""SQL for importance runs and pruning curves (the ``head_importance`` view is in the migration)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, text
from sqlalchemy.orm import Session, selectinload

from service.orm import CatalogModel, Head, ImportanceRun, ImportanceScore, PruningCurve


def head_ids(session: Session, model_id: int) -> dict[tuple[str, int, int], int]:
    """``{(stack, layer, head): head id}`` of a model's catalogued heads."""
    rows = session.execute(select(Head.stack, Head.layer, Head.head, Head.id).where(Head.model_id == model_id))
    return {(stack, layer, head): head_id for stack, layer, head, head_id in rows}


def get_importance_run(session: Session, run_id: int) -> ImportanceRun | None:
    return session.get(ImportanceRun, run_id)


def importance_runs(
    session: Session, model_id: int, *, loss: str | None = None, limit: int = 20, offset: int = 0
) -> Sequence[ImportanceRun]:
    """A model's importance runs, newest first."""
    stmt = select(ImportanceRun).where(ImportanceRun.model_id == model_id, ImportanceRun.status == "complete")
    if loss is not None:
        stmt = stmt.where(ImportanceRun.loss == loss)
    return session.scalars(stmt.order_by(ImportanceRun.id.desc()).limit(limit).offset(offset)).all()


def scores(session: Session, run_id: int) -> list[tuple[str, int, int, float, float]]:
    """``(stack, layer, head, raw, normalized)`` of one run, in head order."""
    rows = session.execute(
        select(Head.stack, Head.layer, Head.head, ImportanceScore.raw, ImportanceScore.normalized)
        .join(Head, (Head.model_id == ImportanceScore.model_id) & (Head.id == ImportanceScore.head_id))
        .where(
            ImportanceScore.model_id
            == select(ImportanceRun.model_id).where(ImportanceRun.id == run_id).scalar_subquery(),
            ImportanceScore.run_id == run_id,
        )
        .order_by(Head.stack, Head.layer, Head.head)
    )
    return [(stack, layer, head, raw, normalized) for stack, layer, head, raw, normalized in rows]


def get_curve(session: Session, curve_id: int) -> PruningCurve | None:
    return session.scalar(
        select(PruningCurve).options(selectinload(PruningCurve.points)).where(PruningCurve.id == curve_id)
    )


def curves(session: Session, model_id: int, *, limit: int = 20, offset: int = 0) -> Sequence[PruningCurve]:
    """A model's pruning curves with their points, newest first."""
    stmt = (
        select(PruningCurve)
        .options(selectinload(PruningCurve.points))
        .where(PruningCurve.model_id == model_id, PruningCurve.status == "complete")
        .order_by(PruningCurve.id.desc())
    )
    return session.scalars(stmt.limit(limit).offset(offset)).all()


def latest_scores(session: Session, model_id: int) -> dict[tuple[str, int, int], tuple[float, float, int]]:
    """``(stack, layer, head) -> (normalized, raw, importance run id)`` from the ``head_importance`` view."""
    rows = session.execute(
        text(
            "SELECT stack, layer, head, importance, importance_raw, importance_run_id FROM head_importance "
            "WHERE model_id = :model_id"
        ),
        {"model_id": model_id},
    )
    return {(stack, layer, head): (norm, raw, run) for stack, layer, head, norm, raw, run in rows}


def model_name(session: Session, model_id: int) -> str:
    return session.get_one(CatalogModel, model_id).name
