"""SQL for reading clusterings and stability runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import case, select
from sqlalchemy.orm import Session

from ingest.types import STACKS
from service.orm import (
    CatalogModel,
    Cluster,
    Clustering,
    FeatureRun,
    Head,
    HeadAssignment,
    StabilityHead,
    StabilityRun,
    clustering_feature_runs,
)


def list_recent(session: Session, limit: int, offset: int) -> Sequence[Clustering]:
    return session.scalars(select(Clustering).order_by(Clustering.id.desc()).limit(limit).offset(offset)).all()


def current_for(session: Session, clustering_id: int) -> list[str]:
    return list(
        session.scalars(
            select(CatalogModel.name)
            .where(CatalogModel.current_clustering_id == clustering_id)
            .order_by(CatalogModel.name)
        )
    )


def covered_models(session: Session, clustering_id: int) -> Sequence[CatalogModel]:
    """The models the clustering was fitted on, by name, locked for the update that follows."""
    return session.scalars(
        select(CatalogModel)
        .where(
            CatalogModel.id.in_(
                select(FeatureRun.model_id)
                .join(clustering_feature_runs, clustering_feature_runs.c.feature_run_id == FeatureRun.id)
                .where(clustering_feature_runs.c.clustering_id == clustering_id)
            )
        )
        .order_by(CatalogModel.name)
        .with_for_update()
    ).all()


def head_rows(session: Session, clustering_id: int) -> Sequence[Any]:
    """Every head of the clustering: model, layer, head, type, feature run, t-SNE position."""
    return session.execute(
        select(
            CatalogModel.name.label("model"),
            Head.stack,
            Head.layer,
            Head.head,
            Cluster.name.label("type"),
            HeadAssignment.feature_run_id,
            HeadAssignment.tsne_x,
            HeadAssignment.tsne_y,
        )
        .select_from(HeadAssignment)
        .join(Head, (Head.model_id == HeadAssignment.model_id) & (Head.id == HeadAssignment.head_id))
        .join(CatalogModel, CatalogModel.id == Head.model_id)
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .where(HeadAssignment.clustering_id == clustering_id)
        .order_by(CatalogModel.name, stack_order(), Head.layer, Head.head)
    ).all()


def stack_order() -> Any:
    """``ORDER BY`` term putting stacks in STACKS order (encoder, decoder, cross)."""
    return case({name: i for i, name in enumerate(STACKS)}, value=Head.stack)


def stability_runs(session: Session, clustering_id: int) -> Sequence[StabilityRun]:
    return session.scalars(
        select(StabilityRun).where(StabilityRun.clustering_id == clustering_id).order_by(StabilityRun.id)
    ).all()


def stability_heads(session: Session, run: StabilityRun) -> Sequence[Any]:
    return session.execute(
        select(
            CatalogModel.name.label("model"),
            Head.stack,
            Head.layer,
            Head.head,
            Cluster.name.label("type"),
            StabilityHead.stable,
            StabilityHead.agreement,
            HeadAssignment.margin,
        )
        .select_from(StabilityHead)
        .join(Head, (Head.model_id == StabilityHead.model_id) & (Head.id == StabilityHead.head_id))
        .join(CatalogModel, CatalogModel.id == Head.model_id)
        .join(
            HeadAssignment,
            (HeadAssignment.model_id == StabilityHead.model_id)
            & (HeadAssignment.clustering_id == run.clustering_id)
            & (HeadAssignment.head_id == StabilityHead.head_id),
        )
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .where(StabilityHead.stability_run_id == run.id)
        .order_by(CatalogModel.name, stack_order(), Head.layer, Head.head)
    ).all()


def current_matching(
    session: Session, model: CatalogModel, feature_run_id: int, *, k: int, seed: int, algorithm: str
) -> Clustering | None:
    """The model's current clustering when it is exactly this request: its run alone, same k, seed, algorithm."""
    if model.current_clustering_id is None:
        return None
    clustering = session.get(Clustering, model.current_clustering_id)
    if clustering is None or (clustering.status, clustering.k, clustering.seed, clustering.algorithm) != (
        "complete", k, seed, algorithm
    ):  # fmt: skip
        return None
    runs = session.scalars(
        select(clustering_feature_runs.c.feature_run_id).where(clustering_feature_runs.c.clustering_id == clustering.id)
    ).all()
    return clustering if list(runs) == [feature_run_id] else None
