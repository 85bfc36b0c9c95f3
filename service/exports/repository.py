"""SQL for exports: every head of one model with its features, and its type in a clustering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.heads.repository import FEATURE_COLUMNS, HeadFilter, select_heads
from service.orm import Cluster, Head

_HEAD = (Head.id.label("head_id"), Head.stack, Head.layer, Head.head)


def typed_heads(session: Session, model_id: int, clustering_id: int) -> Sequence[Any]:
    """The model's heads in a clustering: type, centroid and the features the clustering used."""
    filters = HeadFilter(model_id=model_id, clustering_id=clustering_id)
    columns = [*_HEAD, *FEATURE_COLUMNS, Cluster.name.label("type"), Cluster.centroid]
    return session.execute(select_heads(filters, columns).order_by(Head.layer, Head.head)).all()


def untyped_heads(session: Session, model_id: int, feature_run_id: int) -> Sequence[Any]:
    """The model's heads with the features of one feature run, before any clustering."""
    filters = HeadFilter(model_id=model_id, feature_run_id=feature_run_id)
    return session.execute(select_heads(filters, [*_HEAD, *FEATURE_COLUMNS]).order_by(Head.layer, Head.head)).all()


def cluster_names(session: Session, clustering_id: int) -> list[str]:
    stmt = select(Cluster.name).where(Cluster.clustering_id == clustering_id).order_by(Cluster.index)
    return list(session.scalars(stmt))
