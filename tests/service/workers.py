"""Real ``headcat worker`` processes for the job tests, and waiting on jobs over REST."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


class Workers:
    """``headcat worker`` processes on one database, each logging to a file; :meth:`stop` ends them all."""

    def __init__(self, database_url: str, log_dir: Path) -> None:
        self.database_url, self.log_dir = database_url, log_dir
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"worker-{len(self.processes)}.log").open("wb")
        env = {**os.environ, "DATABASE_URL": self.database_url, "HF_HUB_OFFLINE": "1"}
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", *args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def stop(self, grace: float = 30) -> None:
        """SIGTERM each, then SIGKILL the ones still running after ``grace`` seconds (teardown: nothing is asserted)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    process.kill()


def wait_for(api: TestClient, job_id: int, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll ``GET /jobs/{id}`` until ``until(job)``; answers other than 200 (a 503 during an outage) are waited
    out, a failed job fails the test at once, and only a hang (:data:`tests.waiting.PATIENCE`) times out."""
    job: dict[str, Any] = {}

    def there() -> bool:
        nonlocal job
        answer = api.get(f"/jobs/{job_id}")
        if answer.status_code != 200:
            return False
        job = answer.json()
        if job["status"] == "failed" and not until(job):
            pytest.fail(f"job {job_id} failed: {job['error']}")
        return bool(until(job))

    wait_until(there, lambda: f"job {job_id} (last seen: {job})")
    return job


def finished(job: dict[str, Any]) -> bool:
    return bool(job["status"] == "succeeded")


def long_corpus(path: Path, lines: int) -> Path:
    """A plain-text corpus long enough for a job to be caught halfway."""
    path.write_text("".join(f"Line {i} of a long corpus, with words enough to matter.\n" for i in range(lines)))
    return path
