"""A series' jobs over REST: ``POST /series/{name}/detections`` queues one detection per step still to detect (the
steps whose current run asked the same sequences are skipped), and ``POST /clusterings`` with ``series`` clusters
every step jointly; what each refuses, before anything is queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from service.orm import Clustering, Job, clustering_feature_runs
from tests.induction_model import save_induction_series
from tests.service.conftest import ingest_request

SERIES = "jobs"
STEPS = {0: (0.0, 0.0), 100: (0.5, 0.0), 1000: (1.0, 1.0)}
SETTINGS = {"sequences": 4, "length": 10, "seed": 1, "corpus": None, "device": "cpu"}


def step_name(step: int) -> str:
    return f"{SERIES}-step-{step}"


@pytest.fixture(scope="module")
def series_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_induction_series(tmp_path_factory.mktemp("series-jobs"), STEPS)


@pytest.fixture
def series(sessions: sessionmaker[Session], series_directory: Path) -> str:
    for step in STEPS:
        request = ingest_request(series_directory / f"step-{step}", step_name(step), samples=4, max_length=32,
                                 series=SERIES, step=step)  # fmt: skip
        assert run_inline(sessions, "ingest", request).status == "succeeded"
    return SERIES


def queued_detections(sessions: sessionmaker[Session]) -> list[dict[str, Any]]:
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.kind == "detection", Job.status == "queued").order_by(Job.id))
        return [job.request for job in jobs]


def test_one_detection_job_per_step_in_step_order_and_a_detected_step_skipped(
    client: TestClient, sessions: sessionmaker[Session], series: str
) -> None:
    answer = client.post(f"/series/{series}/detections", json=SETTINGS)
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert [(job["step"], job["model"]) for job in body["jobs"]] == [(s, step_name(s)) for s in STEPS]
    assert body["skipped"] == []
    assert all(job["job"]["duplicate"] is False for job in body["jobs"])
    queued = queued_detections(sessions)
    assert [request["model"] for request in queued] == [step_name(s) for s in STEPS]
    assert all({key: request[key] for key in SETTINGS} == SETTINGS for request in queued)

    # step 100 detected with these sequences (as its queued job would): asking again skips it, and hands back
    # the jobs still queued for the other steps instead of queuing them twice
    done = run_inline(sessions, "detection", {**SETTINGS, "model": step_name(100)})
    assert done.status == "succeeded", done.error
    again = client.post(f"/series/{series}/detections", json=SETTINGS).json()
    assert [job["step"] for job in again["jobs"]] == [0, 1000]
    assert all(job["job"]["duplicate"] is True for job in again["jobs"])
    assert again["skipped"] == [
        {"step": 100, "model": step_name(100), "detection_run": done.result["detection_run_id"]}
    ]

    # other sequences are another request: every step is queued for them, the detected one too
    other = client.post(f"/series/{series}/detections", json={**SETTINGS, "seed": 2}).json()
    assert [job["step"] for job in other["jobs"]] == list(STEPS)
    assert other["skipped"] == []


@pytest.mark.parametrize(
    ("name", "body", "status", "field"),
    [
        ("nope", SETTINGS, 404, "series"),
        (SERIES, {**SETTINGS, "model": step_name(0)}, 422, "model"),  # every step's: a model is not asked for
        (SERIES, {**SETTINGS, "copies": 1}, 422, "copies"),
        (SERIES, {**SETTINGS, "length": 100_000}, 422, "length"),  # beyond what the model's positions hold
    ],
)
def test_a_bad_series_detection_queues_nothing_and_names_the_field(
    client: TestClient, sessions: sessionmaker[Session], series: str, name: str, body: dict[str, Any], status: int,
    field: str,
) -> None:  # fmt: skip
    answer = client.post(f"/series/{name}/detections", json=body)
    assert (answer.status_code, answer.json()["field"]) == (status, field), answer.text
    assert queued_detections(sessions) == []


def test_a_clustering_of_a_series_fits_every_step_jointly(
    client: TestClient, sessions: sessionmaker[Session], series: str
) -> None:
    answer = client.post("/clusterings", json={"series": series, "k": 2})
    assert answer.status_code == 202, answer.text
    job = run_inline(sessions, "clustering", {"series": series, "models": [step_name(0)], "k": 2})
    assert job.status == "succeeded", job.error
    with sessions() as session:
        clustered = session.scalars(
            select(clustering_feature_runs.c.feature_run_id).where(
                clustering_feature_runs.c.clustering_id == job.result["clustering_id"]
            )
        ).all()
        assert len(clustered) == len(STEPS)  # one feature run per step; the model named is a step: clustered once
        assert session.scalar(select(func.count()).select_from(Clustering)) == 1
    missing = client.post("/clusterings", json={"series": "nope", "k": 2})
    assert (missing.status_code, missing.json()["field"]) == (404, "series"), missing.text
