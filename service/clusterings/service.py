"""Cluster the heads of one or more models (jointly) and make the result their current clustering.

Stacks (SPEC section 6): a clustering takes the stacks the request names (``stacks``); by
default **every stack of the named models**, clustered jointly, so one set of centroids names
every head of an encoder-decoder (its encoder, decoder and cross heads keep their stack, and the
read endpoints split shares and layers by stack). The stacks clustered are stored in the
clustering's ``params["stacks"]``; stability refits the same heads.

The clustering, its clusters and every head's assignment are written in one transaction
that also switches the models' ``current_clustering_id``: a query sees the old clustering
or the new one, never a mix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import STACKS
from service import current
from service.clusterings.repository import stack_order
from service.clusterings.schemas import ClusteringCreate
from service.errors import InvalidInput
from service.jobs.runner import Progress, Writer
from service.models import repository as models
from service.orm import (
    AttributionRun,
    CatalogModel,
    Cluster,
    Clustering,
    FeatureRun,
    Head,
    HeadAssignment,
    HeadAttribution,
    HeadFeatures,
    clustering_feature_runs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadMatrix:
    """The stacked head vectors of the feature runs being clustered."""

    runs: list[FeatureRun]
    model_ids: np.ndarray  # (n,)
    head_ids: np.ndarray  # (n,)
    run_ids: np.ndarray  # (n,)
    vectors: np.ndarray  # (n, num_windows + 5)
    num_windows: int
    attribution_runs: list[AttributionRun] | None = None  # vector="global": where the vectors come from


def model_names(session: Session, request: ClusteringCreate) -> list[str]:
    """The models named, then every step of the series named (in step order), each once."""
    names = list(request.models)
    if request.series is not None:
        from service.series import repository as series_repository

        found = series_repository.require(session, request.series, field="series")
        steps = [model.name for model in series_repository.steps(session, found.id)]
        if not steps:
            raise InvalidInput(f"series: {request.series!r} has no step; ingest its checkpoints first", field="series")
        names += steps
    return list(dict.fromkeys(names))


def resolve_runs(session: Session, request: ClusteringCreate) -> list[FeatureRun]:
    """The feature runs to cluster: explicit ids, and the current run of each named model and series step."""
    names = model_names(session, request)
    if not names and not request.feature_runs:
        raise InvalidInput("models: name at least one model (or feature run, or a series)", field="models")
    runs: list[FeatureRun] = []
    for run_id in request.feature_runs:
        run = session.get(FeatureRun, run_id)
        if run is None or run.status != "complete":
            raise InvalidInput(f"feature_runs: no complete feature run with id {run_id}", field="feature_runs")
        runs.append(run)
    for name in names:
        model = models.require(session, name, field="models")
        run = models.current_run(session, model)
        if run is None:
            raise InvalidInput(f"models: {name!r} has no complete feature run; ingest it first", field="models")
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


def attribution_runs(session: Session, request: ClusteringCreate, runs: list[FeatureRun]) -> list[AttributionRun]:
    """vector="global": each model's current attribution run, with the windows of its feature run."""
    if request.feature_runs:
        raise InvalidInput("vector: a global clustering takes models (their current attribution runs), "
                           "not feature run ids", field="vector")  # fmt: skip
    found = []
    for run in runs:
        latest = current.current_run(session, session.get_one(CatalogModel, run.model_id), "attribution")
        name = session.get_one(CatalogModel, run.model_id).name
        if latest is None:
            raise InvalidInput(f"vector: {name!r} has no attribution run; run `headcat attribute {name}` first",
                               field="vector")  # fmt: skip
        if latest.num_windows != run.num_windows:
            raise InvalidInput(f"vector: {name!r}'s attribution run has {latest.num_windows} windows, its feature run "
                               f"{run.num_windows}", field="vector")  # fmt: skip
        found.append(latest)
    return found


