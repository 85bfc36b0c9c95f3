"""A stability job stores, for the clustering's own heads, what the analysis gives with the request's
R, fraction and seed and the stored clusters' centroids; an unknown clustering is a 404 naming it.

The analysis itself is checked against the SPEC rule in tests/ingest/test_stability.py; here the
inputs are read back by plain SQL (every head's stored vector, by layer and head) and the stored
rows compared with a fit of those, head by head."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.clustering import Algorithm
from ingest.stability import StabilityAnalysis
from service.jobs.runner import run_inline
from service.orm import Cluster, Clustering, Head, HeadFeatures, StabilityHead, StabilityRun, clustering_feature_runs
from tests.conftest import grant_key
from tests.service.conftest import TINY
from tests.service.synthetic import dirichlet, store_attribution, store_model


@pytest.mark.parametrize("k", [4, 3])  # 4: the fixture's clustering; 3: not the analysis' default k
def test_a_stability_run_stores_the_fit_of_the_clusterings_heads(
    sessions: sessionmaker[Session], tiny_clustered: int, k: int
) -> None:
    if k != 4:
        clustering_job = run_inline(sessions, "clustering", {"models": [TINY], "k": k, "seed": 0})
        assert clustering_job.result is not None
        tiny_clustered = int(clustering_job.result["clustering_id"])
    request = {"clustering_id": tiny_clustered, "n_runs": 3, "fraction": 0.75, "seed": 11}  # none a default
    started = time.monotonic()
    job = run_inline(sessions, "stability", request)
    took = time.monotonic() - started
    assert job.status == "succeeded", job.error
    assert job.result is not None
    with sessions() as session:
        run = session.get_one(StabilityRun, job.result["stability_run_id"])
        clustering = session.get_one(Clustering, tiny_clustered)
        links = clustering_feature_runs.c
        run_ids = session.scalars(select(links.feature_run_id).where(links.clustering_id == tiny_clustered)).all()
        rows = session.execute(
            select(Head.id, HeadFeatures.vector)
            .join(HeadFeatures, (HeadFeatures.model_id == Head.model_id) & (HeadFeatures.head_id == Head.id))
            .where(HeadFeatures.feature_run_id.in_(run_ids))
            .order_by(HeadFeatures.feature_run_id, Head.layer, Head.head)
        ).all()
        clusters = session.scalars(select(Cluster).where(Cluster.clustering_id == tiny_clustered)).all()
        by_index = sorted(clusters, key=lambda c: c.index)
        stored = dict(
            session.execute(
                select(StabilityHead.head_id, StabilityHead.stable).where(StabilityHead.stability_run_id == run.id)
            ).all()
        )
        algorithm = cast(Algorithm, clustering.algorithm)
        assert clustering.k == k

    vectors = np.array([vector for _, vector in rows], dtype=np.float64)
    centroids = np.array([c.centroid for c in by_index], dtype=np.float64)
    fit = StabilityAnalysis(algorithm=algorithm, n_clusters=k, n_runs=3, fraction=0.75, random_state=11).fit(
        vectors, reference_centroids=centroids
    )
    assert (run.clustering_id, run.n_runs, run.fraction, run.random_state) == (tiny_clustered, 3, 0.75, 11)
    assert run.seeds == [int(seed) for seed in fit.seeds_]
    assert run.num_heads == len(rows) == 8
    assert run.score == float(fit.score_)
    assert job.result == {"stability_run_id": run.id, "score": run.score}
    assert stored == {int(head_id): bool(flag) for (head_id, _), flag in zip(rows, fit.stable_, strict=True)}
    assert run.score == sum(stored.values()) / len(stored)  # the share of stable heads, as stored
    assert 0 < run.seconds <= took  # the fit's own time, within the job's


def test_stability_of_an_unknown_clustering_is_a_404_naming_it(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    body = {"detail": "clustering: no clustering with id 999999", "field": "clustering"}
    response = client.get("/clusterings/999999")
    assert (response.status_code, response.json()) == (404, body)
    headers = {"Authorization": f"Bearer {grant_key(sessions)}"}
    response = client.post("/clusterings/999999/stability", json={"n_runs": 2}, headers=headers)
    assert (response.status_code, response.json()) == (404, body)


# --- what the job fits: the clustering's own heads, vectors and centroids, with its algorithm ------------------


def clustering_of(sessions: sessionmaker[Session], request: dict[str, object]) -> int:
    job = run_inline(sessions, "clustering", request)
    assert job.status == "succeeded", job.error
    assert job.result is not None
    return int(job.result["clustering_id"])


def stability_of(sessions: sessionmaker[Session], clustering_id: int, **request: object) -> tuple[int, dict[int, bool]]:
    """Run a stability job; its run's ``num_heads`` and every stored head's flag (plain SQL)."""
    job = run_inline(sessions, "stability", {"clustering_id": clustering_id, **request})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    with sessions() as session:
        run_id = job.result["stability_run_id"]
        num_heads = session.execute(text("SELECT num_heads FROM stability_runs WHERE id = :r"), {"r": run_id}).one()[0]
        rows = session.execute(
            text("SELECT head_id, stable FROM stability_heads WHERE stability_run_id = :r"), {"r": run_id}
        ).all()
    return num_heads, {int(head_id): bool(stable) for head_id, stable in rows}


def clustered_vectors(
    sessions: sessionmaker[Session], clustering_id: int, stacks: tuple[str, ...]
) -> tuple[list[int], np.ndarray]:
    """The clustering's heads in ``stacks`` and their stored feature vectors, in the clustering's row order
    (feature run, then encoder, decoder, cross, then layer and head), by plain SQL."""
    with sessions() as session:
        rows = session.execute(
            text(
                "SELECT h.id, f.vector FROM head_features f"
                " JOIN heads h ON h.model_id = f.model_id AND h.id = f.head_id"
                " JOIN clustering_feature_runs c ON c.feature_run_id = f.feature_run_id"
                " WHERE c.clustering_id = :c AND h.stack = ANY(:stacks)"
                " ORDER BY f.feature_run_id,"
                " CASE h.stack WHEN 'encoder' THEN 0 WHEN 'decoder' THEN 1 ELSE 2 END, h.layer, h.head"
            ),
            {"c": clustering_id, "stacks": list(stacks)},
        ).all()
    return [int(r[0]) for r in rows], np.array([r[1] for r in rows], dtype=np.float64)


def stored_centroids(sessions: sessionmaker[Session], clustering_id: int) -> np.ndarray:
    with sessions() as session:
        rows = session.execute(
            text("SELECT centroid FROM clusters WHERE clustering_id = :c ORDER BY index"), {"c": clustering_id}
        ).all()
    return np.array([r[0] for r in rows], dtype=np.float64)


def flags(
    vectors: np.ndarray, centroids: np.ndarray | None, *, algorithm: Algorithm = "kmeans", k: int = 3,
    num_windows: int = 16, n_runs: int = 3, fraction: float = 0.5, seed: int = 0,
) -> np.ndarray:  # fmt: skip
    fit = StabilityAnalysis(algorithm=algorithm, n_clusters=k, n_runs=n_runs, fraction=fraction, random_state=seed,
                            num_windows=num_windows)  # fmt: skip
    return fit.fit(vectors, reference_centroids=centroids).stable_


def test_stability_refits_the_clustered_stacks_of_every_model(sessions: sessionmaker[Session], bart_path: Path) -> None:
    """Two encoder-decoders clustered on their encoder and cross heads: the job refits those 32 heads
    (not all 48), run by run in the clustering's order."""
    rng = np.random.default_rng(1)
    with sessions() as session, session.begin():
        for name in ("ed-a", "ed-b"):
            store_model(session, bart_path, name, {s: dirichlet(rng, 2, 4) for s in ("encoder", "decoder", "cross")})
    clustering = clustering_of(
        sessions, {"models": ["ed-b", "ed-a"], "k": 3, "seed": 0, "stacks": ["cross", "encoder"]}
    )
    num_heads, stored = stability_of(sessions, clustering, n_runs=3, fraction=0.5, seed=2)
    head_ids, vectors = clustered_vectors(sessions, clustering, ("encoder", "cross"))
    expected = flags(vectors, stored_centroids(sessions, clustering), seed=2)
    assert num_heads == len(head_ids) == 32
    assert stored == {head_id: bool(flag) for head_id, flag in zip(head_ids, expected, strict=True)}


