"""Ablations: ``POST /ablations`` validates everything before queueing, the job stores a run with its
baseline and outcomes (or nothing), outcomes are served per model and per head type, ``headcat
ablate`` / ``headcat report`` print Tables 2 and 3, and pruning the real SST-2 model hurts it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.ablation import paper_plan
from service.ablations import repository
from service.ablations.report import markdown_report
from service.ablations.schemas import normalize_selection
from service.jobs.runner import run_inline
from service.orm import AblationBaseline, AblationOutcome, AblationRun, CatalogModel, Job
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    ("The cat sat on the mat.", "It was warm there."),
    ("Paris is the capital of France.", "Many tourists visit it."),
    ("She plays the violin every evening.", "Her neighbours like it."),
    ("The river flooded the valley.", "Farmers lost their crops."),
    ("He wrote a long letter.", "Nobody ever read it."),
    ("Prices rose sharply last year.", "Wages did not keep up."),
    ("The team won the final.", "Fans celebrated all night."),
    ("A storm is coming tonight.", "Close the windows, please."),
]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Unlabelled text pairs (JSONL ``text``/``text_pair``): data for the drift task."""
    path = tmp_path_factory.mktemp("ablation-data") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"text": a, "text_pair": b}) + "\n" for a, b in TEXTS), encoding="utf-8")
    return path


def request_for(path: Path, **overrides: Any) -> dict[str, Any]:
    request = {"model": TINY, "data": str(path), "task": "drift", "limit": 8, "batch_size": 4, "device": "cpu"}
    return {**request, **overrides}


def tiny_types(session: Session) -> list[str]:
    model = session.scalars(select(CatalogModel).where(CatalogModel.name == TINY)).one()
    assert model.current_clustering_id is not None
    from ingest.clustering import base_type

    names = repository.assignments(session, model.id, model.current_clustering_id).values()
    return sorted({base_type(name) or name for name in names})


def committed_jobs(engine: Engine) -> int:
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


# --- the API: queued only when everything checks out ---------------------------------------------


def test_a_valid_request_queues_one_gpu_job_with_its_rows_normalised(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int, pairs_file: Path
) -> None:
    with sessions() as session:
        kind = tiny_types(session)[0]
    plan = [{"prune": kind}, {"id": "mixed", "ops": {"uniform": "layers:1", "prune": [[0, 1], [0, 2]]}}]
    answer = client.post("/ablations", json=request_for(pairs_file, plan=plan))
    assert answer.status_code == 202, answer.text
    with sessions() as session:
        job = session.get_one(Job, answer.json()["job_id"])
        assert (job.kind, job.queue, job.status) == ("ablation", "gpu", "queued")
        assert job.procrastinate_job_id is not None
        assert job.request["plan"] == [
            {"id": None, "label": None, "ops": {"prune": {"types": [kind]}}},
            {"id": "mixed", "label": None, "ops": {"prune": {"heads": [[0, 1], [0, 2]]}, "uniform": {"layers": [1]}}},
        ]
    again = client.post("/ablations", json=request_for(pairs_file, plan=plan))
    assert again.json()["duplicate"] is True


@pytest.mark.parametrize(
    ("overrides", "status", "field", "says"),
    [
        ({"model": "nope"}, 404, "model", "no model named 'nope'"),
        ({"plan": [{"prune": "nosuch"}]}, 422, "plan", "unknown head type(s) 'nosuch'"),
        ({"plan": [{"prune": "layers:2"}]}, 422, "plan", "layer 2 is out of range"),
        ({"plan": [{"prune": "0:4"}]}, 422, "plan", "head 4 (layer 0) is out of range"),
        ({"plan": [{"prune": "layers:0"}, {"prune": "layers:0"}]}, 422, "plan", "unique"),
        ({"clustering": 2_000_000}, 404, "clustering", "no clustering with id 2000000"),
        ({"data": "/no/such/file.jsonl"}, 422, "data", "/no/such/file.jsonl"),
        ({"data": "hub:squad"}, 422, "data", "datasets"),
        ({"task": "squad"}, 422, "task", "question-answering head"),
        ({"task": "glue"}, 422, "task", "sequence-classification head"),
        ({"articles": "24-47"}, 422, "articles", "only SQuAD"),
    ],
)
def test_bad_input_is_4xx_naming_it_and_queues_nothing(
    reader: TestClient,
    catalog_engine: Engine,
    pairs_file: Path,
    overrides: dict[str, Any],
    status: int,
    field: str,
    says: str,
) -> None:
    if overrides.get("data") == "hub:squad" and importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed here: hub sets are read, not refused")
    before = committed_jobs(catalog_engine)
    answer = reader.post("/ablations", json=request_for(pairs_file, **overrides))
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["field"] == field
    assert body["detail"].startswith(f"{field}:")
    assert says in body["detail"]
    assert committed_jobs(catalog_engine) == before


