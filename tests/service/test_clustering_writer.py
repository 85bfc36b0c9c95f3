"""The clustering writer stores every head under the cluster its vector belongs to.

The catalog is written with vectors drawn here (``tests/service/synthetic.py``); the stored rows are
read back by plain SQL and checked against values computed in the test: every cluster's centroid is
the numpy mean of the vectors of the heads stored under it, its size and share are their count, each
head's stored cluster is the nearest stored centroid (K-means), the partition is plain scikit-learn
K-means' on the same vectors, and names, centroids and the t-SNE map are those of a fit in the test.
Caught, among others: a head stored under the next cluster, a model's vectors read from another
run, a global clustering made current.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sklearn.cluster import KMeans
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from ingest.clustering import HeadClusterer, tsne_embedding
from service.clusterings.schemas import ClusteringCreate
from service.clusterings.service import cluster
from service.errors import InvalidInput, NotFound
from service.jobs.runner import run_inline
from tests.service.synthetic import dirichlet, store_attribution, store_model

D = 21  # features of a head at 16 windows


def grouped(rng: np.random.Generator, layers: int, heads: int, groups: list[int]) -> np.ndarray:
    """``(layers, heads, 21)`` vectors, head ``i`` (row-major) peaked on feature ``groups[i]``: clear clusters."""
    out = np.empty((layers, heads, D))
    for i in range(layers * heads):
        alpha = np.full(D, 0.2)
        alpha[groups[i]] = 40.0
        out[divmod(i, heads)] = rng.dirichlet(alpha)
    return out


def sql(session: Session, query: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in session.execute(text(query), params).mappings()]


def stored_clustering(session: Session, clustering_id: int) -> dict[str, Any]:
    """The clustering row, its clusters by index, and every assignment in the clustering's row order."""
    return {
        "row": sql(session, "SELECT * FROM clusterings WHERE id = :c", c=clustering_id)[0],
        "clusters": sql(session, "SELECT * FROM clusters WHERE clustering_id = :c ORDER BY index", c=clustering_id),
        "assignments": sql(
            session,
            "SELECT a.*, h.stack, h.layer, h.head FROM head_assignments a JOIN heads h"
            " ON h.model_id = a.model_id AND h.id = a.head_id WHERE a.clustering_id = :c"
            " ORDER BY a.feature_run_id, h.layer, h.head",
            c=clustering_id,
        ),
        "runs": [
            r["feature_run_id"]
            for r in sql(
                session,
                "SELECT feature_run_id FROM clustering_feature_runs WHERE clustering_id = :c ORDER BY feature_run_id",
                c=clustering_id,
            )
        ],  # fmt: skip
    }


def vectors_of(session: Session, assignments: list[dict[str, Any]]) -> np.ndarray:
    """Each assigned head's stored feature vector, in the assignments' order (plain SQL)."""
    rows = {
        (r["feature_run_id"], r["head_id"]): r["vector"]
        for r in sql(session, "SELECT feature_run_id, head_id, vector FROM head_features")
    }
    return np.array([rows[a["feature_run_id"], a["head_id"]] for a in assignments], dtype=np.float64)


def check_partition(found: dict[str, Any], vectors: np.ndarray, k: int) -> np.ndarray:
    """Centroids are the means of their heads, sizes and shares their counts, each head's cluster its nearest
    centroid, and the partition plain K-means'. Returns every head's cluster index."""
    index_of = {c["id"]: c["index"] for c in found["clusters"]}
    labels = np.array([index_of[a["cluster_id"]] for a in found["assignments"]])
    centroids = np.array([c["centroid"] for c in found["clusters"]])
    assert [c["index"] for c in found["clusters"]] == list(range(k))
    for c in found["clusters"]:
        members = vectors[labels == c["index"]]
        np.testing.assert_allclose(c["centroid"], members.mean(axis=0), atol=1e-12)
        assert c["size"] == len(members)
        assert c["share"] == pytest.approx(len(members) / len(vectors))
    nearest = np.linalg.norm(vectors[:, None] - centroids[None], axis=-1).argmin(axis=1)
    assert (nearest == labels).all()
    reference = KMeans(n_clusters=k, n_init=50, random_state=0).fit(vectors).labels_
    assert {frozenset(np.flatnonzero(labels == i)) for i in range(k)} == {
        frozenset(np.flatnonzero(reference == i)) for i in range(k)
    }
    return labels


