"""Progress without a terminal: log lines at a steady pace, nothing before the first real progress,
no library progress bars (``Loading weights``) and no empty ``0/?`` bar when a job fails."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from service.jobs.progress import SteadyLog, reporter
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_steady_log_writes_at_most_every_interval_and_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("test.progress")
    steady = SteadyLog("samples", 10.0, logger=logger, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for second, done in [(0, 10), (4, 20), (9.9, 30), (10, 40), (15, 50), (20.5, 60), (21, 100), (30, 100)]:
            clock.now = 100.0 + second
            steady(done, 100)
    lines = [record.getMessage() for record in caplog.records]
    # Nothing at the first report (it starts the clock); then at 10 s, 20.5 s and the end, once.
    assert lines == [
        "samples 40/100 (40 %), 3.0/s, about 20 s left",  # 30 done in 10 s after the first report
        "samples 60/100 (60 %), 2.4/s, about 16 s left",
        "samples 100/100 (100 %), 4.3/s",
    ]


def test_no_terminal_gives_log_lines_and_nothing_before_progress(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=False)
    with caplog.at_level(logging.INFO, logger="headcat"), reporter("samples", console, interval=1e-9) as update:
        pass  # the work failed before any progress
    assert stream.getvalue() == ""
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="headcat"), reporter("samples", console, interval=1e-9) as update:
        update(16, 48)
        update(32, 48)
        update(48, 48)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["samples 32/48 (67 %)", "samples 48/48 (100 %)"]
    assert stream.getvalue() == ""  # no bar rendered into a file


def test_terminal_bar_appears_only_with_progress() -> None:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=100)
    with reporter("samples", console):
        pass
    assert stream.getvalue() == ""  # a failure before any progress leaves no "samples 0/?" bar
    with reporter("samples", console) as update:
        update(48, 48)
    assert "48/48" in stream.getvalue()


def headcat_ingest(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "HEADCAT_PROGRESS_INTERVAL": "0.001", "COLUMNS": "200"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    return subprocess.run([sys.executable, "-m", "service.cli", "ingest", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip


@pytest.mark.slow
def test_ingest_into_a_pipe_logs_progress_and_no_library_bars(
    committed_database_url: str, tiny_bert_path: Path, tmp_path: Path
) -> None:
    done = headcat_ingest(committed_database_url, str(tiny_bert_path), "--name", "piped", "--samples", "48",
                          "--batch-size", "16", "--max-length", "32", "--device", "cpu")  # fmt: skip
    assert done.returncode == 0, done.stderr
    progress = re.findall(r"samples (\d+)/48", done.stderr)
    assert progress == ["32", "48"]  # every batch after the first, at this tiny interval
    assert "Loading weights" not in done.stderr
    assert "0/?" not in done.stderr

    broken = tmp_path / "config-only"  # passes the cheap checks, fails while loading
    broken.mkdir()
    (broken / "config.json").write_text((tiny_bert_path / "config.json").read_text())
    failed = headcat_ingest(committed_database_url, str(broken), "--name", "broken", "--device", "cpu")
    assert failed.returncode == 2, failed.stderr
    assert "error: model:" in " ".join(failed.stderr.split())
    assert "samples" not in failed.stderr
    assert "0/?" not in failed.stderr
    assert "Loading weights" not in failed.stderr