@pytest.mark.parametrize(
    "overrides",
    [
        {"plan": [{"prnue": "dense"}]},
        {"plan": [{"prune": "0:x"}]},
        {"plan": [{"prune": {"layers": [0], "types": ["dense"]}}]},
        {"plan": []},
        {"sample": "spread", "limit": None},
        {"limit": 0},
        {"device": "tpu"},
    ],
)
def test_malformed_requests_are_422_before_anything_is_read(
    reader: TestClient, catalog_engine: Engine, pairs_file: Path, overrides: dict[str, Any]
) -> None:
    before = committed_jobs(catalog_engine)
    answer = reader.post("/ablations", json=request_for(pairs_file, **overrides))
    assert answer.status_code == 422, answer.text
    assert committed_jobs(catalog_engine) == before


def test_a_clustering_of_another_model_is_refused(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int, tiny_bert_path: Path, pairs_file: Path
) -> None:
    assert run_inline(sessions, "ingest", ingest_request(tiny_bert_path, name="other", samples=8)).status == "succeeded"
    other = run_inline(sessions, "clustering", {"models": ["other"], "k": 2, "seed": 0}).result
    assert other is not None
    answer = client.post("/ablations", json=request_for(pairs_file, clustering=other["clustering_id"]))
    assert answer.status_code == 422
    expected = f"clustering: clustering {other['clustering_id']} does not cover 'tiny'; it clusters 'other'"
    assert answer.json()["detail"] == expected


def test_an_unclustered_model_ablates_by_position_but_not_by_type(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int, pairs_file: Path
) -> None:
    by_type = client.post("/ablations", json=request_for(pairs_file))
    assert by_type.status_code == 422
    assert by_type.json()["field"] == "clustering"
    assert "headcat cluster tiny" in by_type.json()["detail"]
    job = run_inline(sessions, "ablation", request_for(pairs_file, plan=[{"prune": "0:0,1:3"}]))
    with sessions() as session:
        run = session.get_one(AblationRun, job.result["ablation_run_id"])  # type: ignore[index]
        assert run.clustering_id is None
        assert run.types == {}


def test_labels_that_do_not_fit_the_head_fail_before_any_compute(
    client: TestClient, sessions: sessionmaker[Session], tmp_path: Path, minilm_path: Path
) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, id2label={0: "negative", 1: "positive"},
                        label2id={"negative": 0, "positive": 1})  # fmt: skip
    source = tmp_path / "tiny-classifier"
    BertForSequenceClassification(config).eval().save_pretrained(source)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(source)
    assert run_inline(sessions, "ingest", ingest_request(source, name="cls", samples=8)).status == "succeeded"
    bad = tmp_path / "three.tsv"
    bad.write_text("sentence\tlabel\ngood film\t1\nawful film\t0\nodd film\t2\n", encoding="utf-8")
    named = tmp_path / "named.tsv"
    named.write_text("sentence\tlabel\ngood film\tpositive\nawful film\tmeh\n", encoding="utf-8")
    before = jobs(sessions)
    for data, says in ((bad, "label id(s) [2] do not fit the model's head of 2 labels"), (named, "'meh'")):
        body = {"model": "cls", "data": str(data), "plan": [{"prune": "layers:0"}], "device": "cpu"}
        answer = client.post("/ablations", json=body)
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == "data"
        assert says in answer.json()["detail"]
    assert jobs(sessions) == before
    good = tmp_path / "good.tsv"
    good.write_text("sentence\tlabel\ngood film\tpositive\nawful film\tnegative\n", encoding="utf-8")
    job = run_inline(sessions, "ablation", {"model": "cls", "data": str(good), "plan": [{"prune": "all"}],
                                            "device": "cpu"})  # fmt: skip
    with sessions() as session:
        run = session.get_one(AblationRun, job.result["ablation_run_id"])  # type: ignore[index]
        assert run.task == "glue"  # inferred from the classification head
        assert set(session.get_one(AblationBaseline, run.baseline_id).metrics) == {"accuracy", "f1", "kl"}


