"""The end-of-run check (``tests/leftovers.py``): a session whose tests leave a process running fails, names
the process and kills it; one whose processes all ended passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[1]

# A test that passes but leaves a process behind: an orphan (its parent has exited), as a worker of a
# `headcat serve` killed without its clean-up is; only the session's mark in its environment finds it.
LEAVES_ONE = """
import subprocess
import sys
from pathlib import Path

ORPHAN = "import time; time.sleep(SECONDS)"


def test_passes_but_leaves_an_orphan_running() -> None:
    starter = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {!r}], "
               "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)").format(ORPHAN)
    pid = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, check=True).stdout
    Path("orphan.pid").write_text(pid)
"""

ENDS_ITS_OWN = """
import subprocess
import sys


def test_ends_the_process_it_starts() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    process.terminate()
    process.wait()
"""


def run_suite(tmp_path: Path, tests: str, patience_at_end: float | None = None) -> subprocess.CompletedProcess[str]:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.leftovers import *  # noqa: F403\n")
    (suite / "test_inner.py").write_text(tests)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("HEADCAT_TEST_PATIENCE_AT_END", None)
    if patience_at_end is not None:
        env["HEADCAT_TEST_PATIENCE_AT_END"] = str(patience_at_end)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=PATIENCE,
    )  # fmt: skip


def test_a_process_left_running_fails_the_session_is_named_and_killed(tmp_path: Path) -> None:
    done = run_suite(tmp_path, LEAVES_ONE.replace("SECONDS", "3600"), patience_at_end=1)
    pid = int((tmp_path / "suite" / "orphan.pid").read_text())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert "processes left running" in done.stdout
    assert f"pid {pid}: " in done.stdout
    assert "time.sleep(3600)" in done.stdout
    psutil.wait_procs([psutil.Process(pid)] if psutil.pid_exists(pid) else [], timeout=PATIENCE)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_session_whose_processes_all_ended_passes(tmp_path: Path) -> None:
    done = run_suite(tmp_path, ENDS_ITS_OWN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "processes left running" not in done.stdout


def test_a_process_still_ending_at_the_end_is_waited_for_not_named(tmp_path: Path) -> None:
    # an orphan that ends by itself a few seconds after the session: on a loaded machine a server stopped just
    # before the end does the same, and the default patience (two minutes) lets it go
    done = run_suite(tmp_path, LEAVES_ONE.replace("SECONDS", "3"))
    pid = int((tmp_path / "suite" / "orphan.pid").read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "processes left running" not in done.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
