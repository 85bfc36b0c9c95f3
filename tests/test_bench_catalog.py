"""``bench/catalog.py`` runs as its docs run it, at a small size: each round exports and imports the catalog it
filled (the copy's rows checked), the table reports every step with its ratio and range, and no database of the
bench's is left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]


def bench_databases(server: str) -> list[str]:
    engine = create_engine(server)
    try:
        with engine.connect() as connection:
            return list(
                connection.scalars(text("SELECT datname FROM pg_database WHERE datname LIKE 'headcat_catalog_%'"))
            )
    finally:
        engine.dispose()


def test_the_benchmark_exports_imports_and_reports_every_round(database_url: str) -> None:
    server = make_url(database_url).set(database="postgres").render_as_string(hide_password=False)
    before = bench_databases(server)
    done = subprocess.run(
        [sys.executable, "bench/catalog.py", "--server-url", server, "--heads", "600", "--heads", "1200",
         "--rounds", "2"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert len(re.findall(r"^  round [12]: export [0-9.]+x, import [0-9.]+x$", out, re.M)) == 4, out
    for step in ("headcat export", "headcat import (validate + write)", "  of which validate", "  of which write"):
        rows = [line for line in out.splitlines() if f"| {step} |" in line]
        assert len(rows) == 2, (step, out)  # one per size
        assert all(re.search(r"\| [0-9.]+x \([0-9.]+-[0-9.]+\) \|", row) for row in rows), rows
    assert re.search(r"highest peak RSS of the import, 1,200 against 600 heads: [0-9.]+x", out), out
    assert bench_databases(server) == before
