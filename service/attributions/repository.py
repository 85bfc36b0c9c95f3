"""SQL for attribution runs and their heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.orm import AttributionRun, CatalogModel, Corpus, Head, HeadAttribution


def head_ids(session: Session, model_id: int, stack: str) -> dict[tuple[int, int], int]:
    rows = session.execute(select(Head.layer, Head.head, Head.id).where(Head.model_id == model_id, Head.stack == stack))
    return {(layer, head): head_id for layer, head, head_id in rows}


def get_run(session: Session, run_id: int) -> AttributionRun | None:
    return session.get(AttributionRun, run_id)


def runs(session: Session, model_id: int, limit: int, offset: int) -> Sequence[AttributionRun]:
    return session.scalars(
        select(AttributionRun)
        .where(AttributionRun.model_id == model_id, AttributionRun.status == "complete")
        .order_by(AttributionRun.id.desc())
        .limit(limit)
        .offset(offset)
    ).all()


def names(session: Session, run: AttributionRun) -> tuple[str, str]:
    """The run's model name and corpus source."""
    model = session.get_one(CatalogModel, run.model_id)
    corpus = session.get_one(Corpus, run.corpus_id)
    return model.name, corpus.source


def _model_of(run_id: int) -> Any:
    """The run's model, as a scalar subquery: the leading column of the head tables' keys."""
    return select(AttributionRun.model_id).where(AttributionRun.id == run_id).scalar_subquery()


def heads(session: Session, run_id: int) -> Sequence[Any]:
    """Every head of the run with its stored arrays, by stack, layer and head."""
    return session.execute(
        select(Head.stack, Head.layer, Head.head, HeadAttribution)
        .join(Head, (Head.model_id == HeadAttribution.model_id) & (Head.id == HeadAttribution.head_id))
        .where(HeadAttribution.model_id == _model_of(run_id), HeadAttribution.attribution_run_id == run_id)
        .order_by(Head.stack, Head.layer, Head.head)
    ).all()


def head(session: Session, run_id: int, stack: str, layer: int, head: int) -> HeadAttribution | None:
    return session.scalar(
        select(HeadAttribution)
        .join(Head, (Head.model_id == HeadAttribution.model_id) & (Head.id == HeadAttribution.head_id))
        .where(
            HeadAttribution.model_id == _model_of(run_id),
            HeadAttribution.attribution_run_id == run_id,
            Head.stack == stack,
            Head.layer == layer,
            Head.head == head,
        )
    )
