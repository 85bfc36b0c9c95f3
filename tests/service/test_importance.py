"""Importance runs and pruning curves: ``POST /importance`` and ``POST /pruning-curves`` validate
everything before queueing, the jobs store what ``ingest.importance`` computes (checked here
against a direct computation), the ``head_importance`` view serves each head's latest scores, the
curves are served with their shared baseline, and the CLI refuses bad input with exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.errors import InvalidInput
from service.importance.service import curves_table
from service.jobs.runner import run_inline
from service.orm import ImportanceRun, ImportanceScore, Job, PruningCurve, PruningPoint
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
CLASSIFIER = "tinycls"
SENTENCES = [
    ("the film is a joy from start to finish .", 1),
    ("dull , flat and far too long", 0),
    ("a sharp , funny script with real heart", 1),
    ("nothing here works , not even the music", 0),
    ("it looks great", 1),
    ("i want my two hours back", 0),
]


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A random 2-layer, 4-head BERT classifier whose heads differ (query/key weights scaled up)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    # the ignore: num_labels is a PretrainedConfig kwarg, which BertConfig takes through **kwargs
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, num_labels=2)  # type: ignore[call-arg]  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attention.self.query." in name or ".attention.self.key." in name:
                param.mul_(6.0)
    path = tmp_path_factory.mktemp("tiny-classifier")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("importance-data") / "labelled.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in SENTENCES), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bad_labels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("importance-bad") / "labels.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": 5}) + "\n" for t, _ in SENTENCES), encoding="utf-8")
    return path


@pytest.fixture
def classifier(sessions: sessionmaker[Session], classifier_path: Path) -> str:
    job = run_inline(sessions, "ingest", ingest_request(classifier_path, name=CLASSIFIER, samples=8))
    assert job.status == "succeeded", job.error
    return CLASSIFIER


def jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def importance_request(data: Path, **overrides: Any) -> dict[str, Any]:
    request = {"model": CLASSIFIER, "data": str(data), "batch_size": 4, "device": "cpu"}
    return {**request, **overrides}


# --- the API: queued only when everything checks out ---------------------------------------------


def test_valid_requests_queue_one_gpu_job_each(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    answer = client.post("/importance", json=importance_request(labelled))
    assert answer.status_code == 202, answer.text
    curves = client.post("/pruning-curves", json=importance_request(labelled, rankings="importance,random", steps=2))
    assert curves.status_code == 202, curves.text
    with sessions() as session:
        job = session.get_one(Job, answer.json()["job_id"])
        assert (job.kind, job.queue, job.status) == ("importance", "gpu", "queued")
        assert job.procrastinate_job_id is not None
        pruning = session.get_one(Job, curves.json()["job_id"])
        assert (pruning.kind, pruning.queue) == ("pruning", "gpu")
        assert pruning.request["rankings"] == ["importance", "random"]
    assert client.post("/importance", json=importance_request(labelled)).json()["duplicate"] is True


@pytest.mark.parametrize(
    ("path", "overrides", "status", "field", "says"),
    [
        ("/importance", {"model": TINY, "loss": "task"}, 422, "loss", "classification or question-answering head"),
        ("/importance", {"model": TINY, "loss": "lm"}, 422, "loss", "masked- or causal-LM head"),
        ("/importance", {"loss": "lm"}, 422, "loss", "masked- or causal-LM head"),
        ("/importance", {"data": "BAD_LABELS"}, 422, "data", "do not fit the model's head of 2 labels"),
        ("/importance", {"model": "nope"}, 404, "model", "no model named 'nope'"),
        ("/importance", {"loss": "sensitivity", "task": "glue"}, 422, "task", "only the task loss"),
        ("/pruning-curves", {"data": "BAD_LABELS"}, 422, "data", "do not fit"),
        ("/pruning-curves", {"rankings": ["type"]}, 422, "clustering", "has not been clustered"),
        ("/pruning-curves", {"importance_run": 123456}, 404, "importance_run", "no complete importance run"),
        ("/pruning-curves", {"model": TINY, "task": "glue"}, 422, "task", "sequence-classification head"),
    ],
)
def test_bad_input_is_4xx_naming_it_and_queues_nothing(
    client: TestClient,
    sessions: sessionmaker[Session],
    tiny_ingested: int,
    classifier: str,
    labelled: Path,
    bad_labels: Path,
    path: str,
    overrides: dict[str, Any],
    status: int,
    field: str,
    says: str,
) -> None:
    data = bad_labels if overrides.get("data") == "BAD_LABELS" else labelled
    rest = {k: v for k, v in overrides.items() if k != "data"}
    if path == "/pruning-curves":
        rest = {"rankings": ["importance", "random"], **rest}
    before = jobs(sessions)
    answer = client.post(path, json=importance_request(data, **rest))
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["field"] == field
    assert body["detail"].startswith(f"{field}:")
    assert says in body["detail"]
    assert jobs(sessions) == before


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rankings": []}, "rankings"),
        ({"rankings": ""}, "rankings"),
        ({"rankings": ["importance", "best"]}, "rankings"),
        ({"steps": 0}, "steps"),
        ({"max_share": 0}, "max_share"),
    ],
)
def test_malformed_curve_requests_are_422_naming_the_field(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path, overrides: dict, field: str
) -> None:
    before = jobs(sessions)
    answer = client.post("/pruning-curves", json=importance_request(labelled, **overrides))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field
    assert answer.json()["detail"].startswith(f"{field}: ")
    assert jobs(sessions) == before


# --- the jobs ----------------------------------------------------------------------------------------


def _direct_scores(classifier_path: Path, dtype: str = "float32") -> np.ndarray:
    """The same scores computed in this process, straight from ingest (no service, no database)."""
    from ingest.evaluation import Evaluator
    from ingest.importance import ImportanceConfig, score_evaluator
    from ingest.loading import load_model
    from ingest.tasks import ClassificationExample

    loaded = load_model(str(classifier_path), device="cpu", task="sequence-classification", dtype=dtype)
    examples = [ClassificationExample(t, None, y) for t, y in SENTENCES]
    evaluator = Evaluator.for_task("classification", loaded.model, loaded.tokenizer, examples, batch_size=4,
                                   cache=False)  # fmt: skip
    return score_evaluator(evaluator, ImportanceConfig("task")).raw["encoder"]


def test_the_importance_job_stores_every_head_and_the_view_serves_the_latest(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, classifier_path: Path, labelled: Path
) -> None:
    first = run_inline(sessions, "importance", importance_request(labelled))
    assert first.status == "succeeded", first.error
    run_id = int(first.result["importance_run_id"])  # type: ignore[index]
    served = client.get(f"/importance/{run_id}").json()
    assert served["loss"] == "task"
    assert served["n_examples"] == len(SENTENCES)
    assert len(served["scores"]) == 8
    raw = np.zeros((2, 4))
    norm = np.zeros((2, 4))
    for score in served["scores"]:
        assert score["stack"] == "encoder"
        raw[score["layer"], score["head"]] = score["raw"]
        norm[score["layer"], score["head"]] = score["normalized"]
    np.testing.assert_allclose(raw, _direct_scores(classifier_path), rtol=1e-5)
    np.testing.assert_allclose(norm, raw / np.sqrt((raw**2).sum(axis=1, keepdims=True)), rtol=1e-9)

    second = run_inline(sessions, "importance", importance_request(labelled, limit=3))
    assert second.status == "succeeded", second.error
    latest = int(second.result["importance_run_id"])  # type: ignore[index]
    with sessions() as session:
        rows = session.execute(
            text("SELECT model, stack, layer, head, importance, importance_raw, importance_run_id, head_id "
                 "FROM head_importance WHERE model = :m ORDER BY layer, head"), {"m": CLASSIFIER}
        ).all()  # fmt: skip
        stored = {
            head_id: (value_raw, value_norm)
            for head_id, value_raw, value_norm in session.execute(
                select(ImportanceScore.head_id, ImportanceScore.raw, ImportanceScore.normalized).where(
                    ImportanceScore.run_id == latest
                )
            )
        }
    assert len(rows) == 8
    assert {row.importance_run_id for row in rows} == {latest}
    for row in rows:
        assert (row.importance_raw, row.importance) == stored[row.head_id]
    listed = client.get(f"/models/{CLASSIFIER}/importance").json()
    assert [run["id"] for run in listed] == [latest, run_id]


def test_the_pruning_job_stores_curves_against_one_baseline(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    request = importance_request(labelled, rankings=["importance", "random", "-importance"], steps=2, max_share=0.5)
    job = run_inline(sessions, "pruning", request)
    assert job.status == "succeeded", job.error
    curve_id = int(job.result["pruning_curve_id"])  # type: ignore[index]
    served = client.get(f"/pruning-curves/{curve_id}").json()
    assert served["metric"] == "accuracy"
    assert [line["ranking"] for line in served["curves"]] == ["importance", "random", "-importance"]
    scores = client.get(f"/importance/{served['importance_run_id']}").json()["scores"]
    ascending = sorted(scores, key=lambda s: (s["normalized"], s["layer"], s["head"]))
    for line in served["curves"]:
        assert [p["pruned"] for p in line["points"]] == [0, 2, 4]
        assert line["points"][0]["metrics"] == served["baseline"]  # every curve starts at the shared baseline
        assert line["points"][0]["delta"] == 0.0
        assert [len(p["heads"]) for p in line["points"]] == [0, 2, 4]
    importance = served["curves"][0]
    assert importance["order"] == [[s["layer"], s["head"]] for s in ascending[:4]]
    assert served["curves"][2]["order"] == [[s["layer"], s["head"]] for s in ascending[::-1][:4]]
    with sessions() as session:
        curve = session.get_one(PruningCurve, curve_id)
        assert curve.type_order == ["vertical", "dense_vertical", "dense", "diagonal"]
        points = session.scalar(select(func.count()).select_from(PruningPoint).where(PruningPoint.curve_id == curve_id))
        assert points == 9
    assert [c["id"] for c in client.get(f"/models/{CLASSIFIER}/pruning-curves").json()] == [curve_id]
    table = curves_table(_read(sessions, curve_id))
    assert "| importance |" in table
    assert "| ranking | 2 pruned (25 %) | 4 pruned (50 %) |" in table


MINILM = "minilm-curves"


@pytest.fixture
def minilm(sessions: sessionmaker[Session], minilm_path: Path, labelled: Path) -> Path:
    """The real MiniLM (6 x 12 heads; pruning them moves its hidden states well above float noise) ingested
    and clustered (k = 4) in the test's transaction; returns a file of its drift texts."""
    job = run_inline(sessions, "ingest", ingest_request(minilm_path, name=MINILM, samples=4, max_length=32))
    assert job.status == "succeeded", job.error
    assert run_inline(sessions, "clustering", {"models": [MINILM], "k": 4, "seed": 0}).status == "succeeded"
    return labelled