# --- the job: a stored run with its baseline, or nothing --------------------------------------------


def test_the_paper_plan_stores_a_baseline_and_every_row_and_serves_them_by_type(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int, pairs_file: Path
) -> None:
    with sessions() as session:
        types = tiny_types(session)
    job = run_inline(sessions, "ablation", request_for(pairs_file))
    assert job.status == "succeeded"
    assert job.progress_done == job.progress_total == len(paper_plan(types))
    with sessions() as session:
        run = session.get_one(AblationRun, job.result["ablation_run_id"])  # type: ignore[index]
        assert (run.status, run.task, run.plan, run.n_examples, run.data_size) == ("complete", "drift", "paper", 8, 8)
        assert run.data_kind == "jsonl"
        assert run.data_sha256 is not None
        assert sum(run.types.values()) == 8
        outcomes = session.scalars(select(AblationOutcome).where(AblationOutcome.run_id == run.id)).all()
        assert [o.row_id for o in sorted(outcomes, key=lambda o: o.position)] == [r.id for r in paper_plan(types)]
        baseline = next(o for o in outcomes if o.row_id == "baseline")
        assert baseline.operations == []
        assert baseline.heads == 0
        assert baseline.metrics["cosine"] == pytest.approx(1.0)
        assert all(o.baseline == baseline.metrics for o in outcomes)
        pruned = next(o for o in outcomes if o.row_id == f"prune.{types[0]}")
        assert pruned.types == [types[0]]
        assert pruned.type_ops == {types[0]: {"prune": run.types[types[0]]}}
        assert pruned.metrics["cosine"] < 1.0

    runs = client.get(f"/models/{TINY}/ablations").json()
    assert [r["id"] for r in runs] == [run.id]
    served = {o["row_id"]: o for o in runs[0]["outcomes"]}
    assert served[f"prune.{types[0]}"]["deltas"]["cosine"] == pytest.approx(pruned.metrics["cosine"] - 1.0)
    assert runs[0]["baseline"]["metrics"] == baseline.metrics
    by_type = client.get(f"/models/{TINY}/ablations", params={"type": types[-1]}).json()
    rows = [o["row_id"] for o in by_type[0]["outcomes"]]
    assert f"prune.{types[-1]}" in rows
    assert "baseline" not in rows
    assert all(types[-1] in o["types"] for o in by_type[0]["outcomes"])
    unknown = client.get(f"/models/{TINY}/ablations", params={"type": "nosuch"})
    assert unknown.status_code == 422
    assert unknown.json()["field"] == "type"
    assert client.get("/models/nope/ablations").status_code == 404
    report = client.get(f"/ablations/{run.id}/report")
    assert report.status_code == 200
    assert "Table 2" in report.text
    assert "Table 3" in report.text
    assert "| Baseline |" in report.text

    again = run_inline(sessions, "ablation", request_for(pairs_file))
    with sessions() as session:
        second = session.get_one(AblationRun, again.result["ablation_run_id"])  # type: ignore[index]
        assert second.baseline_id == run.baseline_id  # one stored baseline per model, data and limit
        assert second.config["baseline_reused_in_memory"] is True
        assert session.scalar(select(func.count()).select_from(AblationBaseline)) == 1


