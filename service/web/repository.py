"""SQL for the page's read endpoints: example maps, a head's type history and stability."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.orm import (
    CatalogModel,
    Cluster,
    Clustering,
    FeatureRun,
    HeadAssignment,
    HeadFeatures,
    StabilityHead,
    clustering_feature_runs,
)


def example_maps(
    session: Session, model_id: int, feature_run_id: int, head_ids: Iterable[int]
) -> dict[int, list[list[float]]]:
    """head id -> its downsampled example attention map in the model's run (heads without one are left out)."""
    rows = session.execute(
        select(HeadFeatures.head_id, HeadFeatures.example_map).where(
            HeadFeatures.model_id == model_id,
            HeadFeatures.feature_run_id == feature_run_id,
            HeadFeatures.head_id.in_(list(head_ids)),
            HeadFeatures.example_map.is_not(None),
        )
    )
    return {head_id: example_map for head_id, example_map in rows.tuples() if example_map is not None}


def example_tokens(session: Session, feature_run_id: int) -> list[str] | None:
    return session.scalar(select(FeatureRun.example_tokens).where(FeatureRun.id == feature_run_id))


def type_history(session: Session, model_id: int, head_id: int) -> Sequence[Any]:
    """Every clustering the head is in, oldest first, with its type there."""
    return session.execute(
        select(
            Clustering.id.label("clustering_id"),
            Cluster.name.label("type"),
            Clustering.algorithm,
            Clustering.k,
            Clustering.seed,
            Clustering.vector,
            Clustering.created_at,
        )
        .select_from(HeadAssignment)
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .join(Clustering, Clustering.id == HeadAssignment.clustering_id)
        .where(HeadAssignment.model_id == model_id, HeadAssignment.head_id == head_id)
        .order_by(Clustering.id)
    ).all()


def clustering_models(session: Session, clustering_ids: Iterable[int]) -> dict[int, list[str]]:
    """clustering id -> the names of the models it was fitted on."""
    rows = session.execute(
        select(clustering_feature_runs.c.clustering_id, CatalogModel.name)
        .join(FeatureRun, FeatureRun.id == clustering_feature_runs.c.feature_run_id)
        .join(CatalogModel, CatalogModel.id == FeatureRun.model_id)
        .where(clustering_feature_runs.c.clustering_id.in_(list(clustering_ids)))
        .order_by(CatalogModel.name)
    )
    found: dict[int, list[str]] = defaultdict(list)
    for clustering_id, name in rows:
        found[clustering_id].append(name)
    return found


def latest_stability(session: Session, clustering_id: int, model_id: int, head_id: int) -> tuple[int, bool] | None:
    """(stability run id, stable) of the head in the clustering's current stability run, if any."""
    row = session.execute(
        select(StabilityHead.stability_run_id, StabilityHead.stable)
        .join(Clustering, Clustering.current_stability_run_id == StabilityHead.stability_run_id)
        .where(Clustering.id == clustering_id, StabilityHead.model_id == model_id, StabilityHead.head_id == head_id)
    ).first()
    return None if row is None else (row[0], row[1])