@pytest.mark.parametrize("how", ["job", "cluster"])
def test_every_head_is_stored_under_the_cluster_its_vector_belongs_to(
    sessions: sessionmaker[Session], tiny_bert_path: Path, how: str
) -> None:
    rng = np.random.default_rng(0)
    groups = {"wa": [0, 0, 5, 5, 10, 10, 16, 0], "wb": [5, 10, 16, 16, 0, 5, 10, 16]}
    with sessions() as session, session.begin():
        old = {name: store_model(session, tiny_bert_path, name, {"encoder": dirichlet(rng, 2, 4)}) for name in groups}
        runs = {name: store_model(session, tiny_bert_path, name, {"encoder": grouped(rng, 2, 4, g)}, add_run=True)
                for name, g in groups.items()}  # fmt: skip  # the latest run of each model is clustered
    request = {"models": ["wb", "wa", "wb"], "k": 4, "seed": 3}
    if how == "job":
        job = run_inline(sessions, "clustering", request)
        assert job.status == "succeeded", job.error
        assert job.result is not None
        clustering_id = job.result["clustering_id"]
    else:
        with sessions() as session, session.begin():
            session.execute(text("SET LOCAL TIME ZONE 'Asia/Tokyo'"))  # times are real times, whatever the zone
            clustering_id = cluster(session, ClusteringCreate.model_validate(request))
    with sessions() as session:
        found = stored_clustering(session, clustering_id)
        vectors = vectors_of(session, found["assignments"])
        models = {r["name"]: r for r in sql(session, "SELECT * FROM models")}
        run_of = {r["id"]: r["model_id"] for r in sql(session, "SELECT id, model_id FROM feature_runs")}
    assert found["runs"] == sorted(runs.values())
    assert not set(found["runs"]) & set(old.values())
    assert len(found["assignments"]) == 16
    assert [(a["layer"], a["head"]) for a in found["assignments"]] == [(la, h) for la in range(2) for h in range(4)] * 2
    for a in found["assignments"]:
        assert a["model_id"] == run_of[a["feature_run_id"]]
    labels = check_partition(found, vectors, 4)

    fit = HeadClusterer(algorithm="kmeans", n_clusters=4, random_state=3, num_windows=16).fit(vectors)
    assert (labels == fit.labels_).all()
    assert [c["name"] for c in found["clusters"]] == list(fit.names_)
    embedding = tsne_embedding(vectors, random_state=3)
    np.testing.assert_allclose([[a["tsne_x"], a["tsne_y"]] for a in found["assignments"]], embedding, rtol=1e-9)
    row = found["row"]
    assert (row["algorithm"], row["k"], row["seed"], row["num_windows"], row["status"]) == (
        "kmeans", 4, 3, 16, "complete",
    )  # fmt: skip
    assert (row["num_heads"], row["vector"]) == (16, "local")
    assert row["params"] == {**fit.get_params(), "stacks": ["encoder"], "stacks_default": True, "vector": "local"}
    assert abs(row["finished_at"] - datetime.now(UTC)) < timedelta(minutes=10)
    assert row["seconds"] > 0
    assert {name: models[name]["current_clustering_id"] for name in groups} == dict.fromkeys(groups, clustering_id)


