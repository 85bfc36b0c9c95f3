"""A stability job stores, for the clustering's own heads, what the analysis gives with the request's
R, fraction and seed and the stored clusters' centroids; an unknown clustering is a 404 naming it.

The analysis itself is checked against the SPEC rule in tests/ingest/test_stability.py; here the
inputs are read back by plain SQL (every head's stored vector, by layer and head) and the stored
rows compared with a fit of those, head by head."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ingest.stability import StabilityAnalysis
from service.jobs.runner import run_inline
from service.orm import Cluster, Clustering, Head, HeadFeatures, StabilityHead, StabilityRun, clustering_feature_runs
from tests.conftest import grant_key
from tests.service.conftest import TINY


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
        algorithm = clustering.algorithm
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
