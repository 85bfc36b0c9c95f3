"""Benchmark: the cost of ablation, and what the shared Evaluator saves on a whole plan.

1. Throughput (examples/s) on the same pre-tokenized batches: the plain eager model, the
   unablated evaluation (Ablator with an empty spec, predictions, drift) and ablated ones
   (prune or uniform on one head type; every operation on a quarter of the heads each).
   Wall time and this process's CPU time are both shown: on a shared machine the CPU time is
   the steadier of the two. Target: ablated >= 0.9x unablated.
2. A plan (Guan et al. Table 2 rows by default) run through one shared Evaluator (tokenize once,
   baseline once) against a naive loop that re-tokenizes and recomputes the baseline per row.

    python bench/ablation.py                      # minilm-sst2, 400 SST-2 dev sentences
    python bench/ablation.py --limit 200 --rows all --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingest.ablation import AblationSpec, paper_plan  # noqa: E402
from ingest.clustering import HeadClusterer  # noqa: E402
from ingest.corpora import Sample  # noqa: E402
from ingest.evaluation import Evaluator, run_plan  # noqa: E402
from ingest.features import FeatureConfig, extract_features  # noqa: E402
from ingest.selection import Operation  # noqa: E402
from ingest.tasks import read_glue_tsv  # noqa: E402

SHARED = ROOT.parent / "shared"


def catalog_types(model, tokenizer, texts: list[str]) -> dict[tuple[int, int], str]:
    """Head types the way the catalog makes them: features of ``texts`` (SPEC 1), K-means k = 4 (SPEC 2)."""
    result = extract_features(model, tokenizer, [Sample(text) for text in texts], FeatureConfig(samples=len(texts)))
    layers, heads, width = result.vectors.shape
    clusterer = HeadClusterer(n_clusters=4, random_state=0).fit(result.vectors.reshape(-1, width))
    names = [clusterer.names_[label] for label in clusterer.labels_]
    return {(layer, head): names[layer * heads + head] for layer in range(layers) for head in range(heads)}


def throughput(model, evaluator: Evaluator, spec: AblationSpec | None) -> tuple[float, float]:
    """One pass over the evaluator's batches: (wall seconds, CPU seconds of this process).

    ``None`` is the plain model; a spec goes through the evaluator's scoring path (forward under
    the Ablator, predictions and drift against the cached baseline), as ``Evaluator.run`` does,
    so the empty spec is an unablated evaluation (``run`` would return the cached baseline).
    """
    wall, cpu = time.perf_counter(), time.process_time()
    if spec is None:
        with torch.inference_mode():
            for batch in evaluator._prepared.batches:
                model(**batch.inputs)
    else:
        evaluator._evaluate(spec, keep=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "minilm-sst2")
    parser.add_argument("--data", type=Path, default=SHARED / "data" / "glue-sst2" / "dev.tsv")
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", choices=["t2", "all"], default="t2", help="Table 2 rows only, or Tables 2 and 3")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, attn_implementation="eager", dtype=torch.float32
    ).eval()
    data = read_glue_tsv(args.data, config=model.config)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    print(f"model {args.model.name}: {layers} x {heads} heads; {min(args.limit, len(data))} examples of {args.data}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    evaluator = Evaluator.for_task(
        "classification",
        model,
        tokenizer,
        data,
        limit=args.limit,
        batch_size=args.batch_size,
        max_length=args.max_length,
    )
    assignments = catalog_types(model, tokenizer, [text for text, _, _ in data[:32]])

    # 1. throughput ---------------------------------------------------------------------------
    operations: tuple[Operation, ...] = ("prune", "uniform", "drop_intra", "drop_inter")
    quarter: dict[Operation, list[tuple[int, int]]] = {
        op: [(layer, head) for layer in range(layers) for head in range(heads) if head % 4 == i]
        for i, op in enumerate(operations)
    }
    specs = {
        "plain eager model": None,
        "unablated evaluation": AblationSpec.empty(layers, heads),
        "prune 1 type (~1/4 heads)": AblationSpec.build(
            {"prune": ["dense"]}, assignments, num_layers=layers, num_heads=heads
        ),
        "uniform 1 type": AblationSpec.build({"uniform": ["dense"]}, assignments, num_layers=layers, num_heads=heads),
        "all four ops, every head": AblationSpec.build(quarter, num_layers=layers, num_heads=heads),
    }
    evaluator.baseline()
    for spec in specs.values():  # warm-up
        throughput(model, evaluator, spec)
    walls: dict[str, list[float]] = {name: [] for name in specs}
    cpus: dict[str, list[float]] = {name: [] for name in specs}
    for _ in range(args.repeats):  # interleaved, so that load on the machine hits every variant
        for name, spec in specs.items():
            wall, cpu = throughput(model, evaluator, spec)
            walls[name].append(wall)
            cpus[name].append(cpu)
    n = evaluator.n_examples
    ref_wall = statistics.median(walls["unablated evaluation"])
    ref_cpu = statistics.median(cpus["unablated evaluation"])
    print(f"\n1. throughput on identical batches, median of {args.repeats} interleaved passes")
    print(f"{'variant':30s} {'ex/s wall':>10s} {'ratio':>6s} {'ex/CPU-s':>9s} {'ratio':>6s}")
    for name in specs:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"{name:30s} {n / wall:10.1f} {ref_wall / wall:5.2f}x {n / cpu:9.1f} {ref_cpu / cpu:5.2f}x")
    print("(ratio: examples/s relative to the unablated evaluation; target >= 0.9x)")

    # 2. plan: shared evaluator vs naive loop ---------------------------------------------------
    present = sorted(set(assignments.values()))
    plan = paper_plan(present)
    if args.rows == "t2":
        plan = [row for row in plan if row.paper_ref is None or row.paper_ref.startswith("T2")]
    print(f"\n2. plan of {len(plan)} rows ({args.rows}); types present: {', '.join(present)}")

    started, cpu_started = time.perf_counter(), time.process_time()
    shared = Evaluator.for_task(
        "classification",
        model,
        tokenizer,
        data,
        limit=args.limit,
        batch_size=args.batch_size,
        max_length=args.max_length,
        cache=False,
    )
    outcomes = run_plan(shared, plan, assignments=assignments)
    shared_seconds, shared_cpu = time.perf_counter() - started, time.process_time() - cpu_started

    started, cpu_started = time.perf_counter(), time.process_time()
    naive_metrics = {}
    for row in plan:
        fresh = Evaluator.for_task(
            "classification",
            model,
            tokenizer,
            data,
            limit=args.limit,
            batch_size=args.batch_size,
            max_length=args.max_length,
            cache=False,
        )
        fresh.baseline()
        naive_metrics[row.id] = fresh.run(row.to_spec(assignments, num_layers=layers, num_heads=heads))
    naive_seconds, naive_cpu = time.perf_counter() - started, time.process_time() - cpu_started

    print(f"{'row':36s} {'ref':>6s} {'acc':>7s} {'f1':>7s} {'kl':>8s} {'s':>6s}")
    for outcome in outcomes:
        m = outcome.metrics
        print(
            f"{outcome.row_id:36s} {outcome.paper_ref or '-':>6s} {m['accuracy']:7.2f} {m['f1']:7.2f} "
            f"{m['kl']:8.4f} {outcome.seconds:6.2f}"
        )
        assert naive_metrics[outcome.row_id].values == m.values, outcome.row_id
    print(f"\n{'':18s} {'wall s':>8s} {'s/row':>6s} {'CPU s':>8s} {'s/row':>6s}")
    for name, wall, cpu in (("shared Evaluator", shared_seconds, shared_cpu), ("naive loop", naive_seconds, naive_cpu)):
        print(f"{name:18s} {wall:8.1f} {wall / len(plan):6.2f} {cpu:8.1f} {cpu / len(plan):6.2f}")
    print(
        f"{'speed-up':18s} {naive_seconds / shared_seconds:7.2f}x {'':6s} {naive_cpu / shared_cpu:7.2f}x"
        "  (same metrics in both)"
    )


if __name__ == "__main__":
    main()