def test_a_global_clustering_stores_the_attribution_vectors_and_is_not_made_current(
    sessions: sessionmaker[Session], tiny_bert_path: Path
) -> None:
    rng = np.random.default_rng(1)
    with sessions() as session, session.begin():
        for name, g in {"ga": [0, 0, 5, 5, 10, 10, 16, 16], "gb": [16, 10, 5, 0, 0, 5, 10, 16]}.items():
            store_model(session, tiny_bert_path, name, {"encoder": dirichlet(rng, 2, 4)})
            store_attribution(session, name, dirichlet(rng, 2, 4))  # an earlier run: not the one clustered
            store_attribution(session, name, grouped(rng, 2, 4, g))
            store_attribution(session, name, dirichlet(rng, 2, 4))
            session.execute(text("UPDATE attribution_runs SET status = 'running' WHERE id = (SELECT max(id) FROM"
                                 " attribution_runs)"))  # fmt: skip  # the newest is not complete
            # so it never became current: the one before it is, as its job made it (service/current.py)
            session.execute(text("UPDATE models SET current_attribution_run_id = (SELECT max(id) - 1 FROM"
                                 " attribution_runs WHERE model_id = models.id) WHERE name = :n"),
                            {"n": name})  # fmt: skip
    local = run_inline(sessions, "clustering", {"models": ["ga"], "k": 2, "seed": 0})
    job = run_inline(sessions, "clustering", {"models": ["ga", "gb"], "k": 4, "seed": 1, "vector": "global"})
    assert job.result is not None
    clustering_id = job.result["clustering_id"]
    with sessions() as session:
        found = stored_clustering(session, clustering_id)
        chosen = sql(session, "SELECT a.id, m.name FROM attribution_runs a JOIN models m ON m.id = a.model_id WHERE"
                     " a.id IN (SELECT max(id) - 1 FROM attribution_runs GROUP BY model_id) ORDER BY a.id")  # fmt: skip
        global_vectors = {
            (r["model_id"], r["head_id"]): r["vector"]
            for r in sql(
                session,
                "SELECT model_id, head_id, vector FROM head_attributions WHERE attribution_run_id = ANY(:ids)",
                ids=[c["id"] for c in chosen],
            )  # fmt: skip
        }
        current = {r["name"]: r["current_clustering_id"] for r in sql(session, "SELECT * FROM models")}
    assert [c["name"] for c in chosen] == ["ga", "gb"]
    vectors = np.array([global_vectors[a["model_id"], a["head_id"]] for a in found["assignments"]])
    check_partition(found, vectors, 4)
    assert found["row"]["vector"] == "global"
    assert found["row"]["params"]["attribution_run_ids"] == [c["id"] for c in chosen]
    assert found["row"]["params"]["vector"] == "global"
    assert local.result is not None
    assert current == {"ga": local.result["clustering_id"], "gb": None}  # the local types stay the models'


@pytest.mark.parametrize("how", ["job", "cluster"])
def test_a_clustering_of_one_stack_stores_that_stacks_heads_only(
    sessions: sessionmaker[Session], bart_path: Path, how: str
) -> None:
    """An encoder-decoder clustered on its decoder alone: its 8 decoder heads are stored, each under the cluster
    of its own vector, partitioned as plain K-means partitions those 8 vectors; no encoder or cross head."""
    rng = np.random.default_rng(3)
    stacks = {"encoder": grouped(rng, 2, 4, [16] * 8), "decoder": grouped(rng, 2, 4, [0, 5, 10, 16] * 2),
              "cross": grouped(rng, 2, 4, [5] * 8)}  # fmt: skip
    with sessions() as session, session.begin():
        store_model(session, bart_path, f"ed-{how}", stacks)
    request = {"models": [f"ed-{how}"], "k": 4, "seed": 0, "stacks": ["decoder"]}
    if how == "job":
        job = run_inline(sessions, "clustering", request)
        assert job.result is not None, job.error
        clustering_id = job.result["clustering_id"]
    else:
        with sessions() as session, session.begin():
            clustering_id = cluster(session, ClusteringCreate.model_validate(request))
    with sessions() as session:
        found = stored_clustering(session, clustering_id)
        vectors = vectors_of(session, found["assignments"])
    assert [(a["stack"], a["layer"], a["head"]) for a in found["assignments"]] == [
        ("decoder", layer, head) for layer in range(2) for head in range(4)
    ]
    np.testing.assert_allclose(vectors, stacks["decoder"].reshape(8, D), rtol=1e-12)
    check_partition(found, vectors, 4)
    assert found["row"]["num_heads"] == 8
    assert found["row"]["params"]["stacks"] == ["decoder"]


