"""``bench/fused_cpu.py`` runs as its docs run it: its check against the eager maps passes, then every variant is
timed against SDPA at the block size asked for."""

from __future__ import annotations

import re

import pytest

from bench import fused_cpu
from ingest import fused

pytestmark = pytest.mark.skipif(fused.unavailable() is not None, reason="no compiler for the fused kernel")


def test_the_benchmark_checks_the_kernel_and_times_every_variant(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("BLOCK_BYTES", "MIN_BLOCK_ROWS"):  # --rows sets them: put back after the test
        monkeypatch.setattr(fused, name, getattr(fused, name))
    fused_cpu.main(["--lengths", "300", "--rows", "7", "--repeats", "1"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"  300 tokens, blocks of 7 rows: sdpa [0-9.]+ s; output [0-9.]+x, stats [0-9.]+x, "
                        r"example [0-9.]+x", line), line  # fmt: skip
