"""What the CLI prints does not depend on the terminal: piped, a table is neither cut ("…") nor wrapped; the
help texts show no raw reStructuredText and say what the commands take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from typer.testing import CliRunner

from service.cli import app
from service.jobs import repository
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    import typer.main

    found: list[list[str]] = []

    def walk(command: object, path: list[str]) -> None:
        subcommands = getattr(command, "commands", None)
        if subcommands is None:
            found.append(path)
            return
        for name, sub in subcommands.items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


@pytest.mark.parametrize("command", _commands(), ids=" ".join)
def test_a_help_text_shows_no_raw_rst(command: list[str]) -> None:
    shown = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "``" not in shown.output


def test_ingest_help_says_it_takes_encoders_decoders_and_both() -> None:
    shown = " ".join(CliRunner().invoke(app, ["ingest", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "encoder, decoder or both" in shown


def test_piped_jobs_table_keeps_a_long_error_whole_on_one_line(
    catalog_engine: Engine, committed_database_url: str
) -> None:
    error = "model: " + " ".join(f"word{i}" for i in range(60)) + " /a/very/long/path/" + "x" * 80 + "/the-end"
    with sessionmaker(bind=catalog_engine).begin() as session:
        job, _ = repository.submit(session, "ingest", "gpu", {"piped": "output"}, enqueue=False)
        repository.fail(session, job.id, error)
        job_id = job.id
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    env["DATABASE_URL"] = committed_database_url
    done = subprocess.run([sys.executable, "-m", "service.cli", "jobs", str(job_id)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if f" {job_id} " in line]
    assert len(rows) == 1, done.stdout  # one line: not wrapped one word a line
    assert error in rows[0]  # whole: not cut with "…"
    assert "…" not in done.stdout