def test_a_clustering_is_fitted_as_asked_and_timed(
    sessions: sessionmaker[Session], tiny_bert_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing a default: a mixture (``gmm``), k = 3, 8-window vectors (13 features), seed 7, which the t-SNE map
    is given too; the stored labels and names are a fit of the same request in the test, and the stored time is
    the fit's, within the job's own."""
    import time

    import ingest.clustering

    seeds: list[int] = []
    real_tsne = ingest.clustering.tsne_embedding

    def tsne(X: np.ndarray, random_state: int = 0) -> np.ndarray:
        seeds.append(random_state)
        return real_tsne(X, random_state=random_state)

    monkeypatch.setattr(ingest.clustering, "tsne_embedding", tsne)
    rng = np.random.default_rng(5)
    with sessions() as session, session.begin():
        vectors = np.stack([rng.dirichlet(np.full(13, 0.5), size=4) for _ in range(2)])  # (2, 4, 13)
        store_model(session, tiny_bert_path, "asked", {"encoder": vectors}, num_windows=8)
    started = time.perf_counter()
    job = run_inline(sessions, "clustering", {"models": ["asked"], "k": 3, "seed": 7, "algorithm": "gmm"})
    elapsed = time.perf_counter() - started
    assert job.result is not None, job.error
    with sessions() as session:
        found = stored_clustering(session, job.result["clustering_id"])
    fit = HeadClusterer(algorithm="gmm", n_clusters=3, random_state=7, num_windows=8).fit(vectors.reshape(8, 13))
    index_of = {c["id"]: c["index"] for c in found["clusters"]}
    assert [index_of[a["cluster_id"]] for a in found["assignments"]] == fit.labels_.tolist()
    assert [c["name"] for c in found["clusters"]] == list(fit.names_)
    row = found["row"]
    assert (row["algorithm"], row["k"], row["seed"], row["num_windows"]) == ("gmm", 3, 7, 8)
    assert row["params"] == {**fit.get_params(), "stacks": ["encoder"], "stacks_default": True, "vector": "local"}
    assert seeds == [7]
    assert 0 < row["seconds"] <= elapsed


def test_a_global_clustering_of_one_model(sessions: sessionmaker[Session], tiny_bert_path: Path) -> None:
    rng = np.random.default_rng(4)
    with sessions() as session, session.begin():
        store_model(session, tiny_bert_path, "g1", {"encoder": dirichlet(rng, 2, 4)})
        attribution = grouped(rng, 2, 4, [0, 0, 5, 5, 10, 10, 16, 16])
        store_attribution(session, "g1", attribution)
    job = run_inline(sessions, "clustering", {"models": ["g1"], "k": 4, "seed": 0, "vector": "global"})
    assert job.result is not None, job.error
    with sessions() as session:
        found = stored_clustering(session, job.result["clustering_id"])
    assert found["row"]["num_windows"] == 16
    check_partition(found, attribution.reshape(8, D), 4)


def test_a_non_finite_map_coordinate_is_stored_as_null(
    sessions: sessionmaker[Session], tiny_bert_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.clustering

    rng = np.random.default_rng(2)
    with sessions() as session, session.begin():
        store_model(session, tiny_bert_path, "nan-map", {"encoder": grouped(rng, 2, 4, [0, 5, 10, 16] * 2)})
    embedding = np.arange(16, dtype=np.float64).reshape(8, 2)
    embedding[2, 0], embedding[5, 1] = np.nan, np.inf
    monkeypatch.setattr(ingest.clustering, "tsne_embedding", lambda X, random_state: embedding)
    job = run_inline(sessions, "clustering", {"models": ["nan-map"], "k": 4, "seed": 0})
    assert job.result is not None
    with sessions() as session:
        found = stored_clustering(session, job.result["clustering_id"])
    coordinates = [(a["tsne_x"], a["tsne_y"]) for a in found["assignments"]]
    expected: list[tuple[float | None, float | None]] = [(float(x), float(y)) for x, y in embedding]
    expected[2], expected[5] = (None, 5.0), (10.0, None)
    assert coordinates == expected


def refused(sessions: sessionmaker[Session], request: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(InvalidInput) as error:
        run_inline(sessions, "clustering", request)
    return error.value.message, error.value.field


def test_requests_that_cannot_be_clustered_are_refused_naming_the_field(
    sessions: sessionmaker[Session], client: TestClient, tiny_bert_path: Path, bart_path: Path
) -> None:
    rng = np.random.default_rng(3)
    with sessions() as session, session.begin():
        a1 = store_model(session, tiny_bert_path, "ra", {"encoder": dirichlet(rng, 2, 4)})
        a2 = store_model(session, tiny_bert_path, "ra", {"encoder": dirichlet(rng, 2, 4)}, add_run=True)
        narrow = store_model(session, tiny_bert_path, "rn", {"encoder": dirichlet(rng, 2, 4, 8)}, num_windows=8)
        store_model(session, bart_path, "rb", {s: dirichlet(rng, 2, 4) for s in ("encoder", "decoder", "cross")})
        store_model(session, tiny_bert_path, "rw", {"encoder": dirichlet(rng, 2, 4)})
        store_attribution(session, "rw", dirichlet(rng, 2, 4, 8), num_windows=8)
        failed = store_model(session, tiny_bert_path, "rf", {"encoder": dirichlet(rng, 2, 4)})
        store_model(session, bart_path, "re", {s: dirichlet(rng, 2, 4) for s in ("encoder", "decoder")})
        session.execute(text("UPDATE feature_runs SET status = 'failed' WHERE id = ANY(:r)"), {"r": [a1, failed]})
        # a failed run never became current (service/current.py): rf has none
        session.execute(text("UPDATE models SET current_feature_run_id = NULL WHERE current_feature_run_id = ANY(:r)"),
                        {"r": [a1, failed]})  # fmt: skip
    assert refused(sessions, {"models": []}) == (
        "models: name at least one model (or feature run, or a series)",
        "models",
    )
    with pytest.raises(NotFound) as unknown:
        run_inline(sessions, "clustering", {"models": ["nobody"]})
    assert (unknown.value.message, unknown.value.field) == (
        "models: no model named 'nobody'; known models: 'ra', 'rb', 're', 'rf', 'rn', 'rw'",
        "models",
    )
    for bad in (a1, 10**6):
        assert refused(sessions, {"feature_runs": [bad]}) == (
            f"feature_runs: no complete feature run with id {bad}",
            "feature_runs",
        )
    assert refused(sessions, {"feature_runs": [a2], "models": ["ra"]}) == (
        "feature_runs: give at most one feature run per model",
        "feature_runs",
    )
    assert refused(sessions, {"feature_runs": [narrow], "models": ["ra"], "k": 2}) == (
        "feature_runs: runs with different window counts ([8, 16]) cannot be clustered together",
        "feature_runs",
    )
    assert refused(sessions, {"models": ["ra"], "k": 9}) == ("k: 9 clusters but only 8 heads to cluster", "k")
    assert refused(sessions, {"models": ["rb"], "k": 17, "stacks": ["decoder", "cross"]}) == (
        "k: 17 clusters but only 16 heads to cluster",
        "k",
    )
    assert refused(sessions, {"models": ["rb", "ra"], "stacks": ["cross"]}) == (
        "stacks: 'ra' has no cross stack; its stacks: encoder",
        "stacks",
    )
    assert refused(sessions, {"models": ["rf"]}) == ("models: 'rf' has no complete feature run; ingest it first",
                                                     "models")  # fmt: skip
    assert refused(sessions, {"models": ["ra"], "stacks": ["decoder", "cross"]}) == (
        "stacks: 'ra' has no decoder or cross stack; its stacks: encoder",
        "stacks",
    )
    assert refused(sessions, {"models": ["re"], "stacks": ["cross"]}) == (
        "stacks: 're' has no cross stack; its stacks: encoder, decoder",
        "stacks",
    )
    answer = client.post("/clusterings", json={"models": ["ra"], "vector": "global"})  # refused before queueing
    assert (answer.status_code, answer.json()["field"]) == (422, "vector")
    assert refused(sessions, {"models": ["ra"], "vector": "global"}) == (
        "vector: 'ra' has no attribution run; run `headcat attribute ra` first",
        "vector",
    )
    assert refused(sessions, {"models": ["rw"], "vector": "global"}) == (
        "vector: 'rw''s attribution run has 8 windows, its feature run 16",
        "vector",
    )
    assert refused(sessions, {"feature_runs": [a2], "vector": "global"}) == (
        "vector: a global clustering takes models (their current attribution runs), not feature run ids",
        "vector",
    )
    every = run_inline(sessions, "clustering", {"models": ["ra", "rw"], "k": 16, "seed": 0})  # k: every head counted
    assert every.status == "succeeded", every.error
