"""SIGTERM and SIGINT stop real ``headcat serve``, ``worker`` and ``quickstart`` processes cleanly: every process
they started ends (the API, the job worker, the embedded PostgreSQL), the log says so, and a job running at that
moment is released for another worker (a worker's) or marked failed, saying why (the CLI's own)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from tests.conftest import grant_key
from tests.service.conftest import ingest_request
from tests.service.workers import Workers, finished, long_corpus, wait_for
from tests.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SIGNALS = [signal.SIGTERM, signal.SIGINT]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int) -> dict[str, object] | None:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=PATIENCE)
    except httpx.ConnectError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _headcat(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen([sys.executable, "-m", "service.cli", *args], env=env, cwd=ROOT, stdout=output,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process it started (recursively), as they are now."""
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_serve_stops_its_api_its_worker_and_the_embedded_postgres_on_a_signal(
    signum: signal.Signals, embedded_data_dir: Path, tmp_path: Path
) -> None:
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    env.update(HEADCAT_DATA_DIR=str(embedded_data_dir), PYTHONPATH=str(ROOT))
    port, log = _free_port(), tmp_path / "serve.log"
    server = _headcat(["serve", "--port", str(port)], env, log)
    try:
        wait_until(lambda: (_health(port) or {}).get("workers") == 1, lambda: f"serve's worker:\n{log.read_text()}")
        pgdata = embedded_data_dir / "pgdata"
        postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
        started = [*_family(server.pid), postmaster, *postmaster.children(recursive=True)]
        assert any("worker" in " ".join(p.cmdline()) for p in started[1:]), started
        server.send_signal(signum)
        assert server.wait(timeout=PATIENCE) == 0, log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
    psutil.wait_procs([p for p in started if p.pid != server.pid], timeout=PATIENCE)
    assert _alive(started) == [], log.read_text()
    assert not (pgdata / "postmaster.pid").exists()
    said = log.read_text()
    for line in ("The API has stopped", "The job worker (pid", "has stopped", "Stopped the embedded PostgreSQL"):
        assert line in said, said
    assert "Traceback" not in said


@pytest.fixture(scope="module")
def api(committed_database_url: str) -> Iterator[TestClient]:
    engine = create_engine(committed_database_url)
    key = grant_key(sessionmaker(bind=engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client
    engine.dispose()


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_stopped_worker_releases_its_running_job_for_the_next_worker(
    signum: signal.Signals, api: TestClient, committed_database_url: str, tiny_bert_path: Path, tmp_path: Path
) -> None:
    corpus = long_corpus(tmp_path / "long.txt", 600)
    name = f"released-{signum.name.lower()}"
    request = ingest_request(tiny_bert_path, name=name, corpus=str(corpus), samples=600, batch_size=4)
    job_id = api.post("/ingests", json=request).json()["job_id"]
    workers = Workers(committed_database_url, tmp_path)
    try:
        first = workers.start("--queues", "gpu")
        wait_for(api, job_id, lambda job: (job["progress_done"] or 0) > 0)
        family = _family(first.pid)
        first.send_signal(signum)
        assert first.wait(timeout=PATIENCE) == 0
        assert _alive(family) == []
        said = (tmp_path / "worker-0.log").read_text()
        assert f"Job {job_id} released" in said, said
        assert f"The worker has stopped ({signum.name})" in said, said
        assert "Traceback" not in said, said
        job = api.get(f"/jobs/{job_id}").json()
        assert (job["status"], job["attempts"]) == ("queued", 1), job
        engine = create_engine(committed_database_url)
        with engine.connect() as connection:
            queued = connection.execute(
                text(
                    "SELECT p.status FROM procrastinate_jobs p JOIN jobs j "
                    "ON j.procrastinate_job_id = p.id WHERE j.id = :i"
                ),
                {"i": job_id},
            )
            assert queued.scalar_one() == "todo"  # retried at once, not left for the stall check
            runs = connection.execute(text("SELECT count(*) FROM feature_runs r JOIN models m ON m.id = r.model_id "
                                           "WHERE m.name = :n"), {"n": name})  # fmt: skip
            assert runs.scalar_one() == 0
        engine.dispose()
        workers.start("--queues", "gpu")
        job = wait_for(api, job_id, finished)
        assert job["attempts"] == 2
    finally:
        workers.stop()


def test_quickstart_stopped_while_it_ingests_fails_its_job_saying_so_and_leaves_nothing(
    committed_database_url: str, tmp_path: Path
) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "PYTHONPATH": str(ROOT),
           "HEADCAT_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    log = tmp_path / "quickstart.log"
    quickstart = _headcat(["quickstart", "--samples", "400", "--no-serve"], env, log)
    engine = create_engine(committed_database_url)

    def ingesting() -> bool:
        with engine.connect() as connection:
            query = text(
                "SELECT coalesce(max(progress_done), 0) FROM jobs WHERE kind = 'ingest' AND status = 'running'"
            )
            return bool(connection.execute(query).scalar_one() > 0)

    try:
        wait_until(lambda: ingesting() or quickstart.poll() is not None, lambda: log.read_text())
        family = _family(quickstart.pid)
        quickstart.send_signal(signal.SIGTERM)
        assert quickstart.wait(timeout=PATIENCE) != 0
    finally:
        if quickstart.poll() is None:
            quickstart.kill()
    assert _alive(family) == []
    with engine.connect() as connection:
        status, error = connection.execute(text("SELECT status, error FROM jobs WHERE kind = 'ingest' "
                                                "ORDER BY id DESC LIMIT 1")).one()  # fmt: skip
        runs = connection.execute(text("SELECT count(*) FROM feature_runs r JOIN models m ON m.id = r.model_id "
                                       "WHERE m.name = 'minilm' AND r.status = 'complete'")).scalar_one()  # fmt: skip
    engine.dispose()
    assert (status, error) == ("failed", "stopped by SIGTERM before it finished; nothing of it was stored")
    assert runs == 0
    said = log.read_text()
    assert "Stopped by SIGTERM" in said, said
    assert "Traceback" not in said, said
