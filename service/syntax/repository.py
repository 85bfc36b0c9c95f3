"""SQL for syntax runs, their baselines and per-head scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.orm import CatalogModel, Head, HeadSyntax, SyntaxBaseline, SyntaxRun


def head_ids(session: Session, model_id: int, stack: str) -> dict[tuple[int, int], int]:
    rows = session.execute(select(Head.layer, Head.head, Head.id).where(Head.model_id == model_id, Head.stack == stack))
    return {(layer, head): head_id for layer, head, head_id in rows}


def get_run(session: Session, run_id: int) -> SyntaxRun | None:
    return session.get(SyntaxRun, run_id)


def current_run(session: Session, model: CatalogModel) -> SyntaxRun | None:
    """The model's current syntax run (``service/current.py``)."""
    return None if model.current_syntax_run_id is None else session.get(SyntaxRun, model.current_syntax_run_id)


def model_name(session: Session, model_id: int) -> str:
    return session.get_one(CatalogModel, model_id).name


def baselines(session: Session, run_id: int) -> Sequence[SyntaxBaseline]:
    return session.scalars(
        select(SyntaxBaseline).where(SyntaxBaseline.syntax_run_id == run_id).order_by(SyntaxBaseline.relation)
    ).all()


def _model_of(run_id: int) -> Any:
    """The run's model, as a scalar subquery: the leading column of the head tables' keys."""
    return select(SyntaxRun.model_id).where(SyntaxRun.id == run_id).scalar_subquery()


def best_heads(session: Session, run_id: int, min_count: int) -> Sequence[Any]:
    """Per relation (with at least ``min_count`` pairs) the most accurate head, either direction."""
    ranked = (
        select(
            HeadSyntax.relation,
            HeadSyntax.direction,
            HeadSyntax.accuracy,
            HeadSyntax.count,
            Head.stack,
            Head.layer,
            Head.head,
            func.row_number()
            .over(
                partition_by=HeadSyntax.relation,
                order_by=(HeadSyntax.accuracy.desc(), Head.layer, Head.head, HeadSyntax.direction),
            )
            .label("rank"),
        )  # fmt: skip
        .join(Head, (Head.model_id == HeadSyntax.model_id) & (Head.id == HeadSyntax.head_id))
        .where(
            HeadSyntax.model_id == _model_of(run_id), HeadSyntax.syntax_run_id == run_id, HeadSyntax.count >= min_count
        )
        .subquery()
    )
    return session.execute(
        select(ranked, SyntaxBaseline.accuracy.label("baseline"), SyntaxBaseline.offset.label("baseline_offset"))
        .join(
            SyntaxBaseline,
            (SyntaxBaseline.syntax_run_id == run_id) & (SyntaxBaseline.relation == ranked.c.relation),
        )
        .where(ranked.c.rank == 1)
        .order_by(ranked.c.count.desc(), ranked.c.relation)
    ).all()


def matrix(session: Session, run_id: int, min_count: int) -> Sequence[Any]:
    """``(relation, layer, head, best accuracy of the two directions)`` of every head."""
    return session.execute(
        select(HeadSyntax.relation, Head.layer, Head.head, func.max(HeadSyntax.accuracy))
        .join(Head, (Head.model_id == HeadSyntax.model_id) & (Head.id == HeadSyntax.head_id))
        .where(
            HeadSyntax.model_id == _model_of(run_id), HeadSyntax.syntax_run_id == run_id, HeadSyntax.count >= min_count
        )
        .group_by(HeadSyntax.relation, Head.layer, Head.head)
        .order_by(HeadSyntax.relation, Head.layer, Head.head)
    ).all()
