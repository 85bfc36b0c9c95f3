"""SQL for exports: every head of one model with its features, and its type in a clustering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.heads.repository import FEATURE_COLUMNS, HeadFilter, select_heads
from service.orm import Cluster, Clustering, Head, HeadAssignment, StabilityHead

_HEAD = (Head.id.label("head_id"), Head.stack, Head.layer, Head.head)


def typed_heads(session: Session, model_id: int, clustering_id: int) -> Sequence[Any]:
    """The model's heads in a clustering: type, centroid, the features the clustering used, the type's
    margin and its agreement in the clustering's current stability run (None without one)."""
    filters = HeadFilter(model_id=model_id, clustering_id=clustering_id)
    latest = select(Clustering.current_stability_run_id).where(Clustering.id == clustering_id).scalar_subquery()
    agreement = (
        select(StabilityHead.agreement)
        .where(
            StabilityHead.model_id == Head.model_id,
            StabilityHead.head_id == Head.id,
            StabilityHead.stability_run_id == latest,
        )
        .correlate(Head)
        .scalar_subquery()
        .label("agreement")
    )
    columns = [*_HEAD, *FEATURE_COLUMNS, Cluster.name.label("type"), Cluster.centroid, HeadAssignment.margin, agreement]
    return session.execute(select_heads(filters, columns).order_by(Head.layer, Head.head)).all()


def untyped_heads(session: Session, model_id: int, feature_run_id: int) -> Sequence[Any]:
    """The model's heads with the features of one feature run, before any clustering."""
    filters = HeadFilter(model_id=model_id, feature_run_id=feature_run_id)
    return session.execute(select_heads(filters, [*_HEAD, *FEATURE_COLUMNS]).order_by(Head.layer, Head.head)).all()


def cluster_names(session: Session, clustering_id: int) -> list[str]:
    stmt = select(Cluster.name).where(Cluster.clustering_id == clustering_id).order_by(Cluster.index)
    return list(session.scalars(stmt))
