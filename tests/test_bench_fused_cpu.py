"""``bench/fused_cpu.py`` runs as its docs run it: its check against the eager maps passes, then every variant is
timed against SDPA at the block and tile sizes asked for."""

from __future__ import annotations

import re

import pytest

from bench import fused_cpu
from ingest import fused

pytestmark = pytest.mark.skipif(fused.unavailable() is not None, reason="no compiler for the fused kernel")


def test_the_benchmark_checks_the_kernel_and_times_every_variant(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("BLOCK_BYTES", "MIN_BLOCK_ROWS", "TILE_KEYS"):  # --rows and --keys set them: put back after the test
        monkeypatch.setattr(fused, name, getattr(fused, name))
    fused_cpu.main(["--lengths", "300", "--rows", "7", "--keys", "16", "300", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()[-2:]
    for line, keys in zip(lines, (16, 300), strict=True):
        assert re.fullmatch(rf"  300 tokens, blocks of 7 rows, tiles of {keys} keys: sdpa [0-9.]+ s; "
                            r"output [0-9.]+x, stats [0-9.]+x, example [0-9.]+x, specials [0-9.]+x, cells [0-9.]+x",
                            line), line  # fmt: skip
    assert fused.TILE_KEYS is None  # the kernel's own choice again after each


def test_other_head_sizes_keep_the_shapes_floats_a_token_and_its_heads_a_key_value_head(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [fused_cpu.shape(d) for d in (32, 64, 128, 1)] == [(16, 4), (8, 2), (4, 1), (512, 128)]
    for dim in (48, 256, 0):  # 512 floats a token in groups of 4 heads: no such shape
        with pytest.raises(SystemExit):
            fused_cpu.main(["--dims", "64", str(dim)])
        assert f"--dims: heads of {dim} floats make no 512 floats a token" in capsys.readouterr().err
    q, k, v = fused_cpu.tensors(40, 32)
    assert q.shape == (1, 16, 40, 32)
    assert k.shape == v.shape == (1, 4, 40, 32)
    monkeypatch.setattr(fused, "TILE_KEYS", fused.TILE_KEYS)
    fused_cpu.main(["--lengths", "1000", "--dims", "32", "128", "--variants", "stats", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(", float32")[0] for line in lines[::2]] == [
        "one causal GQA call (16 query / 4 key-value heads of 32)",
        "one causal GQA call (4 query / 1 key-value heads of 128)",
    ]
    # 256 KiB of 1000 scores is 65 rows: above 2 x 32 (16 blocks of 63), below 128 (8 blocks of 125)
    for line, rows, keys in zip(lines[1::2], (63, 125), (1040, 524), strict=True):
        want = rf"  1000 tokens, blocks of {rows} rows, tiles of {keys} keys: sdpa [0-9.]+ s; stats [0-9.]+x"
        assert re.fullmatch(want, line), line


def test_the_special_keys_come_every_ten_tokens_cls_and_sep_in_turn() -> None:
    specials = fused_cpu.special_keys(25)
    assert specials.positions.tolist() == [[0, 10, 20]]
    assert specials.counts.tolist() == [3]
    assert specials.slot_sep.tolist() == [[False, True, False]]
    assert specials.query_sep[0].nonzero().flatten().tolist() == [10]


def test_the_detection_cells_are_of_ids_in_two_copies() -> None:
    ids = fused_cpu.repeated_ids(9).tolist()
    assert len(ids) == 9
    assert ids[5:] == ids[:4]
    assert len(set(ids[:5])) == 5