def test_an_interrupted_ablation_stores_nothing_that_looks_finished(
    sessions: sessionmaker[Session], tiny_clustered: int, pairs_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ingest.evaluation import Evaluator

    run = Evaluator.run
    calls = {"n": 0}

    def breaks_on_the_third_row(self: Evaluator, spec: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return run(self, spec)

    monkeypatch.setattr(Evaluator, "run", breaks_on_the_third_row)
    with pytest.raises(RuntimeError, match="simulated"):
        run_inline(sessions, "ablation", request_for(pairs_file, limit=6))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(AblationRun)) == 0
        assert session.scalar(select(func.count()).select_from(AblationOutcome)) == 0
        assert session.scalar(select(func.count()).select_from(AblationBaseline)) == 0
        job = session.scalars(select(Job).where(Job.kind == "ablation")).one()
        assert job.status == "failed"
        assert "simulated" in (job.error or "")
        assert job.result is None


# --- selections and the report, without a database ------------------------------------------------


@pytest.mark.parametrize(
    ("written", "rule"),
    [
        ("dense", {"types": ["dense"]}),
        ("dense, vertical", {"types": ["dense", "vertical"]}),
        (["dense", "vertical"], {"types": ["dense", "vertical"]}),
        ("all-but:diagonal", {"all_but_types": ["diagonal"]}),
        ("all", {"all": True}),
        ("layers:3-5", {"layers": [3, 4, 5]}),
        ("layers:0,2/heads:1-2", {"layers": [0, 2], "heads": [1, 2]}),
        ("0:1, 5:11", {"heads": [[0, 1], [5, 11]]}),
        ([[0, 1], [5, 11]], {"heads": [[0, 1], [5, 11]]}),
        ({"layers": "1-2"}, {"layers": [1, 2]}),
        ({"union": ["dense", "layers:0"]}, {"union": [{"types": ["dense"]}, {"layers": [0]}]}),
    ],
)
def test_every_spelling_of_a_selection_is_one_stored_rule(written: Any, rule: dict[str, Any]) -> None:
    from ingest.ablation import HeadSelection

    assert normalize_selection(written) == rule
    assert HeadSelection.from_dict(rule).to_dict() == rule


def test_the_report_marks_partial_selections_and_deltas() -> None:
    from datetime import UTC, datetime

    from service.ablations.schemas import AblationRunRead

    now = datetime.now(UTC).isoformat()
    metrics = {"exact_match": 50.0, "f1": 60.0, "kl": 0.0}

    def outcome(row_id: str, ops: dict[str, dict[str, int]], em: float, f1: float, ref: str | None) -> dict:
        operations = sorted({op for by_op in ops.values() for op in by_op})
        return {"row_id": row_id, "label": row_id, "paper_ref": ref, "operations": operations, "selection": {},
                "types": sorted(ops), "type_ops": ops, "heads": 1, "metrics": {"exact_match": em, "f1": f1, "kl": 0.5},
                "baseline": metrics, "deltas": {"f1": f1 - 60.0}, "n_examples": 10, "seconds": 1.0}  # fmt: skip

    run = AblationRunRead.model_validate(
        {"id": 7, "model": "m", "clustering_id": 3, "status": "complete", "task": "squad",
         "data": {"kind": "squad", "source": "/x/dev.json", "sha256": "ab", "subset": "articles 24-47", "size": 100},
         "limit": 10, "n_examples": 10, "plan": "custom", "types": {"dense": 4, "diagonal": 2}, "config": {},
         "device": "cpu", "dtype": "float32", "seconds": 3.0, "started_at": now, "finished_at": now,
         "baseline": {"id": 1, "task": "squad", "data_key": "sha256:ab", "data_subset": None, "limit": 10,
                      "max_length": 384, "dtype": "float32", "n_examples": 10, "metrics": metrics, "seconds": 1.0,
                      "device": "cpu", "created_at": now},
         "outcomes": [
             {**outcome("baseline", {}, 50.0, 60.0, "T2.1"), "metrics": metrics, "deltas": {"f1": 0.0}},
             outcome("prune.diagonal", {"diagonal": {"prune": 2}}, 5.0, 9.0, "T2.3"),
             outcome("custom", {"dense": {"prune": 1, "uniform": 2}}, 40.0, 50.0, None),
             outcome("drop_intra.all_but.dense", {"diagonal": {"drop_intra": 2}}, 30.0, 40.0, "T3.lower"),
         ]}
    )  # fmt: skip
    text = markdown_report(run)
    assert "| Baseline | T2.1 | ✓ | ✓ | 50.00 | 60.00 |  | 0.0000 |" in text
    assert "| Prune | T2.3 | ✓ | ✗ | 5.00 | 9.00 | -51.00 | 0.5000 |" in text
    assert "| Prune + substitute | custom | ✗ 1/4 1/L 2/4 | ✓ |" in text
    assert "| All types but one | drop_intra.all_but.dense | ✓ | ✓ | ✗ | ✓ | 30.00 | 40.00 | -20.00 | 0.5000 |" in text
    assert "|  | id | Dense intra | Dense inter | Diagonal intra | Diagonal inter | EM | F1 | ΔF1 | KL |" in text


# --- the CLI, on the module's committed catalog ---------------------------------------------------


@pytest.mark.slow
def test_the_cli_ablates_and_reports_what_the_api_serves(
    reader: TestClient, committed_database_url: str, catalog_engine: Engine, pairs_file: Path
) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "service.cli", *args]
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)

    with Session(catalog_engine) as session:
        kind = tiny_types(session)[0]
    before = committed_jobs(catalog_engine)
    done = cli("ablate", TINY, "--data", str(pairs_file), "--task", "drift", "--row", f"prune={kind}",
               "--row", "uniform=layers:1;prune=0:0", "--limit", "6", "--device", "cpu")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Table 2" in done.stdout
    assert "| Baseline |" in done.stdout
    assert "| Prune + substitute | prune.L0H0+uniform.layers[1] |" in done.stdout
    served = reader.get(f"/models/{TINY}/ablations").json()[0]
    assert [o["row_id"] for o in served["outcomes"]] == ["baseline", f"prune.{kind}", "prune.L0H0+uniform.layers[1]"]
    report = cli("report", TINY)
    assert report.returncode == 0, report.stderr
    assert report.stdout == reader.get(f"/ablations/{served['id']}/report").text == done.stdout

    bad = cli("ablate", TINY, "--data", str(pairs_file), "--prune", "nosuch", "--device", "cpu")
    assert bad.returncode == 2
    assert "'nosuch'" in bad.stderr
    both = cli("ablate", TINY, "--data", str(pairs_file), "--plan", "paper", "--prune", kind)
    assert both.returncode == 2
    assert "not both" in both.stderr
    assert committed_jobs(catalog_engine) == before + 1  # the good one only


