"""The test fixtures clean up after themselves: a pytest run whose tests fail while embedded
PostgreSQL servers are up leaves no server data (about 40 MB each) in the temp directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[1]

FAILING_TESTS = """
from pathlib import Path

from sqlalchemy import create_engine, text

from service import db


def test_fails_on_the_session_database(database_url: str) -> None:
    with create_engine(database_url).connect() as connection:
        assert connection.scalar(text("select 1")) == 1
    raise AssertionError("fails on purpose, with the embedded session database up")


def test_fails_with_its_own_server_running(embedded_data_dir: Path) -> None:
    server = db.EmbeddedPostgres(embedded_data_dir / "pgdata")
    server.start()  # never stopped by the test: the fixture must
    assert (embedded_data_dir / "pgdata" / "PG_VERSION").is_file()
    raise AssertionError("fails on purpose, with a server of its own left running")
"""


def pg_data_dirs(root: Path) -> list[Path]:
    return sorted(found.parent for found in root.rglob("PG_VERSION"))


@pytest.mark.slow
def test_failing_tests_leave_no_postgres_data_in_the_temp_dir(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # the inner run's TMPDIR: its tempfile and pytest temp dirs land here
    scratch.mkdir()
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (suite / "test_failing.py").write_text(FAILING_TESTS)
    env = {key: value for key, value in os.environ.items() if key not in ("TEST_DATABASE_URL", "DATABASE_URL")}
    env.update(TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=PATIENCE,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # the two tests failed, nothing errored
    assert "2 failed" in done.stdout, done.stdout
    assert "on purpose" in done.stdout
    assert pg_data_dirs(scratch) == [], "embedded PostgreSQL data left behind"
    leftover = sum(f.stat().st_size for f in scratch.rglob("*") if f.is_file())
    assert leftover < 1 << 20, f"{leftover} bytes left in the temp dir"


TWICE = """
import sys

import pytest

args = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-m", "not slow", *sys.argv[1:]]
codes = [int(pytest.main(args)), int(pytest.main(args))]
print("exit codes", codes)
sys.exit(max(codes))
"""


@pytest.mark.slow
def test_the_catalog_archive_tests_pass_twice_in_one_process() -> None:
    """mutmut runs the tests in one process twice (its stats run, then its clean run) and forks every mutant's
    run from it: a fixture's database cached at module level outlives the session that dropped it, and the
    second session then fails on a database that does not exist (the importer's mutation run failed so)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    selected = ["tests/service/test_catalog_archive.py", "-k", "damaged and (invalid or unresolvable_run)"]
    done = subprocess.run([sys.executable, "-c", TWICE, *selected], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=PATIENCE)  # fmt: skip
    assert "exit codes [0, 0]" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