def load_global_matrix(
    session: Session,
    runs: list[FeatureRun],
    attributions: list[AttributionRun],
    stacks: Sequence[str] | None = None,
) -> HeadMatrix:
    """The global vectors of the attribution runs (heads in ``stacks``; None: every stack), each head
    assigned beside its model's feature run."""
    feature_run = {run.model_id: run.id for run in runs}
    rows = session.execute(
        select(Head.model_id, HeadAttribution.head_id, HeadAttribution.vector)
        .join(
            AttributionRun,
            (AttributionRun.model_id == HeadAttribution.model_id)
            & (AttributionRun.id == HeadAttribution.attribution_run_id),
        )
        .join(Head, (Head.model_id == HeadAttribution.model_id) & (Head.id == HeadAttribution.head_id))
        .where(
            AttributionRun.id.in_([r.id for r in attributions]),
            *([Head.stack.in_(list(stacks))] if stacks is not None else []),
        )
        .order_by(HeadAttribution.attribution_run_id, Head.stack, Head.layer, Head.head)
    ).all()
    return HeadMatrix(
        runs=runs,
        model_ids=np.array([r[0] for r in rows], dtype=np.int64),
        head_ids=np.array([r[1] for r in rows], dtype=np.int64),
        run_ids=np.array([feature_run[r[0]] for r in rows], dtype=np.int64),
        vectors=np.array([r[2] for r in rows], dtype=np.float64).reshape(len(rows), -1),
        num_windows=runs[0].num_windows,
        attribution_runs=attributions,
    )


def load_request_matrix(
    session: Session, request: ClusteringCreate, runs: list[FeatureRun], stacks: Sequence[str]
) -> HeadMatrix:
    if request.vector == "global":
        return load_global_matrix(session, runs, attribution_runs(session, request, runs), stacks)
    return load_matrix(session, runs, stacks)


def load_matrix(session: Session, runs: list[FeatureRun], stacks: Sequence[str] | None = None) -> HeadMatrix:
    """The heads of ``runs`` in ``stacks`` (None: every stack), by run, stack, layer, head."""
    stmt = (
        select(Head.model_id, HeadFeatures.head_id, HeadFeatures.feature_run_id, HeadFeatures.vector)
        .join(
            FeatureRun, (FeatureRun.model_id == HeadFeatures.model_id) & (FeatureRun.id == HeadFeatures.feature_run_id)
        )
        .join(Head, (Head.model_id == HeadFeatures.model_id) & (Head.id == HeadFeatures.head_id))
        .where(FeatureRun.id.in_([r.id for r in runs]))
        .order_by(HeadFeatures.feature_run_id, stack_order(), Head.layer, Head.head)
    )
    if stacks is not None:
        stmt = stmt.where(Head.stack.in_(list(stacks)))
    rows = session.execute(stmt).all()
    return HeadMatrix(
        runs=runs,
        model_ids=np.array([r[0] for r in rows], dtype=np.int64),
        head_ids=np.array([r[1] for r in rows], dtype=np.int64),
        run_ids=np.array([r[2] for r in rows], dtype=np.int64),
        vectors=np.array([r[3] for r in rows], dtype=np.float64).reshape(len(rows), -1),
        num_windows=runs[0].num_windows,
    )


def clustered_stacks(session: Session, request: ClusteringCreate, runs: list[FeatureRun]) -> list[str]:
    """The stacks to cluster: the request's, each held by every model; by default every stack of the models."""
    shapes = {r.model_id: models.shapes(session.get_one(CatalogModel, r.model_id)) for r in runs}
    present: list[str] = [name for name in STACKS if any(name in s for s in shapes.values())]
    if request.stacks is None:
        return present
    for r in runs:
        missing = [name for name in request.stacks if name not in shapes[r.model_id]]
        if missing:
            model = session.get_one(CatalogModel, r.model_id)
            raise InvalidInput(
                f"stacks: {model.name!r} has no {' or '.join(missing)} stack; "
                f"its stacks: {', '.join(shapes[r.model_id])}",
                field="stacks",
            )
    return list(request.stacks)