# --- a real task model --------------------------------------------------------------------------------


@pytest.fixture
def sst2(sessions: sessionmaker[Session], shared_dir: Path) -> Path:
    """minilm-sst2 ingested (32 built-in samples) and clustered (k = 4) in the test's transaction."""
    source = shared_dir / "models" / "minilm-sst2"
    job = run_inline(sessions, "ingest", ingest_request(source, name="sst2", samples=32))
    assert job.status == "succeeded", job.error
    assert run_inline(sessions, "clustering", {"models": ["sst2"], "k": 4, "seed": 0}).status == "succeeded"
    return shared_dir / "data" / "glue-sst2" / "dev.tsv"


@pytest.mark.slow
def test_pruning_the_real_sst2_model_by_type_costs_accuracy_where_the_heads_matter(
    sessions: sessionmaker[Session], client: TestClient, sst2: Path
) -> None:
    with sessions() as session:
        model = session.scalars(select(CatalogModel).where(CatalogModel.name == "sst2")).one()
        assert model.current_clustering_id is not None
        from ingest.clustering import base_type

        names = repository.assignments(session, model.id, model.current_clustering_id).values()
        types = sorted({base_type(name) or name for name in names})
    plan = [{"prune": t} for t in types] + [{"id": "prune.all", "ops": {"prune": "all"}}]
    request = {"model": "sst2", "data": str(sst2), "plan": plan, "limit": 64, "sample": "spread", "device": "cpu"}
    job = run_inline(sessions, "ablation", request)  # through the job handler, as a worker runs it
    assert job.status == "succeeded", job.error
    run = client.get("/models/sst2/ablations").json()[0]
    assert (run["task"], run["n_examples"], run["data"]["size"]) == ("glue", 64, 872)
    accuracy = {o["row_id"]: o["metrics"]["accuracy"] for o in run["outcomes"]}
    baseline = accuracy.pop("baseline")
    assert set(accuracy) == {f"prune.{t}" for t in types} | {"prune.all"}
    assert baseline >= 75.0  # the model's dev accuracy is 85.55 on all 872 sentences
    assert accuracy["prune.all"] <= 65.0  # no attention at all: near the majority class
    worst = min(accuracy[f"prune.{t}"] for t in types)
    assert worst <= baseline - 10.0, accuracy  # some type matters
    assert max(accuracy[f"prune.{t}"] for t in types) >= baseline - 10.0, accuracy  # and some hardly does


