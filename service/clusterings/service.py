"""Cluster the heads of one or more models (jointly) and make the result their current clustering.

The clustering, its clusters and every head's assignment are written in one transaction
that also switches the models' ``current_clustering_id``: a query sees the old clustering
or the new one, never a mix.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from service.errors import InvalidInput, known
from service.models import repository as models
from service.orm import (
    CatalogModel,
    Cluster,
    Clustering,
    FeatureRun,
    Head,
    HeadAssignment,
    HeadFeatures,
    clustering_feature_runs,
)

log = logging.getLogger(__name__)

Algorithm = Literal["kmeans", "gmm"]


@dataclass(frozen=True)
class ClusteringRequest:
    models: tuple[str, ...]
    k: int = 4
    seed: int = 0
    algorithm: Algorithm = "kmeans"
    feature_run_ids: tuple[int, ...] = field(default=())  # explicit runs instead of the models' latest


@dataclass(frozen=True)
class HeadMatrix:
    """The stacked head vectors of the feature runs being clustered."""

    runs: list[FeatureRun]
    model_ids: np.ndarray  # (n,)
    head_ids: np.ndarray  # (n,)
    run_ids: np.ndarray  # (n,)
    vectors: np.ndarray  # (n, num_windows + 5)
    num_windows: int


def resolve_runs(session: Session, request: ClusteringRequest) -> list[FeatureRun]:
    """The feature runs to cluster: explicit ids, else each named model's latest complete run."""
    if not request.models and not request.feature_run_ids:
        raise InvalidInput("models: name at least one model (or feature run)", field="models")
    runs: list[FeatureRun] = []
    for run_id in request.feature_run_ids:
        run = session.get(FeatureRun, run_id)
        if run is None or run.status != "complete":
            raise InvalidInput(
                f"feature_runs: no complete feature run with id {run_id}", field="feature_runs"
            )
        runs.append(run)
    for name in dict.fromkeys(request.models):
        model = models.require(session, name, field="models")
        run = models.latest_complete_run(session, model.id)
        if run is None:
            raise InvalidInput(
                f"models: {name!r} has no complete feature run; ingest it first", field="models"
            )
        runs.append(run)
    if len({r.model_id for r in runs}) != len(runs):
        raise InvalidInput("feature_runs: give at most one feature run per model", field="feature_runs")
    windows = {r.num_windows for r in runs}
    if len(windows) > 1:
        raise InvalidInput(
            f"feature_runs: runs with different window counts ({sorted(windows)}) cannot be clustered together",
            field="feature_runs",
        )
    return runs


def load_matrix(session: Session, runs: list[FeatureRun]) -> HeadMatrix:
    rows = session.execute(
        select(Head.model_id, HeadFeatures.head_id, HeadFeatures.feature_run_id, HeadFeatures.vector)
        .join(Head, Head.id == HeadFeatures.head_id)
        .where(HeadFeatures.feature_run_id.in_([r.id for r in runs]))
        .order_by(HeadFeatures.feature_run_id, Head.layer, Head.head)
    ).all()
    return HeadMatrix(
        runs=runs,
        model_ids=np.array([r[0] for r in rows], dtype=np.int64),
        head_ids=np.array([r[1] for r in rows], dtype=np.int64),
        run_ids=np.array([r[2] for r in rows], dtype=np.int64),
        vectors=np.array([r[3] for r in rows], dtype=np.float64).reshape(len(rows), -1),
        num_windows=runs[0].num_windows,
    )


def validate_k(request: ClusteringRequest, num_heads: int) -> None:
    if request.k < 2:
        raise InvalidInput(f"k: must be at least 2, got {request.k}", field="k")
    if request.k > num_heads:
        raise InvalidInput(f"k: {request.k} clusters but only {num_heads} heads to cluster", field="k")
    if request.algorithm not in ("kmeans", "gmm"):
        raise InvalidInput(
            f"algorithm: unknown algorithm {request.algorithm!r}; known: {known(('kmeans', 'gmm'))}",
            field="algorithm",
        )


def cluster(session: Session, request: ClusteringRequest) -> int:
    """Fit, name, embed and store a clustering; make it current for its models. Flushes only."""
    from ingest.clustering import HeadClusterer, tsne_embedding

    runs = resolve_runs(session, request)
    matrix = load_matrix(session, runs)
    validate_k(request, len(matrix.vectors))
    started = time.perf_counter()
    clusterer = HeadClusterer(
        algorithm=request.algorithm,
        n_clusters=request.k,
        random_state=request.seed,
        num_windows=matrix.num_windows,
    ).fit(matrix.vectors)
    embedding = tsne_embedding(matrix.vectors, random_state=request.seed)
    seconds = time.perf_counter() - started
    log.info(
        "Clustered %d heads of %d feature run(s) into %s in %.1f s",
        len(matrix.vectors), len(runs), ", ".join(clusterer.names_), seconds,
    )  # fmt: skip
    return store(session, request, matrix, clusterer, embedding, seconds)


def store(
    session: Session,
    request: ClusteringRequest,
    matrix: HeadMatrix,
    clusterer: Any,
    embedding: np.ndarray,
    seconds: float,
) -> int:
    clustering = Clustering(
        algorithm=request.algorithm,
        k=request.k,
        seed=request.seed,
        num_windows=matrix.num_windows,
        params=clusterer.get_params(),
        status="complete",
        num_heads=len(matrix.vectors),
        seconds=seconds,
        finished_at=datetime.now(UTC),
    )
    session.add(clustering)
    session.flush()
    session.execute(
        insert(clustering_feature_runs),
        [{"clustering_id": clustering.id, "feature_run_id": r.id} for r in matrix.runs],
    )
    cluster_ids = []
    for index, name in enumerate(clusterer.names_):
        row = Cluster(
            clustering_id=clustering.id,
            index=index,
            name=name,
            centroid=clusterer.centroids_[index].tolist(),
            size=int(clusterer.sizes_[index]),
            share=float(clusterer.shares_[index]),
        )
        session.add(row)
        session.flush()
        cluster_ids.append(row.id)
    session.execute(
        insert(HeadAssignment),
        [
            {
                "clustering_id": clustering.id,
                "head_id": int(head_id),
                "cluster_id": cluster_ids[int(label)],
                "feature_run_id": int(run_id),
                "tsne_x": _finite_or_none(xy[0]),
                "tsne_y": _finite_or_none(xy[1]),
            }
            for head_id, run_id, label, xy in zip(
                matrix.head_ids, matrix.run_ids, clusterer.labels_, embedding, strict=True
            )
        ],
    )
    model_ids = sorted({int(m) for m in matrix.model_ids})
    session.execute(
        update(CatalogModel).where(CatalogModel.id.in_(model_ids)).values(current_clustering_id=clustering.id)
    )
    session.flush()
    return clustering.id


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None