def validate(session: Session, request: ClusteringCreate) -> tuple[list[FeatureRun], list[str]]:
    """Everything that can be checked before any work: models, runs, stacks, k against the head count."""
    runs = resolve_runs(session, request)
    stacks = clustered_stacks(session, request, runs)
    num_heads = 0
    for r in runs:
        shapes = models.shapes(session.get_one(CatalogModel, r.model_id))
        num_heads += sum(layers * heads for name, (layers, heads) in shapes.items() if name in stacks)
    if request.k > num_heads:
        raise InvalidInput(f"k: {request.k} clusters but only {num_heads} heads to cluster", field="k")
    if request.vector == "global":
        attribution_runs(session, request, runs)  # each model has one
    return runs, stacks


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: fit on the stored features; the writer stores the clustering."""
    spec = ClusteringCreate.model_validate(request)
    with sessions() as session:
        runs, stacks = validate(session, spec)
        matrix = load_request_matrix(session, spec, runs, stacks)
    clusterer, embedding, seconds = fit(spec, matrix)

    def write(session: Session) -> dict[str, Any]:
        clustering_id = store(session, spec, matrix, clusterer, embedding, seconds, stacks)
        return {"clustering_id": clustering_id}

    return write


def cluster(session: Session, request: ClusteringCreate) -> int:
    """Fit, name, embed and store a clustering in ``session``; make it current. Flushes only."""
    runs, stacks = validate(session, request)
    matrix = load_request_matrix(session, request, runs, stacks)
    clusterer, embedding, seconds = fit(request, matrix)
    return store(session, request, matrix, clusterer, embedding, seconds, stacks)


def fit(request: ClusteringCreate, matrix: HeadMatrix) -> tuple[Any, np.ndarray, float]:
    from ingest.clustering import HeadClusterer, tsne_embedding

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
        len(matrix.vectors), len(matrix.runs), ", ".join(clusterer.names_), seconds,
    )  # fmt: skip
    return clusterer, embedding, seconds


def store(
    session: Session,
    request: ClusteringCreate,
    matrix: HeadMatrix,
    clusterer: Any,
    embedding: np.ndarray,
    seconds: float,
    stacks: Sequence[str],
) -> int:
    from ingest.clustering import margins

    # Each head's margin to the border of its cluster (head_assignments.margin): cheap (n x k
    # distances), so stored with the assignment rather than recomputed by every read that filters on it.
    margin = margins(matrix.vectors, clusterer.centroids_, clusterer.labels_)  # (n,)
    clustering = Clustering(
        algorithm=request.algorithm,
        k=request.k,
        seed=request.seed,
        num_windows=matrix.num_windows,
        params={
            **clusterer.get_params(),
            "stacks": list(stacks),
            "stacks_default": request.stacks is None,
            "vector": request.vector,
            **({"attribution_run_ids": [r.id for r in matrix.attribution_runs]} if matrix.attribution_runs else {}),
        },
        status="complete",
        num_heads=len(matrix.vectors),
        seconds=seconds,
        vector=request.vector,
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
                "model_id": int(model_id),
                "clustering_id": clustering.id,
                "head_id": int(head_id),
                "cluster_id": cluster_ids[int(label)],
                "feature_run_id": int(run_id),
                "tsne_x": _finite_or_none(xy[0]),
                "tsne_y": _finite_or_none(xy[1]),
                "margin": float(head_margin),
            }
            for model_id, head_id, run_id, label, xy, head_margin in zip(
                matrix.model_ids, matrix.head_ids, matrix.run_ids, clusterer.labels_, embedding, margin, strict=True
            )
        ],
    )
    model_ids = sorted({int(m) for m in matrix.model_ids})
    if request.vector == "global":  # the model's types stay those of its attention (the local vectors)
        session.flush()
        return clustering.id
    session.execute(
        update(CatalogModel).where(CatalogModel.id.in_(model_ids)).values(current_clustering_id=clustering.id)
    )
    session.flush()
    return clustering.id


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None