def _drift_evaluator(minilm_path: Path) -> Any:
    """The evaluator the jobs build for MiniLM's drift on ``labelled`` (batches of 4, max_length 128), built here."""
    from ingest.evaluation import Evaluator
    from ingest.loading import load_model

    loaded = load_model(str(minilm_path), device="cpu")
    return Evaluator.for_task("drift", loaded.model, loaded.tokenizer, [t for t, _ in SENTENCES], batch_size=4,
                              max_length=128, cache=False)  # fmt: skip


def _stored_scores(session: Session, run_id: int, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A run's raw and normalised scores as ``(layers, heads)`` arrays, by plain SQL."""
    raw, normalized = np.full(shape, np.nan), np.full(shape, np.nan)
    for layer, head, value, norm in session.execute(
        text("SELECT h.layer, h.head, s.raw, s.normalized FROM importance_scores s JOIN heads h"
             " ON h.model_id = s.model_id AND h.id = s.head_id WHERE s.run_id = :r"), {"r": run_id}
    ):  # fmt: skip
        raw[layer, head], normalized[layer, head] = value, norm
    return raw, normalized


def test_the_importance_job_scores_with_the_requests_seed_and_probes(
    sessions: sessionmaker[Session], minilm: Path, minilm_path: Path
) -> None:
    """The sensitivity loss draws its probes from the seed: the stored raw and normalised scores of every head
    equal ``score_evaluator`` called here with the request's seed and probes (and differ from the defaults')."""
    from ingest.importance import ImportanceConfig, score_evaluator

    request = {"model": MINILM, "data": str(minilm), "loss": "sensitivity", "seed": 3, "probes": 2,
               "batch_size": 4, "device": "cpu"}  # fmt: skip
    job = run_inline(sessions, "importance", request)
    assert job.status == "succeeded", job.error
    assert job.result is not None
    with sessions() as session:
        raw, normalized = _stored_scores(session, job.result["importance_run_id"], (6, 12))
    evaluator = _drift_evaluator(minilm_path)
    direct = score_evaluator(evaluator, ImportanceConfig("sensitivity", seed=3, probes=2))
    default = score_evaluator(evaluator, ImportanceConfig("sensitivity"))
    assert np.abs(direct.raw["encoder"] - default.raw["encoder"]).max() > 1e-3  # the seed and probes show
    assert np.abs(direct.raw["encoder"] - direct.normalized["encoder"]).max() > 1e-3  # raw and normalised differ
    np.testing.assert_allclose(raw, direct.raw["encoder"], rtol=1e-5)
    np.testing.assert_allclose(normalized, direct.normalized["encoder"], rtol=1e-5)
    run_id = job.result["importance_run_id"]
    assert job.result == {"importance_run_id": run_id, "model": MINILM, "heads": 72, "loss": "sensitivity"}

    # a curve given these stored scores names them and prunes in their order
    curve = run_inline(sessions, "pruning", {"model": MINILM, "data": str(minilm), "task": "drift",
                                             "loss": "sensitivity", "rankings": ["importance"], "steps": 1,
                                             "importance_run": run_id, "batch_size": 4, "device": "cpu"})  # fmt: skip
    assert curve.status == "succeeded", curve.error
    assert curve.result is not None
    assert curve.result["importance_run_id"] == run_id
    with sessions() as session:
        row = session.execute(text("SELECT importance_run_id, orders FROM pruning_curves WHERE id = :c"),
                              {"c": curve.result["pruning_curve_id"]}).one()  # fmt: skip
    ascending = sorted((normalized[h], h) for h in np.ndindex(6, 12))[:36]
    assert row.importance_run_id == run_id
    assert row.orders["importance"] == [list(h) for _, h in ascending]


def test_a_catalog_missing_a_head_is_refused_naming_the_model_and_stores_nothing(
    sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    """A model whose catalog lost one of its heads since the ingest: its scores cannot all be stored under
    their heads, so the run is refused in full (no run, no scores), naming the model and the head."""
    with sessions() as session, session.begin():
        session.execute(text("DELETE FROM heads WHERE model_id = (SELECT id FROM models WHERE name = :m) AND layer = 1"
                             " AND head = 3"), {"m": CLASSIFIER})  # fmt: skip
    before = _counts(sessions)
    with pytest.raises(InvalidInput) as error:
        run_inline(sessions, "importance", importance_request(labelled))
    assert error.value.field == "model"
    assert error.value.message == (
        f"model: head ('encoder', 1, 3) of {CLASSIFIER!r} is not in the catalog; ingest it again"
    )
    assert _counts(sessions) == before


@pytest.mark.parametrize("iterative", [False, True])
def test_every_stored_point_is_the_curve_the_function_draws_ranking_by_ranking(
    sessions: sessionmaker[Session], minilm: Path, minilm_path: Path, iterative: bool
) -> None:
    """Every ranking's stored order and points (step, pruned, share, heads, each metric by name), read back by
    plain SQL, equal ``pruning_curve`` called here as the job calls it: with the importance scores, the types,
    the seed and (iterative: re-scored after each step) the loss of the request. The ``random`` ranking is,
    in addition, the seed's permutation computed without scores: a random ranking that follows the importance
    order when scores are at hand (as the job always passes them) fails here, and so do two rankings' curves
    stored under each other's names."""
    from ingest.importance import ImportanceConfig, prune_order, pruning_curve, score_evaluator

    rankings = ["importance", "random", "-importance", "type"]
    request = {"model": MINILM, "data": str(minilm), "task": "drift", "loss": "sensitivity", "rankings": rankings,
               "steps": 2, "max_share": 0.5, "seed": 5, "iterative": iterative, "batch_size": 4,
               "device": "cpu"}  # fmt: skip
    job = run_inline(sessions, "pruning", request)
    assert job.status == "succeeded", job.error
    assert job.result is not None
    curve_id = job.result["pruning_curve_id"]
    with sessions() as session:
        row = session.execute(text("SELECT * FROM pruning_curves WHERE id = :c"), {"c": curve_id}).mappings().one()
        points = session.execute(
            text("SELECT ranking, step, pruned, share, metrics, heads FROM pruning_points WHERE curve_id = :c"),
            {"c": curve_id},
        ).all()
        raw, normalized = _stored_scores(session, row["importance_run_id"], (6, 12))
        types = {
            (r.layer, r.head): r.name
            for r in session.execute(
                text("SELECT h.layer, h.head, c.name FROM head_assignments a JOIN heads h ON h.model_id = a.model_id"
                     " AND h.id = a.head_id JOIN clusters c ON c.id = a.cluster_id WHERE a.clustering_id = :c"),
                {"c": row["clustering_id"]},
            )
        }  # fmt: skip

    evaluator = _drift_evaluator(minilm_path)
    config = ImportanceConfig("sensitivity", seed=5)
    direct = score_evaluator(evaluator, config)
    np.testing.assert_allclose(raw, direct.raw["encoder"], rtol=1e-5)
    np.testing.assert_allclose(normalized, direct.normalized["encoder"], rtol=1e-5)
    assert len(types) == 72
    assert (row["rankings"], row["steps"], row["max_share"], row["seed"], row["iterative"], row["metric"]) == (
        rankings, 2, 0.5, 5, iterative, "cosine",
    )  # fmt: skip
    assert row["baseline"] == dict(evaluator.baseline().values)

    random = prune_order("random", 6, 12, seed=5)[:36]  # no scores: the seed's permutation alone
    assert random != prune_order("importance", 6, 12, scores=direct.single_stack())[:36]
    assert random != prune_order("random", 6, 12, seed=0)[:36]  # the request's seed shows
    assert row["orders"]["random"] == [list(h) for h in random]
    stored = {(p.ranking, p.step): p for p in points}
    assert len(stored) == len(points) == 4 * 3
    drift = {}
    for ranking in rankings:
        curve = pruning_curve(evaluator, ranking, steps=2, max_share=0.5, scores=direct.single_stack(),  # type: ignore[arg-type]
                              types=types, seed=5, importance=config, iterative=iterative)  # fmt: skip
        assert curve.iterative == (iterative and "importance" in ranking)
        drift[ranking] = curve.points[1].metrics["cosine"]
        assert row["orders"][ranking] == [list(h) for h in curve.order], ranking
        for point in curve.points:
            found = stored[ranking, point.step]
            assert (found.pruned, found.share) == (point.pruned, point.share), (ranking, point.step)
            assert found.heads == [list(h) for h in point.heads], (ranking, point.step)
            assert set(found.metrics) == set(point.metrics), (ranking, point.step)
            for name, value in point.metrics.items():
                assert found.metrics[name] == pytest.approx(value, abs=1e-6), (ranking, point.step, name)
    # the rankings' drifts differ far beyond the tolerance: two rankings' points swapped fail above
    values = sorted(drift.values())
    assert min(b - a for a, b in zip(values, values[1:], strict=False)) > 1e-4, drift


def _read(sessions: sessionmaker[Session], curve_id: int) -> Any:
    from service.importance.service import get_curve

    with sessions() as session:
        return get_curve(session, curve_id)


def test_a_failed_job_stores_nothing(sessions: sessionmaker[Session], classifier: str, labelled: Path) -> None:
    before = _counts(sessions)
    with pytest.raises(Exception, match="device"):
        run_inline(sessions, "importance", importance_request(labelled, device="cuda:7"))
    assert _counts(sessions) == before


def _counts(sessions: sessionmaker[Session]) -> tuple[int, int, int]:
    with sessions() as session:
        return (
            session.scalar(select(func.count()).select_from(ImportanceRun)) or 0,
            session.scalar(select(func.count()).select_from(ImportanceScore)) or 0,
            session.scalar(select(func.count()).select_from(PruningCurve)) or 0,
        )


# --- the CLI ---------------------------------------------------------------------------------------


def test_the_cli_refuses_bad_input_with_exit_2_before_any_job(
    committed_database_url: str, catalog_engine: Any, labelled: Path
) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "service.cli", *args]
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)

    with Session(catalog_engine) as session:
        before = session.scalar(select(func.count()).select_from(Job))
    task = cli("importance", TINY, "--data", str(labelled), "--loss", "task", "--device", "cpu")
    assert task.returncode == 2, task.stderr
    assert "task loss needs a classification" in task.stderr
    lm = cli("importance", TINY, "--data", str(labelled), "--loss", "lm")
    assert lm.returncode == 2
    assert "LM head" in lm.stderr
    empty = cli("prune-curve", TINY, "--data", str(labelled), "--rankings", "", "--task", "drift")
    assert empty.returncode == 2
    assert "rankings" in empty.stderr
    steps = cli("prune-curve", TINY, "--data", str(labelled), "--steps", "0", "--task", "drift")
    assert steps.returncode == 2
    assert "steps" in steps.stderr
    with Session(catalog_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before


# --- exports -----------------------------------------------------------------------------------------


def test_exports_select_the_lowest_heads_by_importance(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    none_yet = client.get(f"/models/{CLASSIFIER}/export", params={"score": "importance"})
    assert none_yet.status_code == 422
    assert none_yet.json()["field"] == "score"
    job = run_inline(sessions, "importance", importance_request(labelled))
    assert job.status == "succeeded", job.error
    scores = client.get(f"/importance/{job.result['importance_run_id']}").json()["scores"]  # type: ignore[index]
    ascending = [
        (s["layer"], s["head"]) for s in sorted(scores, key=lambda s: (s["normalized"], s["layer"], s["head"]))
    ]

    quarter = client.get(f"/models/{CLASSIFIER}/export", params={"score": "importance", "lowest": "25%"})
    assert quarter.status_code == 200, quarter.text
    expected: dict[str, list[int]] = {}
    for layer, head in sorted(ascending[:2]):
        expected.setdefault(str(layer), []).append(head)
    assert quarter.json() == expected
    mask = client.get(
        f"/models/{CLASSIFIER}/export", params={"score": "importance", "lowest": "3", "format": "head_mask"}
    ).json()
    assert [(la, h) for la in range(2) for h in range(4) if mask[la][h] == 0] == sorted(ascending[:3])
    values = client.get(f"/models/{CLASSIFIER}/export", params={"score": "importance", "format": "scores"}).json()
    for s in scores:
        assert values[s["layer"]][s["head"]] == pytest.approx(s["normalized"])
    # other filters apply first: the lowest 2 of layer 1's heads
    upper = client.get(f"/models/{CLASSIFIER}/export", params={"score": "importance", "lowest": "2", "layer_gt": 0,
                                                              "format": "pairs"}).json()  # fmt: skip
    assert upper == sorted([list(h) for h in ascending if h[0] == 1][:2])
    bad = client.get(f"/models/{CLASSIFIER}/export", params={"score": "importance", "lowest": "many"})
    assert bad.status_code == 422
    assert bad.json()["field"] == "lowest"


def test_the_page_loads_the_importance_view(client: TestClient) -> None:
    assert '<script src="/static/importance.js"></script>' in client.get("/static/index.html").text
    script = client.get("/static/importance.js")
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    # the endpoints it reads: the model's current importance run (GET /models/{name}: current_runs) and its newest
    # pruning curves
    for path in ("current_runs.importance", "/importance/${id}", "/pruning-curves?limit=1"):
        assert path in script.text


def test_get_heads_serves_orders_and_filters_importance(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    """``GET /heads`` carries each head's stored scores (the latest run, or ``importance_run=``),
    orders by them and filters them: checked against the stored rows of each run."""
    first = run_inline(sessions, "importance", importance_request(labelled))
    second = run_inline(sessions, "importance", importance_request(labelled, limit=3))
    assert first.status == second.status == "succeeded"
    runs = [int(job.result["importance_run_id"]) for job in (first, second)]  # type: ignore[index]
    stored: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
    with sessions() as session:
        for run_id in runs:
            rows = session.execute(
                text("SELECT h.layer, h.head, s.normalized, s.raw FROM importance_scores s JOIN heads h "
                     "ON h.id = s.head_id WHERE s.run_id = :r"), {"r": run_id}
            ).all()  # fmt: skip
            stored[run_id] = {(r.layer, r.head): (r.normalized, r.raw) for r in rows}
    assert stored[runs[0]] != stored[runs[1]]  # two runs on different data: the choice of run shows

    def served(**params: Any) -> list[dict[str, Any]]:
        answer = client.get("/heads", params={"model": CLASSIFIER, **params})
        assert answer.status_code == 200, answer.text
        return list(answer.json()["items"])

    params: dict[str, Any]  # query parameters, of other value types in each loop below
    for run_id, params in ((runs[1], {}), (runs[0], {"importance_run": runs[0]})):
        heads = served(**params)
        assert len(heads) == 8
        for head in heads:
            normalized, raw = stored[run_id][head["layer"], head["head"]]
            assert (head["importance"], head["importance_raw"], head["importance_run_id"]) == (normalized, raw, run_id)
    latest = stored[runs[1]]
    ascending = sorted(latest, key=lambda key: (latest[key][0], key))
    assert [(h["layer"], h["head"]) for h in served(order="importance", limit=3)] == ascending[:3]
    assert [(h["layer"], h["head"]) for h in served(order="-importance", limit=3)] == ascending[::-1][:3]
    assert [(h["layer"], h["head"]) for h in served(order="importance", limit=3, offset=3)] == ascending[3:6]
    middle = latest[ascending[4]][0]
    assert {(h["layer"], h["head"]) for h in served(importance_lt=middle)} == set(ascending[:4])
    assert {(h["layer"], h["head"]) for h in served(importance_gt=middle)} == set(ascending[5:])
    layer_one = [key for key in ascending if key[0] == 1]
    assert [(h["layer"], h["head"]) for h in served(order="importance", layer_gt=0)] == layer_one

    for params, status, field in (
        ({"order": "size"}, 422, "order"),
        ({"order": "importance", "after": "x"}, 422, "after"),
        ({"importance_run": 999999}, 404, "importance_run"),
        ({"order": "syntax_accuracy"}, 422, "order"),
    ):
        answer = client.get("/heads", params={"model": CLASSIFIER, **params})
        assert (answer.status_code, answer.json()["field"]) == (status, field), answer.text
    other = client.get("/heads", params={"model": TINY, "importance_run": runs[0]})
    assert other.status_code in (404, 422)


# --- which loss, which model class (pure functions of the model's config) --------------------------


def _head(kind: str, *architectures: str) -> Any:
    from service.ablations.data import ModelHead

    return ModelHead(kind=kind, architectures=architectures, num_labels=2, id2label={}, label2id={})


@pytest.mark.parametrize(
    ("architectures", "kind"),
    [
        (("BertForMaskedLM",), "masked-lm"),
        (("BertForPreTraining",), "masked-lm"),
        (("LlamaForCausalLM",), "causal-lm"),
        (("GPT2LMHeadModel",), "causal-lm"),
        (("BertModel", "BertForMaskedLM"), "masked-lm"),  # the first architecture with an LM head counts
        (("BertModel", "GPT2LMHeadModel"), "causal-lm"),
        (("BertModel",), None),
        (("BertForSequenceClassification",), None),
        ((), None),
    ],
)
def test_lm_kind_reads_the_lm_head_from_the_architectures(architectures: tuple[str, ...], kind: str | None) -> None:
    from service.importance.service import lm_kind

    assert lm_kind(_head("base", *architectures)) == kind


@pytest.mark.parametrize(
    ("requested", "kind", "architectures", "loss", "loaded_as"),
    [
        (None, "sequence-classification", ("BertForSequenceClassification",), "task", "sequence-classification"),
        (None, "question-answering", ("BertForQuestionAnswering",), "task", "question-answering"),
        (None, "base", ("BertForMaskedLM",), "lm", "masked-lm"),
        (None, "base", ("GPT2LMHeadModel",), "lm", "causal-lm"),
        (None, "base", ("BertModel",), "sensitivity", "base"),
        ("task", "sequence-classification", ("BertForSequenceClassification",), "task", "sequence-classification"),
        ("lm", "base", ("BertForMaskedLM",), "lm", "masked-lm"),
        ("sensitivity", "sequence-classification", ("BertForSequenceClassification",), "sensitivity", "base"),
        ("sensitivity", "base", ("BertForMaskedLM",), "sensitivity", "base"),
    ],
)  # fmt: skip
def test_the_loss_is_the_one_asked_for_or_the_one_the_head_implies(
    requested: str | None, kind: str, architectures: tuple[str, ...], loss: str, loaded_as: str
) -> None:
    from service.importance.service import choose_loss, load_kind

    head = _head(kind, *architectures)
    assert choose_loss(requested, head, "m") == loss  # type: ignore[arg-type]
    assert load_kind(loss, head) == loaded_as  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("requested", "kind", "architectures", "message"),
    [
        ("task", "base", ("BertForMaskedLM",),
         "loss: the task loss needs a classification or question-answering head, but 'm' has BertForMaskedLM; "
         "use lm (a model with an LM head) or sensitivity"),
        ("task", "base", (),
         "loss: the task loss needs a classification or question-answering head, but 'm' has no architecture in "
         "its config; use lm (a model with an LM head) or sensitivity"),
        ("lm", "sequence-classification", ("BertForSequenceClassification", "BertModel"),
         "loss: the lm loss needs a masked- or causal-LM head, but 'm' has BertForSequenceClassification, "
         "BertModel; use task"),
        ("lm", "base", ("BertModel",),
         "loss: the lm loss needs a masked- or causal-LM head, but 'm' has BertModel; use sensitivity"),
    ],
)  # fmt: skip
def test_a_loss_the_model_cannot_compute_is_refused_saying_which_it_can(
    requested: str, kind: str, architectures: tuple[str, ...], message: str
) -> None:
    from service.importance.service import choose_loss

    with pytest.raises(InvalidInput) as refused:
        choose_loss(requested, _head(kind, *architectures), "m")  # type: ignore[arg-type]
    assert (refused.value.field, refused.value.message) == ("loss", message)


# --- the report's table: kept_at and curves_table on a curve built by hand -------------------------


def _curve(baseline: dict[str, Any], lines: dict[str, list[tuple[float, Any]]], **fields: Any) -> Any:
    """A served curve (``PruningCurveRead``) with ``steps=4``, ``max_share=0.5``: per ranking, (share, accuracy)."""
    from datetime import UTC, datetime

    from service.importance.schemas import DataRead, PointRead, PruningCurveRead, RankingCurveRead

    def point(step: int, share: float, value: Any) -> PointRead:
        return PointRead(step=step, pruned=int(share * 16), share=share, metrics={"accuracy": value, "loss": 9.0},
                         delta=0.0, heads=[], seconds=0.0)  # fmt: skip

    curves = [RankingCurveRead(ranking=ranking, order=[], points=[point(i, s, v) for i, (s, v) in enumerate(points)])
              for ranking, points in lines.items()]  # fmt: skip
    data = DataRead(kind="jsonl", source="d", sha256=None, subset=None, size=6)
    values: dict[str, Any] = {
        "id": 7, "model": "m", "status": "complete", "task": "glue", "metric": "accuracy", "baseline": baseline,
        "baseline_id": 1, "rankings": list(lines), "iterative": False, "steps": 4, "max_share": 0.5, "seed": 0,
        "type_order": ["vertical", "dense"], "importance_run_id": None, "clustering_id": None, "data": data,
        "limit": None, "n_examples": 6, "config": {}, "device": "cpu", "dtype": "float32", "seconds": 1.0,
        "started_at": datetime(2026, 1, 1, tzinfo=UTC), "finished_at": None, "curves": curves,
    }  # fmt: skip
    return PruningCurveRead(**{**values, **fields})


def test_the_report_s_columns_are_measured_points_nearest_10_30_50_percent() -> None:
    """On a 4-step curve to 50 % (points at 2, 4, 6, 8 of 16 heads): the measured counts nearest 10/30/50 %, each
    once (a tie takes the smaller); the baseline is never a column; no points past it, no columns."""
    from service.importance.service import report_columns

    full = [(0.0, 0.8), (0.125, 0.75), (0.25, 0.7), (0.375, 0.6), (0.5, 0.5)]
    assert report_columns(_curve({"accuracy": 0.8}, {"importance": full})) == [(2, 0.125), (4, 0.25), (8, 0.5)]
    one_step = _curve({"accuracy": 0.8}, {"importance": [(0.0, 0.8), (0.5, 0.6)]}, steps=1)
    assert report_columns(one_step) == [(8, 0.5)]  # 10 % and 30 % were not measured: no column claims them
    tie = _curve({"accuracy": 0.8}, {"importance": [(0.0, 0.8), (0.25, 0.7), (0.375, 0.6)]})
    assert report_columns(tie, (0.3125,)) == [(4, 0.25)]  # 0.0625 from both: the smaller count
    assert report_columns(_curve({"accuracy": 0.8}, {"importance": [(0.0, 0.8)], "empty": []})) == []


def test_kept_at_takes_only_the_point_measured_at_each_column_s_count() -> None:
    """A ranking without a point at a column's count has no value there (not its nearest point's); a metric that
    is not a number is None."""
    from service.importance.service import kept_at

    curve = _curve({"accuracy": 0.8}, {
        "importance": [(0.0, 0.8), (0.125, 0.75), (0.25, 0.7), (0.375, 0.6), (0.5, 0.5)],
        "short": [(0.0, 0.8), (0.125, 0.65)],
        "gap": [(0.0, 0.8), (0.375, 0.4), (0.5, None)],
        "empty": [],
    })  # fmt: skip
    columns = [(2, 0.125), (4, 0.25), (8, 0.5)]
    assert kept_at(curve, columns) == {
        "importance": {2: 0.75, 4: 0.7, 8: 0.5},
        "short": {2: 0.65},
        "gap": {8: None},
        "empty": {},
    }


def test_the_curves_table_is_the_report_s_text_line_by_line() -> None:
    from service.importance.service import curves_table

    curve = _curve({"accuracy": 0.8}, {
        "importance": [(0.0, 0.8), (0.125, 0.75), (0.25, 0.7), (0.375, 0.6), (0.5, 0.5)],
        "type": [(0.0, 0.8), (0.125, 0.85), (0.5, None)],
    }, iterative=True)  # fmt: skip
    assert curves_table(curve) == (
        "## Pruning curves 7: accuracy as heads are pruned (glue, 6 examples, iterative)\n"
        "\n"
        "Baseline (nothing pruned): 0.80\n"
        "\n"
        "| ranking | 2 pruned (12.5 %) | 4 pruned (25 %) | 8 pruned (50 %) |\n"
        "|---|---:|---:|---:|\n"
        "| importance | 0.75 (-0.05) | 0.70 (-0.10) | 0.50 (-0.30) |\n"
        "| type | 0.85 (+0.05) | not measured | - |\n"
        "\n"
        "Type ranking order: vertical > dense (then other types; by layer, head).\n"
    )
    no_base = _curve({"loss": 1.0}, {"random": [(0.0, 0.8), (0.125, 0.75)]})
    assert curves_table(no_base) == (
        "## Pruning curves 7: accuracy as heads are pruned (glue, 6 examples)\n"
        "\n"
        "Baseline: -\n"
        "\n"
        "| ranking | 2 pruned (12.5 %) |\n"
        "|---|---:|\n"
        "| random | 0.75 |\n"
    )
    nothing = _curve({"accuracy": 0.8}, {"random": [(0.0, 0.8)]})
    assert curves_table(nothing).endswith(
        "Baseline (nothing pruned): 0.80\n\nNo point past the baseline was measured.\n"
    )


def test_a_one_step_curve_s_table_shows_no_value_at_shares_it_did_not_measure() -> None:
    """``prune-curve --steps 1`` measures 0 and 50 % only: the table has the 50 % column and no 10 % or 30 % one
    filled from a neighbouring point (the baseline's 1.00 or the 50 % point's value)."""
    from service.importance.service import curves_table

    curve = _curve({"accuracy": 1.0}, {"importance": [(0.0, 1.0), (0.5, 0.81)]}, steps=1)
    table = curves_table(curve)
    assert "| ranking | 8 pruned (50 %) |\n" in table
    assert "| importance | 0.81 (-0.19) |\n" in table
    assert "10 %" not in table
    assert "30 %" not in table
    assert "1.00 (+0.00)" not in table


def test_a_share_between_whole_percents_is_named_to_a_tenth() -> None:
    from service.importance.service import _share_text

    assert [_share_text(s) for s in (0.5, 14 / 144, 0.125, 0.0, 1.0)] == ["50 %", "9.7 %", "12.5 %", "0 %", "100 %"]


# --- what the API serves is what is stored, field by field -----------------------------------------


def _served_time(value: str | None) -> Any:
    from datetime import datetime

    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_served_runs_and_curves_are_the_stored_rows_field_by_field(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    """``GET /importance/{id}``, ``/pruning-curves/{id}`` and the model's lists against the rows read by plain SQL.
    The nullable columns hold values (a clustering, a limit, a spread subset, a finish time) and the points' metrics
    differ from the baseline's, so a field served as null or a delta served as 0 shows."""
    chosen = run_inline(sessions, "clustering", {"models": [CLASSIFIER], "k": 2, "seed": 0}).result
    assert chosen is not None
    assert run_inline(sessions, "clustering", {"models": [CLASSIFIER], "k": 3, "seed": 0}).status == "succeeded"
    scored = run_inline(sessions, "importance", importance_request(labelled, limit=5, seed=3, sample="spread"))
    other = run_inline(sessions, "importance", importance_request(labelled, loss="sensitivity"))
    assert scored.result is not None
    assert other.result is not None
    run_id = int(scored.result["importance_run_id"])
    request = importance_request(labelled, rankings=["type", "importance", "random"], steps=2, max_share=0.5, limit=5,
                                 sample="spread", seed=3, importance_run=run_id,
                                 clustering=chosen["clustering_id"])  # fmt: skip
    first = run_inline(sessions, "pruning", request)
    second = run_inline(sessions, "pruning", {**request, "steps": 1})
    assert first.result is not None
    assert second.result is not None
    curve_id = int(first.result["pruning_curve_id"])
    with sessions() as session, session.begin():
        session.execute(  # every point's own accuracy, none the baseline's
            text("UPDATE pruning_points SET metrics = jsonb_set(metrics, '{accuracy}', to_jsonb(0.05 * step + 0.01 *"
                 " length(ranking))) WHERE curve_id = :c"), {"c": curve_id}
        )  # fmt: skip
    with sessions() as session:
        run = session.execute(text("SELECT * FROM importance_runs WHERE id = :r"), {"r": run_id}).mappings().one()
        scores = session.execute(
            text("SELECT h.stack, h.layer, h.head, s.raw, s.normalized FROM importance_scores s JOIN heads h"
                 " ON h.model_id = s.model_id AND h.id = s.head_id WHERE s.run_id = :r ORDER BY h.layer, h.head"),
            {"r": run_id},
        ).all()  # fmt: skip
        curve = session.execute(text("SELECT * FROM pruning_curves WHERE id = :c"), {"c": curve_id}).mappings().one()
        points = session.execute(
            text("SELECT ranking, step, pruned, share, metrics, heads, seconds FROM pruning_points WHERE curve_id = :c"
                 " ORDER BY step"), {"c": curve_id}
        ).mappings().all()  # fmt: skip
    assert curve["clustering_id"] == chosen["clustering_id"]  # the one asked for, not the current (k = 3)
    assert (run["task"], run["limit"], run["finished_at"] is not None) == ("glue", 5, True)
    assert run["mean_loss"] is not None
    assert run["mean_loss"] > 0
    assert run["config"]["max_length"] == 128  # none asked for: the evaluator's, not the request's null
    with sessions() as session:
        sensitivity = session.execute(text("SELECT task, mean_loss FROM importance_runs WHERE id = :r"),
                                      {"r": other.result["importance_run_id"]}).one()  # fmt: skip
    assert tuple(sensitivity) == (None, None)  # no task data, no loss (NaN is stored as null)
    digest = hashlib.sha256(labelled.read_bytes()).hexdigest()
    assert (run["data_sha256"], curve["data_sha256"], run["device"], curve["device"]) == (digest, digest, "cpu", "cpu")
    assert first.result == {"pruning_curve_id": curve_id, "model": CLASSIFIER, "metric": "accuracy",
                            "baseline_id": curve["baseline_id"], "importance_run_id": run_id}  # fmt: skip
    assert (curve["limit"], curve["finished_at"] is not None) == (5, True)

    served = client.get(f"/importance/{run_id}").json()
    for name in ("id", "status", "loss", "task", "limit", "n_examples", "seed", "mean_loss", "config", "device",
                 "dtype", "seconds"):  # fmt: skip
        assert served[name] == run[name], name
    assert served["model"] == CLASSIFIER
    assert served["data"] == {"kind": run["data_kind"], "source": run["data_source"], "sha256": run["data_sha256"],
                              "subset": "spread", "size": run["data_size"]}  # fmt: skip
    assert (_served_time(served["started_at"]), _served_time(served["finished_at"])) == (
        run["started_at"], run["finished_at"],
    )  # fmt: skip
    assert [tuple(s.values()) for s in served["scores"]] == [tuple(row) for row in scores]

    got = client.get(f"/pruning-curves/{curve_id}").json()
    for name in ("id", "status", "task", "metric", "baseline", "baseline_id", "rankings", "iterative", "steps",
                 "max_share", "seed", "type_order", "importance_run_id", "clustering_id", "limit", "n_examples",
                 "config", "device", "dtype", "seconds"):  # fmt: skip
        assert got[name] == curve[name], name
    assert got["model"] == CLASSIFIER
    assert got["data"] == {"kind": curve["data_kind"], "source": curve["data_source"], "sha256": curve["data_sha256"],
                           "subset": "spread", "size": curve["data_size"]}  # fmt: skip
    assert (_served_time(got["started_at"]), _served_time(got["finished_at"])) == (
        curve["started_at"], curve["finished_at"],
    )  # fmt: skip
    base = curve["baseline"]["accuracy"]
    assert [line["ranking"] for line in got["curves"]] == ["type", "importance", "random"]
    for line in got["curves"]:
        assert line["order"] == curve["orders"][line["ranking"]]
        want = [p for p in points if p["ranking"] == line["ranking"]]
        assert [p["step"] for p in line["points"]] == [p["step"] for p in want] == [0, 1, 2]
        for point, row in zip(line["points"], want, strict=True):
            assert point == {"step": row["step"], "pruned": row["pruned"], "share": row["share"],
                             "metrics": row["metrics"], "delta": pytest.approx(row["metrics"]["accuracy"] - base),
                             "heads": row["heads"], "seconds": row["seconds"]}  # fmt: skip
    assert any(p["delta"] != 0 for line in got["curves"] for p in line["points"])

    newest = int(second.result["pruning_curve_id"])
    curves = f"/models/{CLASSIFIER}/pruning-curves"
    assert [c["id"] for c in client.get(curves).json()] == [newest, curve_id]
    assert [c["id"] for c in client.get(curves, params={"limit": 1}).json()] == [newest]
    assert [c["id"] for c in client.get(curves, params={"limit": 1, "offset": 1}).json()] == [curve_id]
    assert client.get(curves, params={"offset": 1}).json()[0] == got
    runs = f"/models/{CLASSIFIER}/importance"
    other_id = int(other.result["importance_run_id"])
    assert [r["id"] for r in client.get(runs).json()][:2] == [other_id, run_id]
    assert [r["id"] for r in client.get(runs, params={"loss": "task"}).json()] == [run_id]
    assert [r["id"] for r in client.get(runs, params={"limit": 1, "offset": 1}).json()] == [run_id]
    assert [r["id"] for r in client.get(runs, params={"limit": 1}).json()] == [other_id]
    assert client.get(runs, params={"loss": "task"}).json()[0] == served
    with sessions() as session, session.begin():  # a point without the curve's metric has no delta to give
        session.execute(text("UPDATE pruning_points SET metrics = metrics - 'accuracy' WHERE curve_id = :c"
                             " AND ranking = 'random' AND step = 1"), {"c": curve_id})  # fmt: skip
    random_line = client.get(f"/pruning-curves/{curve_id}").json()["curves"][2]
    assert [p["delta"] == 0.0 for p in random_line["points"]] == [False, True, False]


def test_reads_of_what_is_not_there_are_404_naming_the_field(client: TestClient, classifier: str) -> None:
    for path, field, says in [
        ("/importance/999999", "run_id", "run_id: no importance run with id 999999"),
        ("/pruning-curves/999999", "curve_id", "curve_id: no pruning curve with id 999999"),
        ("/models/nosuch/importance", "name", "name: no model named 'nosuch'"),
        ("/models/nosuch/pruning-curves", "name", "name: no model named 'nosuch'"),
    ]:
        answer = client.get(path)
        assert (answer.status_code, answer.json()["field"]) == (404, field), (path, answer.text)
        assert answer.json()["detail"].startswith(says), path


# --- what the jobs report and record about themselves ----------------------------------------------


def test_the_importance_job_reports_progress_and_records_its_device_time_and_max_length(
    sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    import time

    calls: list[tuple[int, int]] = []
    started = time.perf_counter()
    job = run_inline(sessions, "importance", importance_request(labelled, max_length=64),
                     progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    wall = time.perf_counter() - started
    assert job.result is not None
    assert calls
    assert calls[-1][0] == calls[-1][1] > 0
    assert job.progress_done == job.progress_total == calls[-1][1]
    with sessions() as session:
        run = session.get_one(ImportanceRun, int(job.result["importance_run_id"]))
    assert run.device == "cpu"
    assert 0 < run.seconds <= wall
    assert run.config["max_length"] == 64
    assert run.config["importance"] == {"loss": "task", "seed": 0, "mask_probability": 0.15, "probes": 8}


@pytest.mark.parametrize("rankings", [["importance"], ["-importance"], ["random"]])
def test_a_curve_scores_the_heads_only_for_the_importance_rankings(
    sessions: sessionmaker[Session], classifier: str, labelled: Path, rankings: list[str]
) -> None:
    """Each importance ranking alone makes the job score the heads (and store that run); a curve without one
    stores no importance run. Progress counts every ranking's steps from 0; the baseline's time is its own."""
    import time

    calls: list[tuple[int, int]] = []
    started = time.perf_counter()
    job = run_inline(sessions, "pruning", importance_request(labelled, rankings=rankings, steps=2, max_share=0.25),
                     progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    wall = time.perf_counter() - started
    assert job.result is not None
    assert calls[0] == (0, 2)
    assert calls[-1] == (2, 2)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    with sessions() as session:
        runs = session.scalar(select(func.count()).select_from(ImportanceRun)) or 0
        curve = session.get_one(PruningCurve, int(job.result["pruning_curve_id"]))
        baseline_seconds, baseline_device = session.execute(
            text("SELECT seconds, device FROM ablation_baselines WHERE id = :b"), {"b": curve.baseline_id}
        ).one()
        pruned = session.scalars(select(PruningPoint.pruned).where(PruningPoint.curve_id == curve.id)
                                 .order_by(PruningPoint.step)).all()  # fmt: skip
    assert list(pruned) == [0, 1, 2]  # a quarter of the 8 heads at the last of 2 steps
    assert baseline_device == "cpu"
    scored = rankings != ["random"]
    assert (runs, curve.importance_run_id is not None) == ((1, True) if scored else (0, False))
    assert (curve.device, curve.config["max_length"], curve.config["loss"]) == ("cpu", 128, "task")
    if scored:
        with sessions() as session:
            assert session.get_one(ImportanceRun, curve.importance_run_id).device == "cpu"
    assert 0 < baseline_seconds <= curve.seconds <= wall


def test_the_request_s_task_and_the_model_s_name_reach_the_checks(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    """A task the head cannot do is refused even where the head's default task would do; refusals name the model."""
    squad = client.post("/importance", json=importance_request(labelled, task="squad"))
    assert (squad.status_code, squad.json()["field"]) == (422, "task"), squad.text
    assert f"{CLASSIFIER!r}" in squad.json()["detail"]
    lm = client.post("/importance", json=importance_request(labelled, loss="lm"))
    assert (lm.status_code, lm.json()["field"]) == (422, "loss"), lm.text
    assert f"but {CLASSIFIER!r} has BertForSequenceClassification" in lm.json()["detail"]


def test_what_fails_while_the_curves_are_drawn_is_named_by_its_field(
    sessions: sessionmaker[Session], classifier: str, labelled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data the evaluator cannot read is the data's fault, a ranking the model cannot be pruned by is the
    rankings'; either fails the job with that field's name and stores no curve."""
    import ingest.importance
    from ingest.importance import ImportanceError
    from ingest.tasks import TaskDataError

    for error, field in [(TaskDataError("row 3: no label"), "data"), (ImportanceError("no types"), "rankings")]:

        def fail(*args: Any, error: Exception = error, **kwargs: Any) -> None:
            raise error

        monkeypatch.setattr(ingest.importance, "pruning_curve", fail)
        with pytest.raises(InvalidInput) as refused:
            run_inline(sessions, "pruning", importance_request(labelled, rankings=["random"], steps=1))
        assert (refused.value.field, refused.value.message) == (field, f"{field}: {error}")
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(PruningCurve)) == 0


def test_curve_requests_whose_parts_do_not_fit_together_are_refused_naming_the_part(
    client: TestClient, sessions: sessionmaker[Session], classifier: str, tiny_ingested: int, labelled: Path
) -> None:
    """Each of ``validate_curves``' checks, with a request that passes all the others; nothing is queued."""
    clustered = run_inline(sessions, "clustering", {"models": [CLASSIFIER], "k": 2, "seed": 0})
    scored = run_inline(sessions, "importance", importance_request(labelled))
    other = run_inline(sessions, "importance", {"model": TINY, "data": str(labelled), "device": "cpu"})
    assert clustered.result is not None
    assert scored.result is not None
    assert other.result is not None
    clustering, run = int(clustered.result["clustering_id"]), int(scored.result["importance_run_id"])
    tiny_run = int(other.result["importance_run_id"])
    refusals: list[tuple[dict[str, Any], int, str, str]] = [
        ({"rankings": ["random"], "clustering": clustering}, 422, "clustering",
         "clustering: only the type ranking uses a clustering"),
        ({"rankings": ["random"], "importance_run": run}, 422, "importance_run",
         "importance_run: only the importance rankings use stored scores"),
        ({"rankings": ["importance"], "iterative": True, "importance_run": run}, 422, "importance_run",
         "importance_run: an iterative curve re-scores as it goes; give no stored scores"),
        ({"rankings": ["importance"], "importance_run": tiny_run}, 422, "importance_run",
         f"importance_run: run {tiny_run} scores {TINY!r}, not {CLASSIFIER!r}"),
        ({"rankings": ["random"], "loss": "task", "task": "drift"}, 422, "loss",
         "loss: the task loss needs labelled data (task squad or glue), not drift"),
    ]  # fmt: skip
    before = jobs(sessions)
    for overrides, status, field, message in refusals:
        answer = client.post("/pruning-curves", json=importance_request(labelled, **overrides))
        assert (answer.status_code, answer.json()["field"], answer.json()["detail"]) == (status, field, message)
    for overrides, field in [({"rankings": ["random"], "task": "squad"}, "task"),
                             ({"rankings": ["importance"], "loss": "lm"}, "loss")]:  # fmt: skip
        answer = client.post("/pruning-curves", json=importance_request(labelled, **overrides))
        assert (answer.status_code, answer.json()["field"]) == (422, field), answer.text
        assert f"{CLASSIFIER!r}" in answer.json()["detail"]
    assert jobs(sessions) == before
    mirrored = client.post("/pruning-curves", json=importance_request(labelled, rankings=["-importance"],
                                                                       importance_run=run))  # fmt: skip
    assert mirrored.status_code == 202, mirrored.text  # the mirrored ranking alone uses the stored scores too
    before = jobs(sessions)

    with sessions() as session, session.begin():
        session.execute(text("UPDATE importance_runs SET status = 'failed' WHERE id = :r"), {"r": run})
        session.execute(text("DELETE FROM head_assignments WHERE clustering_id = :c AND head_id = (SELECT min(head_id)"
                             " FROM head_assignments WHERE clustering_id = :c)"), {"c": clustering})  # fmt: skip
    failed = client.post("/pruning-curves", json=importance_request(labelled, rankings=["importance"],
                                                                     importance_run=run))  # fmt: skip
    assert (failed.status_code, failed.json()["field"], failed.json()["detail"]) == (
        404, "importance_run", f"importance_run: no complete importance run with id {run}",
    )  # fmt: skip
    untyped = client.post("/pruning-curves", json=importance_request(labelled, rankings=["type"],
                                                                      clustering=clustering))  # fmt: skip
    assert (untyped.status_code, untyped.json()["field"], untyped.json()["detail"]) == (
        422, "clustering", f"clustering: 1 heads of {CLASSIFIER!r} have no type in clustering {clustering}",
    )  # fmt: skip
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET stacks = CAST(:s AS jsonb) WHERE name = :m"),
                        {"s": json.dumps({"encoder": {"layers": 2, "heads": 4}, "decoder": {"layers": 2, "heads": 4}}),
                         "m": CLASSIFIER})  # fmt: skip
    stacks = client.post("/pruning-curves", json=importance_request(labelled, rankings=["random"]))
    assert (stacks.status_code, stacks.json()["field"]) == (422, "model")
    assert stacks.json()["detail"] == (
        f"model: {CLASSIFIER!r} has stacks ['decoder', 'encoder']; pruning curves prune single-stack models"
    )
    assert jobs(sessions) == before


def test_a_drift_curve_prunes_by_the_loss_the_model_can_compute(
    sessions: sessionmaker[Session], classifier: str, labelled: Path
) -> None:
    """Drift data has no labels: the task loss a classifier would default to becomes the sensitivity loss (no LM
    head), for the scores the importance ranking needs and for the curve's own record."""
    for rankings in (["importance"], ["random"]):
        job = run_inline(sessions, "pruning", importance_request(labelled, task="drift", rankings=rankings, steps=1,
                                                                  max_length=64))  # fmt: skip
        assert job.result is not None
        with sessions() as session:
            curve = session.get_one(PruningCurve, int(job.result["pruning_curve_id"]))
            assert (curve.task, curve.config["loss"], curve.config["max_length"]) == ("drift", "sensitivity", 64)
            if curve.importance_run_id is not None:
                assert session.get_one(ImportanceRun, curve.importance_run_id).loss == "sensitivity"
        assert (curve.importance_run_id is not None) == (rankings == ["importance"])


def test_what_fails_while_the_heads_are_scored_is_named_by_its_field(
    sessions: sessionmaker[Session],
    classifier: str,
    classifier_path: Path,
    labelled: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device this machine lacks, a checkpoint whose shape is no longer the catalog's, data the evaluator
    refuses, a loss the scorer refuses: each fails the importance job with its field, and stores no run."""
    import ingest.evaluation
    import ingest.importance
    from ingest.importance import ImportanceError
    from ingest.tasks import TaskDataError

    def fails(request: dict[str, Any]) -> InvalidInput:
        with pytest.raises(InvalidInput) as refused:
            run_inline(sessions, "importance", request)
        with sessions() as session:
            assert session.scalar(select(func.count()).select_from(ImportanceRun)) == 0
        return refused.value

    device = fails(importance_request(labelled, device="cuda:99"))
    assert device.field == "device"
    assert device.message.startswith("device: device 'cuda:99' ")

    import shutil

    weightless = tmp_path / "weightless"  # its config and tokenizer are there, its weights are not
    shutil.copytree(classifier_path, weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET source = :s WHERE name = :m"), {"s": str(weightless), "m": CLASSIFIER})
    gone = fails(importance_request(labelled))
    assert gone.field == "model"
    assert gone.message.startswith("model: ")
    with sessions() as session, session.begin():
        session.execute(
            text("UPDATE models SET source = :s WHERE name = :m"), {"s": str(classifier_path), "m": CLASSIFIER}
        )

    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET num_layers = 3 WHERE name = :m"), {"m": CLASSIFIER})
    shape = fails(importance_request(labelled))
    assert shape.field == "model"
    assert shape.message.startswith("model: ")
    assert shape.message.endswith("now has 2 x 4 heads, the catalog 3 x 4; ingest it again under a new name")
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET num_layers = 2 WHERE name = :m"), {"m": CLASSIFIER})

    def no_labels(*args: Any, **kwargs: Any) -> None:
        raise TaskDataError("example 3 has no label")

    with monkeypatch.context() as patch:
        patch.setattr(ingest.evaluation.Evaluator, "for_task", no_labels)
        data = fails(importance_request(labelled))
    assert (data.field, data.message) == ("data", "data: example 3 has no label")

    def refused(*args: Any, **kwargs: Any) -> None:
        raise ImportanceError("the lm loss needs an LM head")

    with monkeypatch.context() as patch:
        patch.setattr(ingest.importance, "score_evaluator", refused)
        loss = fails(importance_request(labelled))
    assert (loss.field, loss.message) == ("loss", "loss: the lm loss needs an LM head")


def test_the_request_s_dtype_is_the_run_s(
    sessions: sessionmaker[Session], classifier: str, classifier_path: Path, labelled: Path
) -> None:
    """Scored in bfloat16 as asked: the stored scores are a bfloat16 computation's, not float32's."""
    job = run_inline(sessions, "importance", importance_request(labelled, dtype="bfloat16"))
    assert job.result is not None
    with sessions() as session:
        run = session.get_one(ImportanceRun, int(job.result["importance_run_id"]))
        raw, _ = _stored_scores(session, run.id, (2, 4))
    assert (run.dtype, run.config["dtype"]) == ("bfloat16", "bfloat16")
    np.testing.assert_allclose(raw, _direct_scores(classifier_path, "bfloat16"), rtol=1e-6)
    assert not np.allclose(raw, _direct_scores(classifier_path), rtol=1e-3)
