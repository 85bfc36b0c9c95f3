"""Stability of a stored clustering (SPEC section 3): R fits on random subsets of its heads."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import numpy as np
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from service import current
from service.clusterings.schemas import Algorithm, StabilityCreate
from service.clusterings.service import load_global_matrix, load_matrix
from service.errors import NotFound
from service.jobs.runner import Progress, Writer
from service.orm import Cluster, Clustering, HeadAssignment, StabilityHead, StabilityRun

log = logging.getLogger(__name__)


def require_clustering(session: Session, clustering_id: int) -> Clustering:
    clustering = session.scalar(
        select(Clustering)
        .where(Clustering.id == clustering_id)
        .options(selectinload(Clustering.clusters), selectinload(Clustering.feature_runs))
    )
    if clustering is None:
        raise NotFound(f"clustering: no clustering with id {clustering_id}", field="clustering")
    return clustering


def clustering_labels(session: Session, clustering_id: int, model_ids: np.ndarray, head_ids: np.ndarray) -> np.ndarray:
    """``(n,)`` the stored cluster index of each ``(model_id, head_id)`` in the clustering."""
    rows = session.execute(
        select(HeadAssignment.model_id, HeadAssignment.head_id, Cluster.index)
        .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
        .where(HeadAssignment.clustering_id == clustering_id)
    ).all()
    index = {(int(m), int(h)): int(i) for m, h, i in rows}
    return np.array([index[(int(m), int(h))] for m, h in zip(model_ids, head_ids, strict=True)], dtype=np.intp)


def prepare(sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer:
    """The job handler: refit on R random subsets, align to the stored centroids, store the result:
    the run, and per head whether its label is the same in every fit (``stable``) and the share of
    fits that give it the clustering's type (``agreement``)."""
    from ingest.stability import StabilityAnalysis

    clustering_id = int(request["clustering_id"])
    spec = StabilityCreate.model_validate({k: v for k, v in request.items() if k != "clustering_id"})
    with sessions() as session:
        clustering = require_clustering(session, clustering_id)
        runs = sorted(clustering.feature_runs, key=lambda r: r.id)
        stacks = clustering.params.get("stacks")  # the heads it was fitted on (clusterings before stacks: all)
        if clustering.vector == "global":  # the very attribution runs it was fitted on
            from service.orm import AttributionRun

            ids = clustering.params.get("attribution_run_ids", [])
            attributions = [session.get_one(AttributionRun, run_id) for run_id in ids]
            matrix = load_global_matrix(session, runs, attributions, stacks)
        else:
            matrix = load_matrix(session, runs, stacks)
        centroids = np.array([c.centroid for c in clustering.clusters], dtype=np.float64)
        labels = clustering_labels(session, clustering_id, matrix.model_ids, matrix.head_ids)
        algorithm, k, num_windows = cast(Algorithm, clustering.algorithm), clustering.k, clustering.num_windows
    started = time.perf_counter()
    analysis = StabilityAnalysis(
        algorithm=algorithm,
        n_clusters=k,
        n_runs=spec.n_runs,
        fraction=spec.fraction,
        random_state=spec.seed,
        num_windows=num_windows,
    ).fit(matrix.vectors, reference_centroids=centroids, reference_labels=labels)
    agreements = analysis.agreement_
    assert agreements is not None  # reference labels were given
    seconds = time.perf_counter() - started
    log.info("Stability of clustering %d: %.2f%% of %d heads stable over %d fits (%.1f s)",
             clustering_id, 100 * analysis.score_, len(matrix.vectors), spec.n_runs, seconds)  # fmt: skip

    def write(session: Session) -> dict[str, Any]:
        run = StabilityRun(
            clustering_id=clustering_id,
            n_runs=spec.n_runs,
            fraction=spec.fraction,
            random_state=spec.seed,
            seeds=[int(s) for s in analysis.seeds_],
            score=float(analysis.score_),
            num_heads=len(matrix.vectors),
            seconds=seconds,
        )
        session.add(run)
        session.flush()
        current.completed(session, run)
        session.execute(
            insert(StabilityHead),
            [
                {
                    "model_id": int(model_id),
                    "stability_run_id": run.id,
                    "head_id": int(head_id),
                    "stable": bool(stable),
                    "agreement": float(agreement),
                }
                for model_id, head_id, stable, agreement in zip(
                    matrix.model_ids, matrix.head_ids, analysis.stable_, agreements, strict=True
                )
            ],
        )
        return {"stability_run_id": run.id, "score": float(analysis.score_)}

    return write
