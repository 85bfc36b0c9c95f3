"""``headcat serve --workers N``: several API processes behind one port, with pools the server can take."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from tests.conftest import grant_key
from tests.service.conftest import TINY
from tests.waiting import PATIENCE, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": url, **extra}


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 now (a server still starting refuses the connection)."""
    try:
        return httpx.get(url, timeout=PATIENCE).status_code == 200
    except httpx.ConnectError:
        return False


def _serve(url: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``headcat serve ARGS`` on ``url``'s database, its output in ``log``."""
    with log.open("wb") as output:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", "service.cli", "serve", *args], env=_env(url), cwd=ROOT,
                                stdout=output, stderr=subprocess.STDOUT)  # fmt: skip


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_workers_share_one_port(committed_database_url: str) -> None:
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--workers", "2", "--port", str(port)],
                              env=_env(committed_database_url), cwd=ROOT)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{base}/health"), "the API processes answering /health")
        workers = [pid for pid in _children(server.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2
        with httpx.Client(base_url=base, timeout=PATIENCE) as client:
            for _ in range(10):
                page = client.get("/heads", params={"architecture": "bert"})
                assert page.status_code == 200, page.text
                assert page.json()["items"] == []
            assert client.get("/heads", params={"layer_gte": 3}).json()["field"] == "layer_gte"
    finally:
        server.terminate()
        server.wait(timeout=PATIENCE)


def test_more_workers_than_the_server_has_connections_for_exit_2_before_serving(committed_database_url: str) -> None:
    command = [sys.executable, "-m", "service.cli", "serve", "--workers", "64", "--port", str(_free_port())]
    env = _env(committed_database_url, HEADCAT_POOL_SIZE="50")
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "workers" in done.stdout + done.stderr


def test_serve_runs_a_job_worker_so_a_rest_write_runs_with_no_other_command(
    catalog_engine: Engine, committed_database_url: str, tmp_path: Path
) -> None:
    """`headcat serve` alone: a REST re-clustering reaches `succeeded`, /health counts the worker, and the
    worker stops with the server."""
    key = grant_key(sessionmaker(bind=catalog_engine))
    port = _free_port()
    server = _serve(committed_database_url, tmp_path / "serve.log", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=PATIENCE, headers={"Authorization": f"Bearer {key}"}) as client:
            wait_until(lambda: _answers(f"{base}/health"), "the API answering /health")
            accepted = client.post("/clusterings", json={"models": [TINY], "k": 3, "seed": 5})
            assert accepted.status_code == 202, accepted.text
            job_id = accepted.json()["job_id"]
            wait_until(lambda: client.get(f"/jobs/{job_id}").json()["status"] in ("succeeded", "failed"),
                       lambda: f"job {job_id}: {client.get(f'/jobs/{job_id}').json()}")  # fmt: skip
            job = client.get(f"/jobs/{job_id}").json()
            assert job["status"] == "succeeded", (job, (tmp_path / "serve.log").read_text()[-3000:])
            assert client.get(f"/clusterings/{job['result']['clustering_id']}").status_code == 200
            wait_until(lambda: client.get("/health").json()["workers"] == 1, "/health counting the worker")
        workers = [pid for pid in _children(server.pid) if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C
        server.wait(timeout=PATIENCE)
    assert not Path(f"/proc/{workers[0]}").exists() or b"zombie" in Path(f"/proc/{workers[0]}/status").read_bytes()


def test_serve_no_worker_starts_none(committed_database_url: str, tmp_path: Path) -> None:
    port = _free_port()
    server = _serve(committed_database_url, tmp_path / "serve.log", "--no-worker", "--port", str(port))
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), "the API answering /health")
        assert _children(server.pid) == []
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=PATIENCE)
    assert "--no-worker" in (tmp_path / "serve.log").read_text()
