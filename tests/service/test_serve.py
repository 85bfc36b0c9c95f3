"""``headcat serve --workers N``: several API processes behind one port, with pools the server can take."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": url, **extra}


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
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError("the workers never answered")
        workers = [pid for pid in _children(server.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2
        with httpx.Client(base_url=base, timeout=10) as client:
            for _ in range(10):
                page = client.get("/heads", params={"architecture": "bert"})
                assert page.status_code == 200, page.text
                assert page.json()["items"] == []
            assert client.get("/heads", params={"layer_gte": 3}).json()["field"] == "layer_gte"
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_more_workers_than_the_server_has_connections_for_exit_2_before_serving(committed_database_url: str) -> None:
    command = [sys.executable, "-m", "service.cli", "serve", "--workers", "64", "--port", str(_free_port())]
    env = _env(committed_database_url, HEADCAT_POOL_SIZE="50")
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "workers" in done.stdout + done.stderr
