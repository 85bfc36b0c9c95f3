"""SQL for head queries shared with exports and the page (``GET /heads`` itself: :mod:`service.heads.query`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, select
from sqlalchemy.orm import Session

from service.orm import (
    CatalogModel,
    Cluster,
    FeatureRun,
    Head,
    HeadAssignment,
    HeadFeatures,
    clustering_feature_runs,
)


@dataclass(frozen=True)
class HeadFilter:
    model_id: int | None = None
    clustering_id: int | None = None  # None: each model's current clustering
    feature_run_id: int | None = None  # used when the model has no clustering yet
    type: str | None = None
    layer_gt: int | None = None
    layer_ge: int | None = None
    layer_lt: int | None = None
    layer_le: int | None = None
    head: int | None = None


def _conditions(f: HeadFilter) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if f.model_id is not None:
        where.append(Head.model_id == f.model_id)
    if f.layer_gt is not None:
        where.append(Head.layer > f.layer_gt)
    if f.layer_ge is not None:
        where.append(Head.layer >= f.layer_ge)
    if f.layer_lt is not None:
        where.append(Head.layer < f.layer_lt)
    if f.layer_le is not None:
        where.append(Head.layer <= f.layer_le)
    if f.head is not None:
        where.append(Head.head == f.head)
    if f.type is not None:
        where.append(Cluster.name == f.type)
    return where


# A head's features as stored: what every head query returns beside its own columns.
FEATURE_COLUMNS: tuple[Any, ...] = (
    HeadFeatures.feature_run_id,
    FeatureRun.num_windows,
    HeadFeatures.vector,
    HeadFeatures.entropy,
    HeadFeatures.prev_token,
    HeadFeatures.next_token,
    HeadFeatures.mean_distance,
    HeadFeatures.sep_to_sep,
)


def select_heads(f: HeadFilter, columns: list[Any]) -> Select[Any]:
    """Heads joined to their features, and (unless ``f.feature_run_id``) to their type in the
    filter's clustering or their model's current one; filtered by ``f``, unordered."""
    return _joined(f, columns).where(*_conditions(f))


def _joined(f: HeadFilter, columns: list[Any]) -> Select[Any]:
    stmt = select(*columns).select_from(Head).join(CatalogModel, CatalogModel.id == Head.model_id)
    if f.feature_run_id is not None:  # unclustered model: features only
        return stmt.join(
            HeadFeatures,
            and_(
                HeadFeatures.model_id == Head.model_id,
                HeadFeatures.head_id == Head.id,
                HeadFeatures.feature_run_id == f.feature_run_id,
            ),
        ).join(FeatureRun, FeatureRun.id == HeadFeatures.feature_run_id)
    clustering = f.clustering_id if f.clustering_id is not None else CatalogModel.current_clustering_id
    return (
        stmt.join(
            HeadAssignment,
            and_(
                HeadAssignment.model_id == Head.model_id,
                HeadAssignment.head_id == Head.id,
                HeadAssignment.clustering_id == clustering,
            ),
        )
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .join(
            HeadFeatures,
            and_(
                HeadFeatures.model_id == Head.model_id,
                HeadFeatures.head_id == Head.id,
                HeadFeatures.feature_run_id == HeadAssignment.feature_run_id,
            ),
        )
        .join(FeatureRun, FeatureRun.id == HeadFeatures.feature_run_id)
    )


def type_names(session: Session, clustering_id: int | None) -> list[str]:
    """Cluster names of one clustering, or of every model's current clustering."""
    stmt = select(Cluster.name).distinct().order_by(Cluster.name)
    if clustering_id is not None:
        stmt = stmt.where(Cluster.clustering_id == clustering_id)
    else:
        stmt = stmt.join(CatalogModel, CatalogModel.current_clustering_id == Cluster.clustering_id)
    return list(session.scalars(stmt))


def clustering_covers_model(session: Session, clustering_id: int, model_id: int) -> bool:
    """Whether the clustering was fitted on (among others) a feature run of this model."""
    found = session.scalar(
        select(FeatureRun.id)
        .join(clustering_feature_runs, clustering_feature_runs.c.feature_run_id == FeatureRun.id)
        .where(clustering_feature_runs.c.clustering_id == clustering_id, FeatureRun.model_id == model_id)
        .limit(1)
    )
    return found is not None