def test_stability_of_a_global_clustering_refits_its_attribution_vectors(
    sessions: sessionmaker[Session], tiny_bert_path: Path
) -> None:
    """A clustering of attribution (global) vectors is refitted on those, not on the heads' feature vectors."""
    rng = np.random.default_rng(3)
    with sessions() as session, session.begin():
        runs = []
        for name in ("glob-a", "glob-b"):
            store_model(session, tiny_bert_path, name, {"encoder": dirichlet(rng, 2, 4)})
            runs.append(store_attribution(session, name, dirichlet(rng, 2, 4)))
    clustering = clustering_of(sessions, {"models": ["glob-a", "glob-b"], "k": 3, "seed": 0, "vector": "global"})
    num_heads, stored = stability_of(sessions, clustering, n_runs=3, fraction=0.5, seed=1)
    with sessions() as session:
        rows = session.execute(
            text(
                "SELECT h.id, a.vector FROM head_attributions a JOIN heads h ON h.model_id = a.model_id"
                " AND h.id = a.head_id WHERE a.attribution_run_id = ANY(:runs)"
                " ORDER BY a.attribution_run_id, h.layer, h.head"
            ),
            {"runs": runs},
        ).all()
    centroids = stored_centroids(sessions, clustering)
    expected = flags(np.array([r[1] for r in rows]), centroids, seed=1)
    assert num_heads == len(rows) == 16
    assert stored == {int(head_id): bool(flag) for (head_id, _), flag in zip(rows, expected, strict=True)}
    local_ids, local = clustered_vectors(sessions, clustering, ("encoder",))
    assert local_ids == [int(r[0]) for r in rows]
    assert (flags(local, centroids, seed=1) != expected).any()  # the feature vectors would give other flags