@pytest.mark.parametrize("renormalize", [False, True])
def test_every_stored_outcome_is_what_run_plan_computes_row_by_row(
    sessions: sessionmaker[Session], sharp_bert_path: Path, pairs_file: Path, renormalize: bool
) -> None:
    """Every row of the paper plan as stored (its position, id, label, paper reference, spec, operations, heads,
    types and per-type operation counts, each metric by name, the baseline, examples), read back by plain SQL,
    equals ``run_plan`` called here on the same model, data, types and ``renormalize`` flag; the per-type counts
    are recounted here from the spec and the stored types. The rows' metrics differ well beyond the tolerance
    (checked), so two rows' outcomes stored under each other's ids fail."""
    from ingest.evaluation import Evaluator, run_plan
    from ingest.loading import load_model

    assert run_inline(sessions, "ingest", ingest_request(sharp_bert_path, name="sharp", samples=16)).status == (
        "succeeded"
    )
    clustered = run_inline(sessions, "clustering", {"models": ["sharp"], "k": 4, "seed": 0})
    assert clustered.result is not None, clustered.error
    clustering_id = clustered.result["clustering_id"]
    job = run_inline(sessions, "ablation", request_for(pairs_file, model="sharp", renormalize=renormalize))
    assert job.status == "succeeded", job.error
    assert job.result is not None
    run_id = job.result["ablation_run_id"]
    with sessions() as session:
        run = session.execute(text("SELECT * FROM ablation_runs WHERE id = :r"), {"r": run_id}).mappings().one()
        baseline = session.execute(
            text("SELECT * FROM ablation_baselines WHERE id = :b"), {"b": run["baseline_id"]}
        ).mappings().one()  # fmt: skip
        outcomes = session.execute(
            text("SELECT * FROM ablation_outcomes WHERE run_id = :r ORDER BY position"), {"r": run_id}
        ).mappings().all()  # fmt: skip
        assignments = {
            (r.stack, r.layer, r.head): r.name
            for r in session.execute(
                text("SELECT h.stack, h.layer, h.head, c.name FROM head_assignments a JOIN heads h ON h.model_id ="
                     " a.model_id AND h.id = a.head_id JOIN clusters c ON c.id = a.cluster_id WHERE a.clustering_id"
                     " = :c"), {"c": clustering_id}
            )
        }  # fmt: skip
    loaded = load_model(str(sharp_bert_path), device="cpu")
    evaluator = Evaluator.for_task("drift", loaded.model, loaded.tokenizer, TEXTS, batch_size=4, max_length=128,
                                   cache=False)  # fmt: skip
    rows = paper_plan(sorted(set(assignments.values())))
    expected = run_plan(evaluator, rows, assignments=assignments, renormalize=renormalize)
    cosines = sorted(o.metrics["cosine"] for o in expected)
    assert min(b - a for a, b in zip(cosines, cosines[1:], strict=False)) > 1e-6  # 10 x the tolerance below

    assert (run["clustering_id"], run["n_examples"], run["types"]) == (
        clustering_id, len(TEXTS), dict(Counter(assignments.values())),
    )  # fmt: skip
    assert run["config"]["renormalize"] is renormalize
    assert baseline["metrics"] == pytest.approx(dict(evaluator.baseline().values), abs=1e-9)
    assert len(outcomes) == len(expected) == len(rows)
    for position, (stored, want, row) in enumerate(zip(outcomes, expected, rows, strict=True)):
        where = (position, want.row_id)
        assert (stored["position"], stored["row_id"], stored["label"], stored["paper_ref"]) == (
            position, want.row_id, want.label, want.paper_ref,
        ), where  # fmt: skip
        assert stored["spec"] == json.loads(json.dumps(want.spec)), where
        ops = want.spec.get("ops", {})
        assert stored["operations"] == sorted(ops), where
        assert stored["selection"] == row.to_dict()["ops"], where
        assert stored["heads"] == sum(len(heads) for heads in ops.values()), where
        counted: dict[str, Counter[str]] = {}
        for op, heads in ops.items():
            for stack, layer, head in heads:
                counted.setdefault(assignments[stack, layer, head], Counter())[op] += 1
        assert stored["type_ops"] == {name: dict(c) for name, c in counted.items()}, where
        assert stored["types"] == sorted(counted), where
        assert set(stored["metrics"]) == set(want.metrics.values), where
        for name, value in want.metrics.values.items():
            assert stored["metrics"][name] == pytest.approx(value, rel=0, abs=1e-7), (where, name)
        assert stored["baseline"] == baseline["metrics"], where
        assert stored["n_examples"] == want.n_examples, where
