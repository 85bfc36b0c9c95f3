"""One attention layer on a GPU: the Triton fused kernel (ingest/fused/triton_kernel.py) against SDPA.

For each shape and length, on random float32 inputs:

  sdpa     ``torch.nn.functional.scaled_dot_product_attention`` (the backend torch picks for float32:
           FlashAttention itself takes only half precision), the output alone: the baseline
  stats    the Triton kernel, output and every statistic headcat stores (offsets, entropy, special keys)
  output   the Triton kernel, output alone (no plan)

Times are CUDA-event milliseconds, the median of --repeats calls after a warm-up, the variants taking
turns; the ratio is SDPA's time over the kernel's (>= 1: as fast as SDPA). Before timing, the kernel's
output and statistics at 128 tokens are checked against the eager reference on the same device
(``softmax(scale q k^T + mask) v`` and :func:`ingest.kernels.reduce_maps` of the eager maps), within 1e-5.

    python bench/fused_triton.py                         # BERT-base and the GQA decoder, 512 and 4096 tokens
    python bench/fused_triton.py --lengths 512 --repeats 20 --json out.json
    python bench/fused_triton.py --sweep --repeats 5     # the launch choices (blocks, warps, precision) measured

--sweep: for each shape and length, the kernel with statistics under each launch choice of ``SWEEP`` (rows and keys a
program takes, warps, products' precision), each checked against the eager reference first, against SDPA timed in
the same run; prints every choice's ratio and the best. The defaults in ingest/fused/triton_kernel.py come from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest import kernels  # noqa: E402
from ingest.fused import triton_kernel  # noqa: E402

# name: (batch, query heads, key/value heads, head dim, causal): bench/features.py's BERT-base shape and its
# Llama-shaped GQA decoder (8 query / 2 key-value heads of 64).
SHAPES = {"bert-base": (32, 12, 12, 64, False), "gqa-decoder": (16, 8, 2, 64, True)}
LOWEST = torch.finfo(torch.float32).min


def inputs(shape: str, length: int, device: torch.device, batch: int | None = None) -> dict:
    default_batch, heads, kv_heads, dim, causal = SHAPES[shape]
    batch = batch or default_batch
    generator = torch.Generator(device=device).manual_seed(length)

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device)

    lengths = torch.full((batch,), length)
    lengths[1::2] = length - length // 4  # every other sample padded
    keys = torch.arange(length, device=device)[None, :] < lengths.to(device)[:, None]
    mask = keys[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    else:
        mask = mask.expand(-1, 1, length, -1)
    positions = torch.stack([torch.zeros_like(lengths), lengths - 1], 1)  # [CLS]-like first, [SEP]-like last
    specials = kernels.Specials(
        positions,
        torch.full((batch,), 2),
        torch.tensor([[False, True]] * batch),
        torch.arange(length)[None, :] == (lengths - 1)[:, None],
    )
    return {
        "query": normal(batch, heads, length, dim),
        "key": normal(batch, kv_heads, length, dim),
        "value": normal(batch, kv_heads, length, dim),
        "mask": mask.contiguous(),
        "scale": dim**-0.5,
        "plan": kernels.plan(lengths, length, heads, specials),
    }


def check(shape: str, device: torch.device) -> float:
    """The largest difference of the kernel's output and statistics from the eager reference at 128 tokens
    (relative for sums above 1)."""
    a = inputs(shape, 128, device, batch=4)
    output, sums = triton_kernel.attend(a["query"], a["key"], a["value"], a["mask"], scale=a["scale"], plan=a["plan"])
    group = a["query"].shape[1] // a["key"].shape[1]
    key, value = a["key"].repeat_interleave(group, 1), a["value"].repeat_interleave(group, 1)
    scores = torch.matmul(a["query"], key.transpose(-1, -2)) * a["scale"] + torch.where(a["mask"], 0.0, LOWEST)
    probs = scores.softmax(-1)
    worst = float((output - torch.matmul(probs, value).transpose(1, 2)).abs().max())
    maps = probs.shape[0] * probs.shape[1]
    reference = kernels.reduce_maps(
        probs.cpu().reshape(maps, 128, 128), a["plan"], scores.cpu().reshape(maps, 128, 128)
    )
    assert sums is not None
    for given, want in zip(sums, reference, strict=True):
        assert given is not None
        assert want is not None
        # relative where a sum is above 1 (the entropy sums 128 rows' entropies)
        difference = (given.cpu().double() - want.double()).abs() / want.double().abs().clamp(min=1)
        worst = max(worst, float(difference.max()))
    return worst


def measure(a: dict, repeats: int, only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Median milliseconds of each variant (``only`` these) on the inputs ``a``, the variants taking turns."""
    query, key, value, mask, scale = a["query"], a["key"], a["value"], a["mask"], a["scale"]
    group = query.shape[1] // key.shape[1]
    variants = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1
        ),
        "stats": lambda: triton_kernel.attend(query, key, value, mask, scale=scale, plan=a["plan"]),
        "output": lambda: triton_kernel.attend(query, key, value, mask, scale=scale),
    }
    variants = {name: run for name, run in variants.items() if only is None or name in only}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():  # warm-up: the kernel's compile is not timed
        run()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, run in variants.items():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(stop))
    return {name: statistics.median(values) for name, values in times.items()}