@pytest.mark.parametrize("algorithm", ["kmeans", "gmm"])
def test_the_fits_are_aligned_to_the_stored_centroids_with_the_clusterings_algorithm(
    sessions: sessionmaker[Session], tiny_bert_path: Path, algorithm: Algorithm
) -> None:
    """The stored centroids are the reference the fits are aligned to, whatever they are: here three of
    the heads' own vectors written over them by hand; and a GMM clustering is refitted as a GMM."""
    rng = np.random.default_rng(5)
    with sessions() as session, session.begin():
        for name in ("ref-a", "ref-b"):
            store_model(session, tiny_bert_path, name, {"encoder": dirichlet(rng, 2, 4)})
    clustering = clustering_of(sessions, {"models": ["ref-a", "ref-b"], "k": 3, "seed": 0, "algorithm": algorithm})
    head_ids, vectors = clustered_vectors(sessions, clustering, ("encoder",))
    reference = vectors[[0, 5, 11]]
    with sessions() as session, session.begin():
        for index, centroid in enumerate(reference):
            session.execute(
                text("UPDATE clusters SET centroid = :v WHERE clustering_id = :c AND index = :i"),
                {"v": centroid.tolist(), "c": clustering, "i": index},
            )
    _, stored = stability_of(sessions, clustering, n_runs=3, fraction=0.5, seed=2)
    expected = flags(vectors, reference, algorithm=algorithm, seed=2)
    assert stored == {head_id: bool(flag) for head_id, flag in zip(head_ids, expected, strict=True)}
    assert (flags(vectors, None, algorithm=algorithm, seed=2) != expected).any()  # a refitted reference differs
    if algorithm == "gmm":
        assert (flags(vectors, reference, algorithm="kmeans", seed=2) != expected).any()  # and so would K-means


def test_stability_of_a_clustering_with_other_windows_fits_its_width(
    sessions: sessionmaker[Session], tiny_bert_path: Path
) -> None:
    """A model ingested with 8 windows (13 features a head) is clustered, and its stability measured, on 13."""
    rng = np.random.default_rng(7)
    with sessions() as session, session.begin():
        store_model(session, tiny_bert_path, "narrow", {"encoder": dirichlet(rng, 2, 4, num_windows=8)}, num_windows=8)
    clustering = clustering_of(sessions, {"models": ["narrow"], "k": 3, "seed": 0})
    num_heads, stored = stability_of(sessions, clustering, n_runs=3, fraction=0.75, seed=4)
    head_ids, vectors = clustered_vectors(sessions, clustering, ("encoder",))
    assert vectors.shape == (8, 13)
    expected = flags(vectors, stored_centroids(sessions, clustering), num_windows=8, fraction=0.75, seed=4)
    assert num_heads == 8
    assert stored == {head_id: bool(flag) for head_id, flag in zip(head_ids, expected, strict=True)}
