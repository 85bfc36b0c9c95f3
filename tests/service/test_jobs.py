"""Jobs through the real queue: REST submits, a real worker process runs them, results are served."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from service.orm import FeatureRun, Job
from tests.conftest import grant_key
from tests.service.conftest import TINY, ingest_request
from tests.service.workers import Workers, finished, long_corpus, wait_for

pytestmark = pytest.mark.slow

WorkerFactory = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def api(committed_database_url: str) -> Iterator[TestClient]:
    engine = create_engine(committed_database_url)
    key = grant_key(sessionmaker(bind=engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client
    engine.dispose()


@pytest.fixture(scope="module")
def dup(committed_database_url: str, tiny_bert_path: Path) -> str:
    """A second tiny model, ingested in-process (no worker), for requests that need one."""
    engine = create_engine(committed_database_url)
    run_inline(sessionmaker(bind=engine), "ingest", ingest_request(tiny_bert_path, name="dup", samples=8))
    engine.dispose()
    return "dup"


@pytest.fixture
def start_worker(committed_database_url: str, tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start ``headcat worker`` processes on the module's database; all are stopped afterwards."""
    workers = Workers(committed_database_url, tmp_path)
    yield workers.start
    workers.stop()


def test_rest_submits_a_worker_runs_and_the_results_are_served(
    api: TestClient, start_worker: WorkerFactory, tiny_bert_path: Path
) -> None:
    start_worker("--queues", "gpu,cpu")
    accepted = api.post("/ingests", json=ingest_request(tiny_bert_path))
    assert accepted.status_code == 202, accepted.text
    job = wait_for(api, accepted.json()["job_id"], finished)
    assert job["kind"] == "ingest"
    assert job["queue"] == "gpu"
    assert job["progress_done"] == job["progress_total"] == 48
    assert job["seconds"] > 0
    assert api.get("/heads", params={"model": TINY}).json()["total"] == 8

    accepted = api.post("/clusterings", json={"models": [TINY], "k": 4, "seed": 0})
    assert accepted.status_code == 202, accepted.text
    clustering_id = wait_for(api, accepted.json()["job_id"], finished)["result"]["clustering_id"]
    clustering = api.get(f"/clusterings/{clustering_id}").json()
    assert clustering["current_for"] == [TINY]
    assert len(clustering["clusters"]) == 4
    assert sum(c["share"] for c in clustering["clusters"]) == pytest.approx(1.0)
    assert len(clustering["tsne"]) == 8
    assert sum(sum(layer.values()) for layer in clustering["models"][0]["layers"]) == 8
    assert {h["type"] for h in api.get("/heads", params={"model": TINY}).json()["items"]} <= {
        c["name"] for c in clustering["clusters"]
    }

    accepted = api.post(f"/clusterings/{clustering_id}/stability", json={"n_runs": 5, "fraction": 0.75})
    assert accepted.status_code == 202, accepted.text
    run_id = wait_for(api, accepted.json()["job_id"], finished)["result"]["stability_run_id"]
    run = api.get(f"/stability-runs/{run_id}").json()
    assert run["n_runs"] == 5
    assert run["fraction"] == 0.75
    assert len(run["seeds"]) == 5
    assert len(run["heads"]) == 8
    assert run["score"] == pytest.approx(sum(h["stable"] for h in run["heads"]) / 8)
    assert api.get(f"/clusterings/{clustering_id}").json()["stability"][0]["id"] == run_id


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/clusterings", {"models": ["nope"]}, "models"),
        ("/clusterings", {"models": []}, "models"),
        ("/clusterings", {"models": ["dup"], "k": 1}, "k"),
        ("/clusterings", {"models": ["dup"], "k": 9}, "k"),
        ("/clusterings", {"models": ["dup"], "algorithm": "dbscan"}, "algorithm"),
        ("/clusterings/999999/stability", {}, "clustering"),
        ("/ingests", {"model": "/no/such/dir", "name": "x"}, "model"),
        ("/ingests", {"model": "m", "name": "bad name!"}, "name"),
        ("/ingests", {"model": "m", "name": "x", "corpus": "/no/such.jsonl"}, "corpus"),
        ("/ingests", {"model": "m", "name": "x", "samples": 0}, "samples"),
    ],
)
def test_invalid_requests_are_4xx_naming_the_field_and_queue_nothing(
    api: TestClient, committed_database_url: str, dup: str, path: str, body: dict[str, Any], field: str
) -> None:
    engine = create_engine(committed_database_url)
    with engine.connect() as connection:
        before = connection.scalar(select(func.count()).select_from(Job))
        answer = api.post(path, json=body)
        assert 400 <= answer.status_code < 500, answer.text
        assert field in answer.text
        assert connection.scalar(select(func.count()).select_from(Job)) == before
    engine.dispose()


def test_an_identical_request_while_queued_returns_the_same_job(api: TestClient, dup: str) -> None:
    body = {"models": ["dup"], "k": 3, "seed": 7}  # no worker listens on "cpu" in this test: it stays queued
    first = api.post("/clusterings", json=body).json()
    second = api.post("/clusterings", json=body).json()
    assert first["duplicate"] is False
    assert second["duplicate"] is True
    assert second["job_id"] == first["job_id"]
    other = api.post("/clusterings", json={**body, "seed": 8}).json()
    assert other["job_id"] != first["job_id"]


def test_a_killed_worker_leaves_nothing_that_looks_finished_and_the_job_is_retried(
    api: TestClient, start_worker: WorkerFactory, tiny_bert_path: Path, tmp_path: Path, committed_database_url: str
) -> None:
    corpus = long_corpus(tmp_path / "long.txt", 3000)
    request = ingest_request(tiny_bert_path, name="killed", corpus=str(corpus), samples=3000, batch_size=4)
    job_id = api.post("/ingests", json=request).json()["job_id"]
    first = start_worker("--queues", "gpu")
    wait_for(api, job_id, lambda job: (job["progress_done"] or 0) > 0)
    first.send_signal(signal.SIGKILL)
    first.wait()

    engine = create_engine(committed_database_url)
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(FeatureRun).join(FeatureRun.model)
                                 .where(FeatureRun.model.has(name="killed"))) == 0  # fmt: skip
    engine.dispose()
    assert api.get(f"/jobs/{job_id}").json()["status"] == "running"
    assert api.get("/models").status_code == 200
    assert api.get("/heads", params={"model": "killed"}).status_code == 404

    start_worker("--queues", "gpu", "--stalled-after", "2")
    job = wait_for(api, job_id, finished)
    assert job["attempts"] == 2
    assert api.get("/heads", params={"model": "killed"}).json()["total"] == 8