# (rows, keys, warps, precision): the launch choices --sweep measures
SWEEP = [
    (rows, keys, warps, precision)
    for rows, keys in ((64, 64), (128, 64), (64, 32), (128, 128), (32, 64))
    for warps in (4, 8)
    for precision in ("ieee", "tf32x3")
]


def sweep(shapes: list[str], lengths: list[int], repeats: int, device: torch.device) -> list[dict]:
    """Each launch choice's time with statistics against SDPA's, per shape and length (see the module's doc)."""
    rows = []
    for shape in shapes:
        cases = {length: inputs(shape, length, device) for length in lengths}
        sdpa = {length: measure(a, repeats, only=("sdpa",))["sdpa"] for length, a in cases.items()}
        for block_rows, block_keys, warps, precision in SWEEP:
            triton_kernel.BLOCK_ROWS, triton_kernel.BLOCK_KEYS = block_rows, block_keys
            triton_kernel.NUM_WARPS, triton_kernel.PRECISION = warps, precision
            name = f"rows {block_rows} keys {block_keys} warps {warps} {precision}"
            try:
                error = check(shape, device)
            except Exception as failure:  # a choice that does not compile (registers, shared memory): said, skipped
                print(f"{shape} {name}: fails ({type(failure).__name__}: {str(failure).splitlines()[0][:120]})")
                continue
            if error > 1e-5:
                print(f"{shape} {name}: differs from the eager reference by {error:.2e} > 1e-5, left out")
                continue
            for length, a in cases.items():
                stats = measure(a, repeats, only=("stats",))["stats"]
                row = {"shape": shape, "tokens": length, "choice": name, "stats_ms": stats, "sdpa_ms": sdpa[length],
                       "sdpa_over_stats": sdpa[length] / stats, "error": error}  # fmt: skip
                rows.append(row)
                print(f"{shape} {length} tokens {name}: {stats:.3f} ms, {row['sdpa_over_stats']:.2f}x SDPA's speed "
                      f"(error {error:.1e})", flush=True)  # fmt: skip
    for shape in shapes:
        for length in lengths:
            mine = [row for row in rows if row["shape"] == shape and row["tokens"] == length]
            if mine:
                best = max(mine, key=lambda row: row["sdpa_over_stats"])
                print(f"best {shape} {length}: {best['choice']} {best['sdpa_over_stats']:.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sweep", action="store_true", help="measure the launch choices (SWEEP)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        sys.exit("bench/fused_triton.py times CUDA kernels: run it on a GPU")
    if args.sweep:
        rows = sweep(args.shapes, args.lengths, args.repeats, device)
        print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    rows = []
    for shape in args.shapes:
        error = check(shape, device)
        print(f"{shape}: largest difference from the eager reference at 128 tokens {error:.2e}", flush=True)
        if error > 1e-5:
            sys.exit(f"{shape}: the Triton kernel differs from the eager reference by {error:.2e} > 1e-5")
        for length in args.lengths:
            median = measure(inputs(shape, length, device), args.repeats)
            row = {"shape": shape, "tokens": length, **{f"{name}_ms": value for name, value in median.items()},
                   "sdpa_over_stats": median["sdpa"] / median["stats"],
                   "sdpa_over_output": median["sdpa"] / median["output"]}  # fmt: skip
            rows.append(row)
            print(
                f"{shape} {length} tokens: sdpa {median['sdpa']:.3f} ms, triton+stats {median['stats']:.3f} ms "
                f"({row['sdpa_over_stats']:.2f}x SDPA's speed), triton output {median['output']:.3f} ms "
                f"({row['sdpa_over_output']:.2f}x)",
                flush=True,
            )
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
