"""One attention call on the CPU: the fused C++ kernel (ingest/fused/kernel.cpp) against SDPA on the same tensors.

The Llama-shaped GQA decoder of bench/features.py (8 query / 2 key-value heads of 64, causal, no mask: one
sample), random float32 inputs, for each length; with ``--dims``, heads of each size instead, as many as make the
same 512 floats a token (16 / 4 heads of 32, 4 / 1 of 128):

  sdpa      ``torch.nn.functional.scaled_dot_product_attention`` (torch's CPU flash kernel), the output alone:
            the baseline
  output    the fused kernel, output alone
  stats     the fused kernel, output and every statistic headcat stores (its windows of distances, self,
            neighbours and distance, the entropy: 16 windows, as the features take them)
  example   ``stats`` and the catalog's example map (32 x 32), pooled in the same pass (batch 1: every map is
            the example's sample)
  specials  ``stats`` with a special key every 10 tokens, [CLS] and [SEP] in turn (the special keys' windows and
            groups, [SEP] rows' mass on [SEP] keys): a packed Wikipedia sample of bench/features.py holds 1,541
            at 16,384 tokens
  cells     the output and a detection run's five pattern masses (SPEC 10; ``ingest.detectors.pattern_cells``:
            induction, duplicate, previous token, sink, the row's whole mass) of random ids in 2 copies

each with query blocks of ``--rows`` rows (default: the kernel's own choice, ``ingest.fused.block_rows``) and tiles of
``--keys`` keys (default: ``ingest.fused.tile_keys``, 256 KiB of scores). Times
are the process's CPU time (the steadiest clock on a shared host), the best of --repeats calls, the variants taking
turns; the ratio is SDPA's time over the variant's (>= 1: as fast as SDPA). Before
timing, the kernel's output and statistics are checked against the eager reference at 256 tokens.

    OMP_NUM_THREADS=1 python bench/fused_cpu.py --lengths 4096 16384 --repeats 5
    OMP_NUM_THREADS=1 python bench/fused_cpu.py --lengths 16384 --rows 4 32 64 128 256 --variants stats
    OMP_NUM_THREADS=1 python bench/fused_cpu.py --lengths 16384 --rows 128 256 --keys 256 512 --variants output stats
    OMP_NUM_THREADS=1 python bench/fused_cpu.py --lengths 4096 --dims 32 64 128 --rows 32 64 128 256
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest import detectors, fused, kernels  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 64  # the shape's; --dims keeps HEADS * DIM and HEADS // KV_HEADS
VARIANTS = ("output", "stats", "example", "specials", "cells")
SPECIAL_EVERY = 10
WINDOWS = 16  # the features' default num_windows


def shape(dim: int = DIM) -> tuple[int, int]:
    """Query and key/value heads of ``dim`` floats: as many as the Llama shape's 8 x 64 floats a token, 4 query heads
    a key/value head."""
    group = HEADS // KV_HEADS
    if dim < 1 or HEADS * DIM % (dim * group):
        raise ValueError(f"heads of {dim} floats make no {HEADS * DIM} floats a token in groups of {group} heads")
    heads = HEADS * DIM // dim
    return heads, heads // group


def tensors(length: int, dim: int = DIM) -> list[torch.Tensor]:
    """q ``(1, 8, T, 64)``, k and v ``(1, 2, T, 64)`` (heads of another ``dim``: :func:`shape`)."""
    generator = torch.Generator().manual_seed(length)
    heads, kv_heads = shape(dim)
    return [torch.randn(1, h, length, dim, generator=generator) for h in (heads, kv_heads, kv_heads)]


def check(length: int = 256, dim: int = DIM) -> None:
    """The kernel's output and window sums against the eager maps' (within 1e-5)."""
    q, k, v = tensors(length, dim)
    group = HEADS // KV_HEADS
    later = torch.ones(length, length, dtype=torch.bool).triu(1)
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * dim**-0.5
    probs = scores.masked_fill(later, float("-inf")).softmax(-1)
    plan = kernels.plan(torch.tensor([length]), length, q.shape[1], num_windows=WINDOWS)
    output, sums = fused.attend(q, k, v, None, scale=dim**-0.5, causal=True, plan=plan)
    want = (probs @ v.repeat_interleave(group, 1)).transpose(1, 2)
    torch.testing.assert_close(output, want, rtol=0, atol=1e-5)
    assert sums is not None
    want_sums = kernels.window_sums(kernels.reduce_maps(probs[0], plan, scores[0].masked_fill(later, -1e30)), plan)
    torch.testing.assert_close(sums.windows, want_sums.windows, rtol=1e-6, atol=1e-5)


def special_keys(length: int) -> kernels.Specials:
    """A special key every :data:`SPECIAL_EVERY` tokens, [CLS] and [SEP] in turn, in key order."""
    positions = torch.arange(0, length, SPECIAL_EVERY)
    slot_sep = torch.arange(len(positions)) % 2 == 1
    query_sep = torch.zeros(length, dtype=torch.bool)
    query_sep[positions[slot_sep]] = True
    groups = slot_sep.long()  # the groups' indices: 0 [CLS], 1 [SEP]
    return kernels.Specials(positions[None], torch.tensor([len(positions)]), slot_sep[None], query_sep[None],
                            groups[None])  # fmt: skip


def repeated_ids(length: int) -> torch.Tensor:
    """``(T,)`` random ids in 2 copies (the second half repeats the first), as a detection run's sequences hold them."""
    half = torch.randint(0, 1 << 30, ((length + 1) // 2,), generator=torch.Generator().manual_seed(length))
    return torch.cat([half, half])[:length]


def variants(length: int, names: list[str], dim: int = DIM) -> dict[str, Callable[[], object]]:
    q, k, v = tensors(length, dim)
    heads, scale = q.shape[1], dim**-0.5
    plan = kernels.plan(torch.tensor([length]), length, heads, num_windows=WINDOWS)
    specials = (
        kernels.plan(torch.tensor([length]), length, heads, special_keys(length), num_windows=WINDOWS, group_count=4)
        if "specials" in names
        else None
    )
    runs: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    }
    cells = detectors.pattern_cells(repeated_ids(length)) if "cells" in names else None
    for name in names:

        def run(name: str = name) -> object:
            if name == "cells":
                assert cells is not None
                return fused.attend_cells(q, k, v, None, scale=scale, causal=True, cells=cells)
            example = fused.Example(0, length, length, (32, 32)) if name == "example" else None
            chosen = {"output": None, "specials": specials}.get(name, plan)
            return fused.attend(q, k, v, None, scale=scale, causal=True, plan=chosen, example=example)

        runs[name] = run
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rows", type=int, nargs="+", help="query rows a block holds (default: the kernel's choice)")
    parser.add_argument("--keys", type=int, nargs="+", help="keys a tile holds (default: the kernel's choice)")
    parser.add_argument("--dims", type=int, nargs="+", default=[DIM], help="a head's floats, a shape each")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for dim in args.dims:
        try:
            shape(dim)
        except ValueError as error:
            parser.error(f"--dims: {error}")
    if (problem := fused.unavailable()) is not None:
        raise SystemExit(f"the fused kernel is not available: {problem}")
    capability = torch.backends.cpu.get_cpu_capability()
    for dim in args.dims:
        check(dim=dim)
        heads, kv_heads = shape(dim)
        print(f"one causal GQA call ({heads} query / {kv_heads} key-value heads of {dim}), float32, "
              f"{torch.get_num_threads()} thread(s), {capability}; CPU time, best of {args.repeats}")  # fmt: skip
        for length in args.lengths:
            for rows, keys in itertools.product(args.rows or [None], args.keys or [None]):
                if rows is not None:
                    fused.BLOCK_BYTES, fused.MIN_BLOCK_ROWS = 0, rows
                fused.TILE_KEYS = keys  # None: the kernel's own choice (TILE_BYTES of scores)
                runs = variants(length, args.variants, dim)
                for run in runs.values():  # warm-up
                    run()
                best = dict.fromkeys(runs, float("inf"))
                for _ in range(args.repeats):
                    for name, run in runs.items():
                        start = time.process_time()
                        run()
                        best[name] = min(best[name], time.process_time() - start)
                used = fused.block_rows(length, length, dim)
                line = ", ".join(f"{name} {best['sdpa'] / best[name]:.3f}x" for name in args.variants)
                print(f"  {length} tokens, blocks of {used} rows, tiles of {fused.tile_keys(used)} keys: "
                      f"sdpa {best['sdpa']:.3f} s; {line}")  # fmt: skip
                fused.TILE_KEYS = None


if __name__ == "__main__":
    main()
