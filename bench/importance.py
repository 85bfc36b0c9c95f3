"""Benchmark: what head importance costs (SPEC section 7).

On the same pre-tokenized batches of a task model (minilm-sst2 and SST-2 dev sentences by default):

1. plain: the eager model, forward + backward of the summed task loss down to the input
   embeddings (parameters frozen): the cost of one forward and one backward, nothing else;
2. plain + weights: the same with parameter gradients (a training step without the optimizer);
3. importance: ``ingest.importance.head_importance`` (the gate in headcat's attention path, one
   forward and one backward per batch, per-example gradients of every head);
4. naive: one forward per head with that head pruned (the Ablator), plus the unpruned one,
   the loss difference per head: what importance costs without the gradient trick.

Examples/s of each, and ratios against (1) measured in the same run (target: importance >= 0.9x
plain). Wall time and this process's CPU time are both shown: on a shared machine the CPU time
is the steadier of the two. The naive way runs on ``--naive-batches`` batches only.

    python bench/importance.py --limit 128 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingest.ablation import Ablator, model_shape  # noqa: E402
from ingest.evaluation import Evaluator  # noqa: E402
from ingest.importance import ImportanceConfig, head_importance, loss_batches, prune_spec  # noqa: E402
from ingest.tasks import read_glue_tsv  # noqa: E402

SHARED = ROOT.parent / "shared"


def timed(work: Callable[[], None], repeats: int, *, warm_up: bool = True) -> tuple[float, float]:
    """Median wall and CPU seconds of ``repeats`` runs (after one warm-up run unless ``warm_up=False``)."""
    if warm_up:
        work()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "minilm-sst2")
    parser.add_argument("--data", type=Path, default=SHARED / "data" / "glue-sst2" / "dev.tsv")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-batches", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, attn_implementation="eager",
                                                               dtype=torch.float32).eval()  # fmt: skip
    model.requires_grad_(False)
    examples = read_glue_tsv(args.data, config=model.config)[: args.limit]
    evaluator = Evaluator.for_task("classification", model, tokenizer, examples, batch_size=args.batch_size,
                                   max_length=128)  # fmt: skip
    config = ImportanceConfig("task")
    batches = loss_batches(evaluator, config)
    n = sum(batch.size for batch in batches)
    ce = torch.nn.functional.cross_entropy

    def plain() -> None:
        embeddings = model.get_input_embeddings()
        for batch in batches:
            inputs = dict(batch.inputs)
            embeds = embeddings(inputs.pop("input_ids")).detach().requires_grad_(True)
            with torch.enable_grad():
                loss = ce(model(inputs_embeds=embeds, **inputs).logits, batch.targets["labels"], reduction="sum")
                torch.autograd.grad(loss, [embeds])

    def plain_weights() -> None:
        model.requires_grad_(True)
        try:
            for batch in batches:
                with torch.enable_grad():
                    ce(model(**batch.inputs).logits, batch.targets["labels"], reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        finally:
            model.requires_grad_(False)

    def importance() -> None:
        head_importance(model, batches, config)

    num_layers, num_heads = model_shape(model)
    naive_batches = batches[: args.naive_batches]
    naive_n = sum(batch.size for batch in naive_batches)

    def naive() -> None:
        with torch.inference_mode():
            for batch in naive_batches:
                base = ce(model(**batch.inputs).logits, batch.targets["labels"], reduction="none")
                for layer in range(num_layers):
                    for head in range(num_heads):
                        with Ablator(model, prune_spec([(layer, head)], num_layers, num_heads)) as ablator:
                            ablator.set_batch(batch.inputs["attention_mask"])
                            pruned = ce(model(**batch.inputs).logits, batch.targets["labels"], reduction="none")
                        (pruned - base).abs().mean()

    print(f"{args.model.name}: {n} SST-2 sentences in {len(batches)} batches of {args.batch_size}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}", flush=True)  # fmt: skip
    results = {}
    for label, work, count, repeats in (
        ("plain forward+backward", plain, n, args.repeats),
        ("plain + weight grads", plain_weights, n, args.repeats),
        ("importance (gate)", importance, n, args.repeats),
        ("naive (1 forward/head)", naive, naive_n, 1),
    ):
        wall, cpu = timed(work, repeats, warm_up=work is not naive)  # 73 forwards warm themselves up
        results[label] = (count / wall, count / cpu)
        print(f"{label:<24} {count / wall:8.1f} ex/s wall   {count / cpu:8.1f} ex/s CPU", flush=True)
    base_wall, base_cpu = results["plain forward+backward"]
    print("\nratios against plain forward+backward (same run):", flush=True)
    for label, (wall, cpu) in results.items():
        print(f"{label:<24} {wall / base_wall:6.3f}x wall   {cpu / base_cpu:6.3f}x CPU")
    imp_wall, imp_cpu = results["importance (gate)"]
    naive_wall, naive_cpu = results["naive (1 forward/head)"]
    print(f"importance vs naive: {imp_wall / naive_wall:.1f}x wall, {imp_cpu / naive_cpu:.1f}x CPU faster", flush=True)


if __name__ == "__main__":
    main()
