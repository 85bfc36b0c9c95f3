"""SQL for exports: every head of one model with its features, and its type in a clustering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from service.orm import Cluster, FeatureRun, Head, HeadAssignment, HeadFeatures


def _feature_columns() -> list[Any]:
    return [
        Head.id.label("head_id"),
        Head.layer,
        Head.head,
        HeadFeatures.feature_run_id,
        FeatureRun.num_windows,
        HeadFeatures.vector,
        HeadFeatures.entropy,
        HeadFeatures.prev_token,
        HeadFeatures.next_token,
        HeadFeatures.mean_distance,
        HeadFeatures.sep_to_sep,
    ]


def typed_heads(session: Session, model_id: int, clustering_id: int) -> Sequence[Any]:
    """The model's heads in a clustering: type, centroid and the features the clustering used."""
    return session.execute(
        select(*_feature_columns(), Cluster.name.label("type"), Cluster.centroid)
        .select_from(Head)
        .join(HeadAssignment, and_(HeadAssignment.head_id == Head.id, HeadAssignment.clustering_id == clustering_id))
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .join(
            HeadFeatures,
            and_(HeadFeatures.head_id == Head.id, HeadFeatures.feature_run_id == HeadAssignment.feature_run_id),
        )
        .join(FeatureRun, FeatureRun.id == HeadFeatures.feature_run_id)
        .where(Head.model_id == model_id)
        .order_by(Head.layer, Head.head)
    ).all()


def untyped_heads(session: Session, model_id: int, feature_run_id: int) -> Sequence[Any]:
    """The model's heads with the features of one feature run, before any clustering."""
    return session.execute(
        select(*_feature_columns())
        .select_from(Head)
        .join(HeadFeatures, and_(HeadFeatures.head_id == Head.id, HeadFeatures.feature_run_id == feature_run_id))
        .join(FeatureRun, FeatureRun.id == HeadFeatures.feature_run_id)
        .where(Head.model_id == model_id)
        .order_by(Head.layer, Head.head)
    ).all()


def cluster_names(session: Session, clustering_id: int) -> list[str]:
    stmt = select(Cluster.name).where(Cluster.clustering_id == clustering_id).order_by(Cluster.index)
    return list(session.scalars(stmt))
