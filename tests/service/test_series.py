"""Series (SPEC 11): ten checkpoints of the hand-set induction circuit at growing strengths ingested and
detected by one command, an eleventh costing only itself; every stored score at every step equal to
plain loops over that checkpoint's eager ``output_attentions``; formation steps equal to a
recomputation from the stored scores; the REST reads; what a series refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.orm import Session

from ingest.types import ROLES
from service.orm import CatalogModel, DetectionRun, FeatureRun, Job, Series
from tests.induction_model import (
    INDUCTION_HEAD,
    PREVIOUS_TOKEN_HEAD,
    build_induction_checkpoint,
    save_induction_series,
)
from tests.ingest.test_detectors import reference_scores
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
SERIES = "grow"
# step -> (previous-token head's strength, induction head's strength): the previous-token head sharpens first;
# the induction head flashes at step 200 and fades (no formation there), then grows from step 500 on.
STRENGTHS = {100 * k: (min(1.0, k / 3), induction) for k, induction in
             enumerate((0.0, 0.0, 1.0, 0.0, 0.0, 0.2, 0.5, 1.0, 1.0, 1.0))}  # fmt: skip
ELEVENTH = (1000, (1.0, 1.0))
DETECT = ["--detect", "--detect-sequences", "6", "--detect-length", "10", "--detect-seed", "1",
          "--detect-corpus", "none"]  # fmt: skip


def headcat(url: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "HEADCAT_LOG_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "service.cli", *arguments], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=PATIENCE, check=False)  # fmt: skip


def ingest_series(url: str, directory: Path) -> subprocess.CompletedProcess[str]:
    return headcat(url, "ingest", str(directory), "--series", SERIES, "--samples", "4", "--max-length", "32",
                   "--device", "cpu", *DETECT)  # fmt: skip


@pytest.fixture(scope="module")
def series_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_induction_series(tmp_path_factory.mktemp("series"), STRENGTHS)


@dataclass
class Grown:
    """What each of the three runs of the same command left: the ten steps, again, then with an eleventh."""

    engine: Engine
    runs: list[subprocess.CompletedProcess[str]]
    counts: list[dict[str, int]]
    steps: list[Any]  # (step, name, source) after the first run
    series: Any
    newest_jobs: list[str]


@pytest.fixture(scope="module")
def grown(committed_database_url: str, series_directory: Path) -> Iterator[Grown]:
    """The ten steps ingested and detected by one command, the command again, then again after an eleventh
    ``step-N/`` was added, in a committed catalog (what each run did is kept for the first test)."""
    engine = create_engine(committed_database_url)
    record = Grown(engine, [], [], [], None, [])
    record.runs.append(ingest_series(committed_database_url, series_directory))
    record.counts.append(counts(engine))
    with Session(engine) as session:
        record.series = session.scalars(select(Series)).one_or_none()
        record.steps = session.execute(
            select(CatalogModel.step, CatalogModel.name, CatalogModel.source).order_by(CatalogModel.step)
        ).all()
    record.runs.append(ingest_series(committed_database_url, series_directory))  # nothing new: nothing computed
    record.counts.append(counts(engine))
    save_induction_series(series_directory, dict([ELEVENTH]))
    record.runs.append(ingest_series(committed_database_url, series_directory))
    record.counts.append(counts(engine))
    with Session(engine) as session:
        jobs = session.scalars(select(Job).order_by(Job.id.desc()).limit(2)).all()
        record.newest_jobs = [job.request["model"] if job.kind == "detection" else job.request["name"] for job in jobs]
    yield record
    engine.dispose()


def counts(engine: Engine) -> dict[str, int]:
    with Session(engine) as session:
        return {name: session.scalar(select(func.count()).select_from(table)) or 0
                for name, table in (("models", CatalogModel), ("features", FeatureRun), ("detections", DetectionRun),
                                    ("jobs", Job))}  # fmt: skip


@pytest.mark.slow
def test_ten_checkpoints_in_one_command_and_an_eleventh_costs_only_itself(grown: Grown) -> None:
    for run in grown.runs:
        assert run.returncode == 0, run.stderr
    first, again, added = grown.counts
    assert (first["models"], first["features"], first["detections"]) == (10, 10, 10)
    assert (grown.series.name, grown.series.architecture) == (SERIES, "gpt2")
    assert grown.series.stacks == {"decoder": {"layers": 2, "heads": 2, "kv_heads": 2}}
    assert [(s, n) for s, n, _ in grown.steps] == [(step, f"{SERIES}-step-{step}") for step in STRENGTHS]
    assert all(source.endswith(f"step-{s}") for s, _, source in grown.steps)
    assert again == first
    assert {key: added[key] - again[key] for key in added} == {"models": 1, "features": 1, "detections": 1,
                                                               "jobs": 2}  # fmt: skip
    assert set(grown.newest_jobs) == {f"{SERIES}-step-{ELEVENTH[0]}"}


def _stored_runs(engine: Engine) -> list[Any]:
    with Session(engine) as session:
        return session.execute(text(
            "SELECT m.step, r.sequences, r.config FROM models m JOIN detection_runs r ON r.model_id = m.id "
            "WHERE m.series_id IS NOT NULL AND r.status = 'complete' ORDER BY m.step"
        )).all()  # fmt: skip


@pytest.mark.slow
def test_every_stored_score_at_every_step_is_plain_loops_over_eager_attentions(grown: Grown) -> None:
    strengths = dict([*STRENGTHS.items(), ELEVENTH])
    with Session(grown.engine) as session:
        rows = session.execute(text("SELECT * FROM head_trajectories WHERE series = :s"), {"s": SERIES}).all()
    stored = {(r.step, r.layer, r.head): r for r in rows}
    runs = _stored_runs(grown.engine)
    assert [run.step for run in runs] == sorted({r.step for r in rows})
    for run in runs:
        model = build_induction_checkpoint(*strengths[run.step])
        sums: dict[tuple[int, int], np.ndarray] = {}
        sequences = run.sequences["sequences"]
        length = len(sequences[0])  # the start and end tokens' positions, as SPEC 10 leaves them out
        special = set(range(len(run.sequences["prefix"]))) | set(range(length - len(run.sequences["suffix"]), length))
        for ids in sequences:
            with torch.no_grad():
                attentions = model(torch.tensor([ids]), output_attentions=True).attentions
            for layer, maps in enumerate(attentions):
                for head, a in enumerate(maps[0].tolist()):
                    scores = reference_scores(a, ids, special, cross=False)
                    sums[layer, head] = sums.get((layer, head), 0) + np.array([scores[name] for name in ROLES])
        for (layer, head), total in sums.items():
            row = stored[run.step, layer, head]
            expected = total / len(sequences)
            assert [getattr(row, name) for name in ROLES] == pytest.approx(expected.tolist(), abs=1e-5)
            thresholds = run.config["thresholds"]
            assert list(row.roles) == [n for n, v in zip(ROLES, expected, strict=True) if v >= thresholds[n]]
    # the circuit grows as it was built to: the previous-token head forms first, the induction head later
    assert stored[0, *PREVIOUS_TOKEN_HEAD].previous_token < 0.4 < stored[300, *PREVIOUS_TOKEN_HEAD].previous_token
    assert stored[200, *INDUCTION_HEAD].induction > 0.4 > stored[300, *INDUCTION_HEAD].induction
    assert stored[1000, *INDUCTION_HEAD].induction == pytest.approx(0.5, abs=1e-3)


def _formation(values: list[tuple[int, float | None]], threshold: float) -> int | None:
    """SPEC 11 read literally: the smallest step s with the score >= threshold at s and at every later step."""
    for s, _ in values:
        if all(v is not None and v >= threshold for step, v in values if step >= s):
            return s
    return None


@pytest.mark.slow
def test_formation_steps_are_a_recomputation_from_the_stored_scores(grown: Grown, client_on: TestClient) -> None:
    with Session(grown.engine) as session:
        rows = session.execute(text("SELECT * FROM head_trajectories WHERE series = :s ORDER BY step"),
                               {"s": SERIES}).all()  # fmt: skip
    thresholds = _stored_runs(grown.engine)[0].config["thresholds"]
    found: dict[str, dict[tuple[int, int], int | None]] = {}
    for role in ROLES:
        answer = client_on.get(f"/series/{SERIES}/heads", params={"score": role})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["steps"] == sorted({r.step for r in rows})
        for item in body["items"]:
            values = [(r.step, getattr(r, role)) for r in rows if (r.layer, r.head) == (item["layer"], item["head"])]
            assert [(p["step"], p["value"]) for p in item["values"]] == values
            assert item["formed_at"][role] == _formation(values, thresholds[role])
            found.setdefault(role, {})[item["layer"], item["head"]] = item["formed_at"][role]
    assert found["previous_token"][PREVIOUS_TOKEN_HEAD] == 100  # a third of its strength: 0.996
    assert found["induction"][INDUCTION_HEAD] is not None
    assert found["induction"][INDUCTION_HEAD] > 200  # the flash at step 200 faded: it is not a formation
    ordered = client_on.get(f"/series/{SERIES}/heads", params={"score": "induction", "order": "formed_at"}).json()
    formed = [item["formed_at"]["induction"] for item in ordered["items"]]
    known = [step for step in formed if step is not None]
    assert formed == known + [None] * (len(formed) - len(known))
    assert known == sorted(known)
    one = client_on.get(f"/series/{SERIES}/heads", params={"layer": 1, "head": 0, "score": "induction"}).json()
    assert [(i["layer"], i["head"]) for i in one["items"]] == [INDUCTION_HEAD]


@pytest.fixture
def client_on(grown: Grown) -> Iterator[TestClient]:
    """The API on the committed catalog the series lives in."""
    from service.app import create_app

    with TestClient(create_app(grown.engine)) as client:
        yield client


@pytest.mark.slow
def test_the_series_reads(grown: Grown, client_on: TestClient) -> None:
    listed = client_on.get("/series").json()
    assert [(s["name"], s["steps"], s["first_step"], s["last_step"]) for s in listed] == [(SERIES, 11, 0, 1000)]
    detail = client_on.get(f"/series/{SERIES}").json()
    assert [item["step"] for item in detail["items"]] == [*STRENGTHS, ELEVENTH[0]]
    with Session(grown.engine) as session:
        gains = dict(session.execute(text("SELECT m.step, r.repeat_gain FROM models m JOIN detection_runs r "
                                          "ON r.model_id = m.id WHERE m.series_id IS NOT NULL")).all())  # fmt: skip
    assert {item["step"]: item["detection_run"]["repeat_gain"] for item in detail["items"]} == gains
    assert all(item["feature_run"] is not None and item["requested_revision"] is None for item in detail["items"])
    pruned = client_on.get(f"/models/{SERIES}-step-1000/export", params={"role": "induction", "format": "prune_heads"})
    assert pruned.json() == {str(INDUCTION_HEAD[0]): [INDUCTION_HEAD[1]]}  # any step's model exports
    at = client_on.get("/heads", params={"series": SERIES, "step": 700}).json()["items"]
    named = client_on.get("/heads", params={"model": f"{SERIES}-step-700"}).json()["items"]
    assert at == named
    assert len(at) == 4
    assert {item["model"] for item in client_on.get("/heads", params={"series": SERIES, "limit": 1000})
            .json()["items"]} == {item["model"] for item in detail["items"]}  # fmt: skip
    for params, status, field in (
        ({"series": "nosuch"}, 404, "series"),
        ({"series": SERIES, "step": 5}, 404, "step"),
        ({"step": 100}, 422, "step"),
    ):
        answer = client_on.get("/heads", params=params)
        assert (answer.status_code, answer.json()["field"]) == (status, field), answer.text
    for path, params, status, field in (
        (f"/series/{SERIES}/heads", {"score": "copying"}, 422, "score"),
        (f"/series/{SERIES}/heads", {"order": "step"}, 422, "order"),
        (f"/series/{SERIES}/heads", {"score": "entropy", "order": "formed_at"}, 422, "order"),
        (f"/series/{SERIES}/heads", {"layer": 7}, 422, "layer"),
        (f"/series/{SERIES}/heads", {"lyer": 1}, 422, "lyer"),
        ("/series/nosuch", {}, 404, "name"),
    ):
        answer = client_on.get(path, params=params)
        assert (answer.status_code, answer.json().get("field")) == (status, field), answer.text


@pytest.mark.slow
def test_a_step_of_another_architecture_or_tokenizer_is_refused(
    grown: Grown, committed_database_url: str, tiny_bert_path: Path, tmp_path: Path
) -> None:
    from tests.ingest.test_architectures import tokenizer

    before = counts(grown.engine)
    other = tmp_path / "other-tokenizer"
    build_induction_checkpoint(1.0, 1.0).save_pretrained(other)
    tokenizer(None, type_ids=True).save_pretrained(other)
    for source, says in ((tiny_bert_path, "architecture 'bert', not 'gpt2'"), (other, "another tokenizer")):
        done = headcat(committed_database_url, "ingest", str(source), "--series", SERIES, "--step", "2000",
                       "--samples", "4", "--device", "cpu")  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "series:" in done.stderr
        assert says in done.stderr.replace("\n", "")
    after = counts(grown.engine)
    assert (after["models"], after["features"]) == (before["models"], before["features"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "field", "says"),
    [
        (
            ["some-org/some-model", "--revision", "step5000", "--series", SERIES],
            "revision",
            "not in the local Hugging Face cache",
        ),
        (["{dir}/step-100", "--revision", "step1000", "--name", "x"], "revision", "is a local directory"),
        (["{dir}", "--name", "x"], "series", "name their series with --series"),
        (["{dir}", "--series", SERIES, "--step", "5"], "step", "--step names one checkpoint"),
        (["{dir}/step-100", "--name", "x", "--step", "5"], "series", "needs both --series and --step"),
        (
            ["{dir}/step-100", "--series", SERIES, "--step", "100", "--name", "other"],
            "step",
            "is already 'grow-step-100'",
        ),
        (["{dir}/step-100", "--name", "x", "--detect"], "detect", "give --series"),
    ],
)
def test_bad_series_requests_exit_2_naming_the_field(
    grown: Grown, committed_database_url: str, series_directory: Path, arguments: list[str], field: str, says: str
) -> None:
    before = counts(grown.engine)
    done = headcat(committed_database_url, "ingest", *[a.format(dir=series_directory) for a in arguments],
                   "--samples", "4", "--device", "cpu")  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.replace("\n", "")
    assert f"error: {field}:" in line
    assert says in line
    assert counts(grown.engine) == before


def test_formation_step_reads_the_last_steps() -> None:
    from ingest.series import formation_step

    assert formation_step([], []) is None
    assert formation_step([1, 2, 3], [True, True, True]) == 1
    assert formation_step([1, 2, 3], [True, False, True]) == 3
    assert formation_step([1, 2, 3], [True, True, False]) is None
    assert formation_step([5], [True]) == 5
    with pytest.raises(ValueError, match="2 steps but 1 role flags"):
        formation_step([1, 2], [True])
