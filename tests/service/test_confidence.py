"""Per-head confidence in the catalog: the clustering job stores each head's margin, the stability job
its agreement, and GET /heads, exports and the head_types view serve them.

Every stored number is checked against a recomputation from what plain SQL reads back (the head
vectors, the stored centroids, the stored run's seeds and fraction), with numpy, scikit-learn's
K-means and scipy's Hungarian matching, not headcat's code. The heads are drawn so that every
subset has one K-means optimum (tests/ingest/test_confidence.py), which any K-means finds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from tests.ingest.test_confidence import border_heads
from tests.service.synthetic import store_model

NAME = "confident"
LAYERS, HEADS = 10, 15  # 150 heads


@pytest.fixture(scope="module")
def wide_bert_path(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A random BERT of 10 layers x 15 heads (tiny widths), with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=30, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("wide-bert")
    BertModel(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path


@pytest.fixture
def confident(sessions: sessionmaker[Session], wide_bert_path: Path) -> tuple[int, int]:
    """The model stored with border_heads(140, 10, seed=2), clustered (k = 4) and its stability run
    (R = 10, half the heads, seed 3); returns (clustering id, stability run id)."""
    vectors = border_heads(140, 10, seed=2).reshape(LAYERS, HEADS, -1)
    with sessions() as session, session.begin():
        store_model(session, wide_bert_path, NAME, {"encoder": vectors})
    job = run_inline(sessions, "clustering", {"models": [NAME], "k": 4, "seed": 0})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    clustering = int(job.result["clustering_id"])
    job = run_inline(sessions, "stability", {"clustering_id": clustering, "n_runs": 10, "fraction": 0.5, "seed": 3})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    return clustering, int(job.result["stability_run_id"])


def stored(session: Session, clustering: int, run: int) -> dict[str, np.ndarray]:
    """By plain SQL, in (layer, head) order: vectors, cluster index, margin, agreement; and the centroids."""
    rows = session.execute(
        text(
            "SELECT f.vector, c.index, a.margin, s.agreement FROM head_assignments a"
            " JOIN heads h ON h.model_id = a.model_id AND h.id = a.head_id"
            " JOIN clusters c ON c.id = a.cluster_id"
            " JOIN head_features f ON f.model_id = a.model_id AND f.head_id = a.head_id"
            "   AND f.feature_run_id = a.feature_run_id"
            " LEFT JOIN stability_heads s ON s.model_id = a.model_id AND s.head_id = a.head_id"
            "   AND s.stability_run_id = :r"
            " WHERE a.clustering_id = :c ORDER BY h.layer, h.head"
        ),
        {"c": clustering, "r": run},
    ).all()
    centroids = session.execute(
        text("SELECT centroid FROM clusters WHERE clustering_id = :c ORDER BY index"), {"c": clustering}
    ).all()
    return {
        "X": np.array([r[0] for r in rows], dtype=np.float64),
        "labels": np.array([r[1] for r in rows], dtype=np.intp),
        "margin": np.array([r[2] for r in rows], dtype=np.float64),
        "agreement": np.array([np.nan if r[3] is None else r[3] for r in rows], dtype=np.float64),
        "centroids": np.array([r[0] for r in centroids], dtype=np.float64),
    }


def test_stored_margins_equal_a_recomputation_from_the_stored_vectors_and_centroids(
    sessions: sessionmaker[Session], confident: tuple[int, int]
) -> None:
    with sessions() as session:
        s = stored(session, *confident)
    dist = np.linalg.norm(s["X"][:, None, :] - s["centroids"][None, :, :], axis=-1)  # (n, k)
    own = dist[np.arange(len(dist)), s["labels"]]
    other = np.where(np.eye(4, dtype=bool)[s["labels"]], np.inf, dist).min(axis=1)
    np.testing.assert_allclose(s["margin"], (other - own) / np.maximum(own, other), atol=1e-12)
    assert (own <= dist.min(axis=1)).all()  # K-means: every head's own centroid is its nearest
    assert s["margin"].min() < 0.2 < 0.9 < s["margin"].max()  # border heads and deep ones


def test_stored_agreement_equals_a_recomputation_from_the_stored_run(
    sessions: sessionmaker[Session], confident: tuple[int, int]
) -> None:
    clustering, run = confident
    with sessions() as session:
        s = stored(session, clustering, run)
        seeds, fraction, n_runs, score = session.execute(
            text("SELECT seeds, fraction, n_runs, score FROM stability_runs WHERE id = :r"), {"r": run}
        ).one()
        flags = session.execute(
            text("SELECT s.stable FROM stability_heads s JOIN heads h ON h.model_id = s.model_id AND h.id = s.head_id"
                 " WHERE s.stability_run_id = :r ORDER BY h.layer, h.head"), {"r": run}
        ).scalars().all()  # fmt: skip
    X, n = s["X"], len(s["X"])
    assert len(seeds) == n_runs == 10
    aligned = np.empty((n_runs, n), dtype=np.intp)
    for r, seed in enumerate(seeds):  # the stored recipe: the seed draws the subset and seeds the fit
        subset = np.sort(np.random.default_rng(seed).choice(n, size=round(fraction * n), replace=False))
        km = KMeans(n_clusters=4, n_init=10, random_state=seed).fit(X[subset])
        cost = np.linalg.norm(km.cluster_centers_[:, None, :] - s["centroids"][None, :, :], axis=-1)
        rows, cols = linear_sum_assignment(cost)
        mapping = np.empty(4, dtype=np.intp)
        mapping[rows] = cols
        aligned[r] = mapping[km.predict(X)]
    agreement = (aligned == s["labels"]).mean(axis=0)
    np.testing.assert_array_equal(s["agreement"], agreement)
    assert 0 < (agreement < 1).sum() < n  # some heads are uncertain, most are not
    assert list(flags) == list((aligned == aligned[0]).all(axis=0))
    assert score == float(np.mean(flags))


def test_heads_serve_filter_and_order_by_confidence(client: TestClient, confident: tuple[int, int]) -> None:
    everything = client.get("/heads", params={"model": NAME, "limit": 1000}).json()["items"]
    assert len(everything) == LAYERS * HEADS
    by_head = {(h["layer"], h["head"]): h for h in everything}
    assert all(0 <= h["agreement"] <= 1 and -1 <= h["margin"] <= 1 for h in everything)
    uncertain = client.get("/heads", params={"model": NAME, "agreement_lt": 1, "limit": 1000}).json()
    expected = sorted(k for k, h in by_head.items() if h["agreement"] < 1)
    assert sorted((h["layer"], h["head"]) for h in uncertain["items"]) == expected
    assert uncertain["total"] == len(expected) > 0
    certain = client.get("/heads", params={"model": NAME, "agreement_ge": 1, "margin_ge": 0.5, "limit": 1000}).json()
    assert certain["total"] == sum(h["agreement"] >= 1 and h["margin"] >= 0.5 for h in everything)
    ordered = client.get("/heads", params={"model": NAME, "order": "agreement", "limit": 1000}).json()["items"]
    values = [h["agreement"] for h in ordered]
    assert values == sorted(values)
    assert values[0] < 1
    ordered = client.get("/heads", params={"model": NAME, "order": "-margin", "limit": 5}).json()["items"]
    assert [h["margin"] for h in ordered] == sorted((h["margin"] for h in everything), reverse=True)[:5]
    answer = client.get("/heads", params={"model": NAME, "agreement_ge": 2})
    assert answer.status_code == 422
    assert "agreement_ge" in answer.text


def test_exports_keep_to_the_heads_whose_type_is_certain(
    client: TestClient, sessions: sessionmaker[Session], confident: tuple[int, int]
) -> None:
    clustering, run = confident
    with sessions() as session:
        s = stored(session, clustering, run)
    agreement = s["agreement"].reshape(LAYERS, HEADS)
    mask = client.get(f"/models/{NAME}/export", params={"format": "head_mask", "min_agreement": 0.8}).json()
    np.testing.assert_array_equal(np.array(mask) == 0, agreement >= 0.8)  # selected = pruned = 0
    both = client.get(f"/models/{NAME}/export", params={"format": "pairs", "min_agreement": 1, "min_margin": 0.5})
    margin = s["margin"].reshape(LAYERS, HEADS)
    expected = [[int(la), int(h)] for la, h in zip(*np.nonzero((agreement >= 1) & (margin >= 0.5)), strict=True)]
    assert both.json() == expected
    scores = client.get(f"/models/{NAME}/export", params={"format": "scores", "score": "agreement"}).json()
    np.testing.assert_array_equal(np.array(scores, dtype=np.float64), agreement)


def test_min_agreement_without_a_stability_run_is_a_422_naming_it(
    client: TestClient, sessions: sessionmaker[Session], wide_bert_path: Path
) -> None:
    with sessions() as session, session.begin():
        store_model(session, wide_bert_path, "unsure", {"encoder": border_heads(140, 10, 2).reshape(LAYERS, HEADS, -1)})
    assert run_inline(sessions, "clustering", {"models": ["unsure"], "k": 4}).status == "succeeded"
    answer = client.get("/models/unsure/export", params={"min_agreement": 0.9})
    assert answer.status_code == 422
    assert answer.json()["field"] == "min_agreement"
    assert "stability" in answer.json()["detail"]
    heads = client.get("/heads", params={"model": "unsure", "limit": 3}).json()["items"]
    assert [h["agreement"] for h in heads] == [None] * 3
    assert all(h["margin"] is not None for h in heads)


def test_the_head_types_view_has_margin_and_agreement(
    sessions: sessionmaker[Session], confident: tuple[int, int]
) -> None:
    clustering, run = confident
    with sessions() as session:
        s = stored(session, clustering, run)
        rows = session.execute(
            text("SELECT margin, agreement FROM current_head_types WHERE model = :m ORDER BY layer, head"), {"m": NAME}
        ).all()
    np.testing.assert_array_equal(np.array([r[0] for r in rows]), s["margin"])
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), s["agreement"])
