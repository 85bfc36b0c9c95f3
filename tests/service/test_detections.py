"""Detection runs (SPEC 10): the hand-set induction model's heads stored with their scores and roles,
served by ``GET /models/{name}/detections`` and the ``head_detections`` view; bad requests refused
with the field before anything is queued; the CLI's ``headcat detect``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.errors import InvalidInput
from service.jobs.runner import run_inline
from service.orm import DetectionRun, HeadDetection, Job
from tests.induction_model import INDUCTION_HEAD, PREVIOUS_TOKEN_HEAD, save_induction_model
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
INDUCT = "induct"
REQUEST = {"model": INDUCT, "sequences": 6, "length": 10, "copies": 2, "seed": 1, "device": "cpu"}


@pytest.fixture(scope="session")
def induction_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_induction_model(tmp_path_factory.mktemp("induction-model"))


@pytest.fixture
def induct(sessions: sessionmaker[Session], induction_path: Path) -> str:
    job = run_inline(sessions, "ingest", ingest_request(induction_path, INDUCT, samples=8, max_length=32))
    assert job.status == "succeeded", job.error
    return INDUCT


def count(sessions: sessionmaker[Session], table: Any) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(table)) or 0


def test_a_detection_run_is_stored_and_served(sessions: sessionmaker[Session], induct: str, client: TestClient) -> None:
    job = run_inline(sessions, "detection", REQUEST)
    assert job.status == "succeeded", job.error
    assert job.result is not None
    assert job.result["heads"] == 4
    assert job.progress_done == job.progress_total == 6
    served = client.get(f"/models/{INDUCT}/detections").json()
    run = served["runs"][0]
    assert run["config"]["thresholds"] == {"induction": 0.4, "duplicate_token": 0.4, "previous_token": 0.4,
                                           "sink": 0.3}  # fmt: skip
    assert (run["num_sequences"], run["num_tokens"]) == (6, 21)  # BOS + 10 x 2
    assert run["repeat_gain"] > 3.0
    assert run["repeat_gain"] == pytest.approx(run["loss_first"] - run["loss_later"])
    (check,) = run["checks"]  # the causal check: the induction role's heads pruned
    assert (check["role"], check["heads"]) == ("induction", [["decoder", *INDUCTION_HEAD]])
    assert check["with"]["repeat_gain"] == run["repeat_gain"]
    assert abs(check["without"]["repeat_gain"]) < 0.05
    assert check["with"]["corpus_loss"] > 0  # builtin:wiki, 64 texts (mostly [UNK] in this tiny vocabulary)
    assert check["without"]["corpus_loss"] > 0
    assert check["without"]["corpus_loss"] != check["with"]["corpus_loss"]
    heads = {(h["stack"], h["layer"], h["head"]): h for h in served["heads"]}
    assert heads["decoder", *INDUCTION_HEAD]["roles"] == ["induction"]
    assert heads["decoder", *INDUCTION_HEAD]["induction"] == pytest.approx(0.5, abs=1e-3)
    assert heads["decoder", *PREVIOUS_TOKEN_HEAD]["roles"] == ["previous_token"]
    assert heads["decoder", 1, 1]["roles"] == []
    with sessions() as session:
        stored = session.scalar(select(DetectionRun).where(DetectionRun.id == job.result["detection_run_id"]))
        assert stored is not None
        ids = stored.sequences["sequences"]
        assert len(ids) == 6
        assert all(len(row) == 21 and row[1:11] == row[11:21] for row in ids)
        view = session.execute(
            text("SELECT layer, head, induction, roles FROM head_detections WHERE model = :m AND "
                 "'induction' = ANY(roles)"), {"m": INDUCT}
        ).all()  # fmt: skip
        assert [(r.layer, r.head) for r in view] == [INDUCTION_HEAD]
        assert view[0].induction == heads["decoder", *INDUCTION_HEAD]["induction"]
    with sessions() as session:
        stored_scores = {
            (r.stack, r.layer, r.head): (r.induction, r.duplicate_token, r.previous_token, r.sink)
            for r in session.execute(text("SELECT stack, layer, head, induction, duplicate_token, previous_token, sink"
                                          " FROM head_detections WHERE model = :m"), {"m": INDUCT})
        }  # fmt: skip
    served_scores = {key: (h["induction"], h["duplicate_token"], h["previous_token"], h["sink"])
                     for key, h in heads.items()}  # fmt: skip
    assert served_scores == stored_scores
    example = client.get(f"/models/{INDUCT}/detections/example",
                         params={"stack": "decoder", "layer": 0, "head": 0}).json()  # fmt: skip
    assert example["size"] == 21
    assert len(example["map"]) == 21
    assert all(len(row) == 21 for row in example["map"])
    assert len(example["tokens"]) == 21
    assert example["map"][5][4] == pytest.approx(1.0, abs=1e-3)  # the previous-token head's cell (5, 4)


def test_an_encoder_has_no_repeat_gain(sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient) -> None:
    job = run_inline(sessions, "detection", {**REQUEST, "model": TINY})
    assert job.status == "succeeded", job.error
    served = client.get(f"/models/{TINY}/detections").json()
    assert served["runs"][0]["repeat_gain"] is None
    assert served["runs"][0]["checks"] == []
    assert served["runs"][0]["num_tokens"] == 22  # [CLS] + 10 x 2 + [SEP]
    assert len(served["heads"]) == 8


@pytest.mark.parametrize(
    ("overrides", "status", "field", "says"),
    [
        ({"copies": 1}, 422, "copies", "greater than or equal to 2"),
        ({"thresholds": {"induction": 1.5}}, 422, "thresholds", "must lie in [0, 1], not 1.5"),
        ({"thresholds": {"copying": 0.5}}, 422, "thresholds", "unknown detector 'copying'"),
        ({"length": 22}, 422, "length", "more than the 21 non-special tokens"),
        ({"length": 20, "copies": 4}, 422, "length", "more than the model's 64 positions"),
        ({"model": "nosuch"}, 404, "model", "nosuch"),
        ({"corpus": "builtin:nope"}, 422, "corpus", "unknown builtin corpus"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field_and_queue_nothing(
    client: TestClient, sessions: sessionmaker[Session], induct: str, overrides: dict[str, Any], status: int,
    field: str, says: str,
) -> None:  # fmt: skip
    before = count(sessions, Job)
    answer = client.post("/detections", json={**REQUEST, **overrides})
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    assert says in answer.json()["detail"]
    assert count(sessions, Job) == before


def test_a_request_is_queued_once(client: TestClient, sessions: sessionmaker[Session], induct: str) -> None:
    first = client.post("/detections", json=REQUEST)
    assert first.status_code == 202, first.text
    again = client.post("/detections", json=REQUEST).json()
    assert (again["job_id"], again["duplicate"]) == (first.json()["job_id"], True)
    assert count(sessions, DetectionRun) == 0  # queued, nothing written


def test_a_failed_write_leaves_nothing(
    sessions: sessionmaker[Session], induct: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.detections import repository

    monkeypatch.setattr(repository, "head_ids", lambda session, model_id: {})  # the catalog lacks the heads
    with pytest.raises(InvalidInput) as refused:
        run_inline(sessions, "detection", REQUEST)
    assert (refused.value.field, refused.value.message) == (
        "model", f"model: {INDUCT!r} in the catalog lacks its head ('decoder', 0, 0); ingest it again",
    )  # fmt: skip
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.kind == "detection")).one()
        assert job.status == "failed"
        assert "lacks its head" in (job.error or "")
    assert count(sessions, DetectionRun) == count(sessions, HeadDetection) == 0


def test_the_cli_refuses_copies_1_with_exit_2(committed_database_url: str, catalog_engine: Any) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}
    for arguments, says in ((["--copies", "1"], "copies"), (["--threshold", "sink=2"], "thresholds.sink")):
        command = [sys.executable, "-m", "service.cli", "detect", TINY, *arguments, "--device", "cpu"]
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
        assert done.returncode == 2, done.stderr
        assert says in done.stderr.replace("\n", "")
    with Session(catalog_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.kind == "detection")) == 0


def test_get_heads_filters_and_orders_by_role_and_score(
    sessions: sessionmaker[Session], induct: str, tiny_ingested: int, client: TestClient
) -> None:
    assert run_inline(sessions, "detection", REQUEST).status == "succeeded"
    assert run_inline(sessions, "detection", {**REQUEST, "model": TINY}).status == "succeeded"
    with sessions() as session:
        stored = {
            (r.model, r.stack, r.layer, r.head): r for r in session.execute(text("SELECT * FROM head_detections"))
        }
    every = client.get("/heads", params={"limit": 1000}).json()["items"]
    assert len(every) == len(stored) == 12  # across models: induct's 4 and tiny's 8
    for item in every:
        row = stored[item["model"], item["stack"], item["layer"], item["head"]]
        assert (item["induction"], item["previous_token"], item["sink"], item["roles"]) == (
            row.induction,
            row.previous_token,
            row.sink,
            row.roles,
        )
    induction = client.get("/heads", params={"role": "induction"}).json()["items"]
    assert [(h["model"], h["layer"], h["head"]) for h in induction] == [(INDUCT, *INDUCTION_HEAD)]
    either = client.get("/heads", params=[("role", "induction"), ("role", "previous_token"), ("model", INDUCT)])
    assert {(h["layer"], h["head"]) for h in either.json()["items"]} == {INDUCTION_HEAD, PREVIOUS_TOKEN_HEAD}
    above = client.get("/heads", params={"previous_token_gt": 0.5, "limit": 1000}).json()["items"]
    assert {(h["model"], h["stack"], h["layer"], h["head"]) for h in above} == {
        key for key, row in stored.items() if row.previous_token > 0.5
    }
    below = client.get("/heads", params={"sink_lt": 0.2, "model": TINY}).json()["items"]
    assert {(h["layer"], h["head"]) for h in below} == {
        (key[2], key[3]) for key, row in stored.items() if key[0] == TINY and row.sink < 0.2
    }
    ordered = [
        h["induction"] for h in client.get("/heads", params={"order": "-induction", "limit": 1000}).json()["items"]
    ]
    assert ordered == sorted(ordered, reverse=True)
    assert ordered[0] == max(row.induction for row in stored.values())
    refused = client.get("/heads", params={"role": "copying"})
    assert (refused.status_code, refused.json()["field"]) == (422, "role")


def test_the_cli_runs_a_detection_and_prints_the_roles(committed_database_url: str, catalog_engine: Any) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING", "COLUMNS": "200"}
    command = [sys.executable, "-m", "service.cli", "detect", TINY, "--sequences", "4", "--length", "8",
               "--threshold", "sink=0", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 0, done.stderr
    assert "repeat gain: n/a (no causal LM head)" in done.stdout
    assert done.stdout.count("encoder ") == 8  # sink=0: every head has the sink role, so every head is listed
    with Session(catalog_engine) as session:
        run = session.scalars(select(DetectionRun).order_by(DetectionRun.id.desc())).first()
        assert run is not None
        assert run.config["thresholds"]["sink"] == 0.0
        assert run.num_sequences == 4


def test_exports_select_by_role_and_score_by_detector(
    sessions: sessionmaker[Session], induct: str, client: TestClient
) -> None:
    refused = client.get(f"/models/{INDUCT}/export", params={"role": "induction"})
    assert (refused.status_code, refused.json()["field"]) == (422, "role")
    assert "no detection run" in refused.json()["detail"]
    assert run_inline(sessions, "detection", REQUEST).status == "succeeded"
    pruned = client.get(f"/models/{INDUCT}/export", params={"role": "induction", "format": "prune_heads"})
    assert pruned.status_code == 200, pruned.text
    assert pruned.json() == {str(INDUCTION_HEAD[0]): [INDUCTION_HEAD[1]]}
    both = client.get(f"/models/{INDUCT}/export", params=[("role", "induction"), ("role", "previous_token"),
                                                          ("format", "pairs")])  # fmt: skip
    assert both.json() == [list(PREVIOUS_TOKEN_HEAD), list(INDUCTION_HEAD)]
    served = {
        (h["layer"], h["head"]): h["induction"] for h in client.get(f"/models/{INDUCT}/detections").json()["heads"]
    }
    scores = client.get(f"/models/{INDUCT}/export", params={"format": "scores", "score": "induction"}).json()
    assert {(layer, head): value for layer, row in enumerate(scores) for head, value in enumerate(row)} == served
    unknown = client.get(f"/models/{INDUCT}/export", params={"role": "copying"})
    assert (unknown.status_code, unknown.json()["field"]) == (422, "role")


def test_an_ablation_row_prunes_the_heads_of_a_role(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient, tmp_path: Path
) -> None:
    import json

    from service.orm import AblationOutcome

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"text": f"the cat sat on mat {i}", "text_pair": "it ran"}) + "\n"
                            for i in range(4)), encoding="utf-8")  # fmt: skip
    request = {"model": TINY, "data": str(data), "task": "drift", "limit": 4, "batch_size": 4, "device": "cpu",
               "plan": [{"id": "previous", "ops": {"prune": "role:previous_token"}}]}  # fmt: skip
    refused = client.post("/ablations", json=request)
    assert (refused.status_code, refused.json()["field"]) == (422, "plan")
    assert "needs a detection run" in refused.json()["detail"]
    assert run_inline(sessions, "detection", {**REQUEST, "model": TINY}).status == "succeeded"
    scores = sorted(h["previous_token"] for h in client.get(f"/models/{TINY}/detections").json()["heads"])
    middle = (scores[3] + scores[4]) / 2  # half the heads have the role
    again = {**REQUEST, "model": TINY, "thresholds": {"previous_token": middle}}
    assert run_inline(sessions, "detection", again).status == "succeeded"
    chosen = {(h["stack"], h["layer"], h["head"]) for h in client.get(f"/models/{TINY}/detections").json()["heads"]
              if "previous_token" in h["roles"]}  # fmt: skip
    assert len(chosen) == 4
    job = run_inline(sessions, "ablation", request)
    assert job.status == "succeeded", job.error
    with sessions() as session:
        outcome = session.scalars(select(AblationOutcome).where(AblationOutcome.row_id == "previous")).one()
        assert {tuple(head) for head in outcome.spec["ops"]["prune"]} == chosen
        assert outcome.selection == {"prune": {"roles": ["previous_token"]}}
        assert outcome.heads == 4


def test_every_stored_field_is_what_detect_heads_computes_head_by_head(
    sessions: sessionmaker[Session], induct: str, induction_path: Path
) -> None:
    """Issue 27's form for detection runs: every stored field, read back by plain SQL, equals ``detect_heads`` and
    ``causal_check`` called here as the job calls them (the request's thresholds, seed and corpus; none a default).
    Each detector's column differs from every other's somewhere (checked first), so two swapped scores fail."""
    import numpy as np

    from ingest.detectors import DETECTORS, causal_check, detect_heads
    from ingest.loading import load_model
    from service.detections.schemas import DetectionCreate
    from service.detections.service import _texts, detection_config

    request = {**REQUEST, "seed": 3, "thresholds": {"induction": 0.3, "sink": 0.2}, "check": ["induction",
               "previous_token"], "corpus_samples": 8}  # fmt: skip
    job = run_inline(sessions, "detection", request)
    assert job.status == "succeeded", job.error
    assert job.result is not None
    spec = DetectionCreate.model_validate(request)
    config = detection_config(spec)
    loaded = load_model(str(induction_path), device="cpu", task="causal-lm")
    expected = detect_heads(loaded.model, loaded.tokenizer, config)
    checks = causal_check(loaded.model, loaded.tokenizer, expected, ["induction", "previous_token"],
                          texts=_texts(spec))  # fmt: skip
    values = expected.scores["decoder"].reshape(-1, len(DETECTORS))  # (heads, 4)
    for a in range(len(DETECTORS)):
        for b in range(a + 1, len(DETECTORS)):
            assert np.abs(values[:, a] - values[:, b]).max() > 1e-3, (DETECTORS[a], DETECTORS[b])

    with sessions() as session:
        run = session.execute(text("SELECT * FROM detection_runs WHERE id = :r"),
                              {"r": job.result["detection_run_id"]}).mappings().one()  # fmt: skip
        rows = session.execute(
            text("SELECT h.stack, h.layer, h.head, d.induction, d.duplicate_token, d.previous_token, d.sink, d.roles,"
                 " d.example_map FROM head_detector_scores d JOIN heads h ON h.model_id = d.model_id"
                 " AND h.id = d.head_id WHERE d.detection_run_id = :r"),
            {"r": run["id"]},
        ).mappings().all()  # fmt: skip
    assert run["config"] == expected.config.to_json()  # the request's, and the reduction the run took
    assert run["config"]["reduction"] in ("fused", "maps")
    assert (run["config"]["seed"], run["config"]["thresholds"]["induction"], run["config"]["thresholds"]["sink"]) == (
        3, 0.3, 0.2,
    )  # the request's, not detection_config's defaults  # fmt: skip
    assert run["sequences"] == expected.metadata()
    assert (run["num_sequences"], run["num_tokens"]) == expected.sequences.shape
    assert run["loss_first"] == pytest.approx(expected.loss_first, rel=1e-6)
    assert run["loss_later"] == pytest.approx(expected.loss_later, rel=1e-6)
    assert run["repeat_gain"] == pytest.approx(expected.repeat_gain, rel=1e-6)
    assert [c["role"] for c in run["checks"]] == [c["role"] for c in checks]
    for got, want in zip(run["checks"], checks, strict=True):
        assert got["heads"] == [list(h) for h in want["heads"]], got["role"]
        for side in ("with", "without"):
            for key, value in want[side].items():
                assert got[side][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (got["role"], side, key)
    assert run["example_tokens"] == {"tokens": expected.example_tokens}
    assert (run["device"], run["dtype"]) == (expected.device, expected.dtype)
    assert run["example_size"] == expected.example_maps["decoder"].shape[-1]
    assert run["started_at"] <= run["finished_at"]
    assert job.result == {"detection_run_id": run["id"], "model": INDUCT, "heads": len(rows),
                          "repeat_gain": pytest.approx(expected.repeat_gain, rel=1e-6),
                          "seconds": round(run["seconds"], 3)}  # fmt: skip
    roles = expected.roles("decoder")
    stored = {(r["stack"], r["layer"], r["head"]): r for r in rows}
    layers, heads = expected.scores["decoder"].shape[:2]
    assert sorted(stored) == [("decoder", layer, head) for layer in range(layers) for head in range(heads)]
    for (_, layer, head), row in stored.items():
        for k, name in enumerate(DETECTORS):
            assert row[name] == pytest.approx(expected.scores["decoder"][layer, head, k], rel=1e-9), (layer, head, name)
        assert row["roles"] == roles[layer][head], (layer, head)
        np.testing.assert_allclose(row["example_map"], expected.example_maps["decoder"][layer, head].reshape(-1),
                                   rtol=1e-6, err_msg=str((layer, head)))  # fmt: skip


@pytest.mark.parametrize(
    ("message", "field", "said"),
    [
        ("sequences: must be >= 1, not 0", "sequences", "sequences: must be >= 1, not 0"),
        ("length 22 is more than the 21 tokens", "length", "length 22 is more than the 21 tokens"),
        ("copies: must be >= 2", "copies", "copies: must be >= 2"),
        ("seed: must be >= 0, not -1", "seed", "seed: must be >= 0, not -1"),
        ("thresholds.sink.low: must lie in [0, 1]", "thresholds", "thresholds.sink.low: must lie in [0, 1]"),
        ("batch_size: must be >= 1, not 0", "batch_size", "batch_size: must be >= 1, not 0"),
        ("corpus: no text with two tokens", "corpus", "corpus: no text with two tokens"),
        ("the causal check needs a causal LM head", "model", "model: the causal check needs a causal LM head"),
        ("lengths: differ", "model", "model: lengths: differ"),
    ],
)  # fmt: skip
def test_a_detection_error_is_the_request_field_it_names(message: str, field: str, said: str) -> None:
    from ingest.detectors import DetectionError
    from service.detections.service import refusal

    refused = refusal(DetectionError(message))
    assert (refused.field, refused.message) == (field, said)


def test_reads_of_what_is_not_there_are_404_naming_the_field(
    sessions: sessionmaker[Session], induct: str, client: TestClient
) -> None:
    for path, field, says in [
        (f"/models/{INDUCT}/detections", "name",
         f"name: {INDUCT!r} has no detection run; run `headcat detect {INDUCT}` first"),
        ("/models/nosuch/detections", "name", "name: no model named 'nosuch'"),
    ]:  # fmt: skip
        answer = client.get(path)
        assert (answer.status_code, answer.json()["field"]) == (404, field), answer.text
        assert answer.json()["detail"].startswith(says)
    job = run_inline(sessions, "detection", REQUEST)
    assert job.result is not None
    missing = client.get(f"/models/{INDUCT}/detections/example", params={"stack": "encoder", "layer": 0, "head": 0})
    assert (missing.status_code, missing.json()["field"], missing.json()["detail"]) == (
        404, "head", f"head: {INDUCT!r} has no encoder head 0-0 in its current detection run",
    )  # fmt: skip
    with sessions() as session, session.begin():  # tokens that no longer match the map are not served
        session.execute(text("UPDATE detection_runs SET example_tokens = CAST(:t AS jsonb) WHERE id = :r"),
                        {"t": '{"tokens": ["a", "b"]}', "r": job.result["detection_run_id"]})  # fmt: skip
    example = client.get(f"/models/{INDUCT}/detections/example", params={"stack": "decoder", "layer": 0, "head": 0})
    assert (example.json()["tokens"], example.json()["size"]) == ([], 21)


def test_the_job_names_the_field_of_what_only_the_run_finds(
    sessions: sessionmaker[Session], induct: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device this machine lacks; a refusal from the detectors or the causal check once the model is loaded
    (the model changed since it was checked): each fails the job naming its field once, and stores no run."""
    import ingest.detectors
    from ingest.detectors import DetectionError

    def fails(request: dict[str, Any]) -> InvalidInput:
        with pytest.raises(InvalidInput) as refused:
            run_inline(sessions, "detection", request)
        assert count(sessions, DetectionRun) == 0
        return refused.value

    device = fails({**REQUEST, "device": "cuda:99"})
    assert device.field == "device"
    assert device.message.startswith("device: device 'cuda:99' ")

    def too_long(*args: Any, **kwargs: Any) -> None:
        raise DetectionError("length 10 x copies 2 makes 21-token sequences, more than the model's 16 positions")

    with monkeypatch.context() as patch:
        patch.setattr(ingest.detectors, "detect_heads", too_long)
        refused = fails(REQUEST)
    assert (refused.field, refused.message) == (
        "length", "length 10 x copies 2 makes 21-token sequences, more than the model's 16 positions",
    )  # fmt: skip

    def no_head(*args: Any, **kwargs: Any) -> None:
        raise DetectionError("the causal check measures the repeat gain, which needs a causal LM head")

    with monkeypatch.context() as patch:
        patch.setattr(ingest.detectors, "causal_check", no_head)
        refused = fails(REQUEST)
    assert (refused.field, refused.message) == (
        "model", "model: the causal check measures the repeat gain, which needs a causal LM head",
    )  # fmt: skip


def test_the_request_s_dtype_and_batch_size_are_the_run_s(sessions: sessionmaker[Session], induct: str) -> None:
    job = run_inline(sessions, "detection", {**REQUEST, "dtype": "bfloat16", "batch_size": 3, "check": []})
    assert job.result is not None
    with sessions() as session:
        run = session.get_one(DetectionRun, job.result["detection_run_id"])
    assert (run.dtype, run.config["dtype"], run.config["device"], run.config["batch_size"]) == (
        "bfloat16", "bfloat16", "cpu", 3,
    )  # fmt: skip


def test_a_model_whose_files_are_gone_is_refused_before_anything_is_queued(
    client: TestClient, sessions: sessionmaker[Session], induct: str, tmp_path: Path
) -> None:
    with sessions() as session, session.begin():
        session.execute(
            text("UPDATE models SET source = :s WHERE name = :m"), {"s": str(tmp_path / "gone"), "m": INDUCT}
        )
    from transformers import AutoConfig

    with pytest.raises(OSError, match="gone") as unreadable:
        AutoConfig.from_pretrained(str(tmp_path / "gone"), local_files_only=True)
    first = str(unreadable.value).strip().splitlines()[0]
    before = count(sessions, Job)
    answer = client.post("/detections", json=REQUEST)
    assert (answer.status_code, answer.json()["field"]) == (422, "model"), answer.text
    assert answer.json()["detail"] == f"model: {INDUCT!r}: its config or tokenizer cannot be read ({first})"
    assert count(sessions, Job) == before


def test_the_config_and_tokenizer_are_read_at_the_catalog_s_revision_without_remote_code(
    client: TestClient, sessions: sessionmaker[Session], induct: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking a request reads the model's config and tokenizer as ingest loaded them: the stored revision, no
    code from the checkpoint (``trust_remote_code=False``), and offline when the hub is."""
    import transformers
    from huggingface_hub import constants

    seen: list[tuple[str, dict[str, Any]]] = []
    for name in ("AutoConfig", "AutoTokenizer"):
        loader = getattr(transformers, name)
        original = loader.from_pretrained.__func__

        def spy(cls: Any, source: str, *args: Any, _name: str = name, _original: Any = original, **options: Any) -> Any:
            seen.append((_name, options))
            return _original(cls, source, *args, **options)

        monkeypatch.setattr(loader, "from_pretrained", classmethod(spy))
    assert client.post("/detections", json=REQUEST).status_code == 202
    want = {"revision": None, "trust_remote_code": False, "local_files_only": constants.HF_HUB_OFFLINE}
    assert seen[0] == ("AutoConfig", want)
    assert next(options for name, options in seen if name == "AutoTokenizer") == want  # (it reads the config too)


def test_a_checkpoint_without_its_weights_fails_the_job_as_the_model_s(
    sessions: sessionmaker[Session], induct: str, induction_path: Path, tmp_path: Path
) -> None:
    import shutil

    weightless = tmp_path / "weightless"  # its config and tokenizer are there (the checks pass), its weights not
    shutil.copytree(induction_path, weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with sessions() as session, session.begin():
        session.execute(text("UPDATE models SET source = :s WHERE name = :m"), {"s": str(weightless), "m": INDUCT})
    with pytest.raises(InvalidInput) as refused:
        run_inline(sessions, "detection", REQUEST)
    assert refused.value.field == "model"
    assert refused.value.message.startswith("model: ")
    assert count(sessions, DetectionRun) == 0
