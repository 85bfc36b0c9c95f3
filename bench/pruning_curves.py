"""The README's pruning curves: which ranking keeps a task model's metric best (SPEC section 7).

For one task model and its data: importance from the task loss (one forward and one backward
per batch, the gate in headcat's attention path), head types the way the catalog makes them
(features of the same texts, SPEC 1; K-means k = 4, SPEC 2), then one curve per ranking
(importance, type, random with seed 0, -importance; and iterative importance) to ``--max-share``
of all heads in ``--steps`` steps, every point against the one shared baseline. The same code
the ``prune-curve`` job runs (``ingest.importance.pruning_curve``); results also as JSON.

    python bench/pruning_curves.py --task glue   # minilm-sst2, 200 SST-2 dev sentences
    python bench/pruning_curves.py --task squad  # minilm-squad, 100 held-out questions
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingest.clustering import HeadClusterer  # noqa: E402
from ingest.corpora import Sample  # noqa: E402
from ingest.evaluation import Evaluator  # noqa: E402
from ingest.features import FeatureConfig, extract_features  # noqa: E402
from ingest.importance import RANKINGS, ImportanceConfig, primary_metric, pruning_curve, score_evaluator  # noqa: E402
from ingest.loading import load_model  # noqa: E402
from ingest.tasks import read_glue_tsv, read_squad  # noqa: E402

SHARED = ROOT.parent / "shared"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["glue", "squad"], default="glue")
    parser.add_argument("--limit", type=int, default=None, help="default: 200 sentences / 100 questions")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-share", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-iterative", action="store_true")
    parser.add_argument("--rankings", default=",".join(RANKINGS), help="comma list (default: all four)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.task == "glue":
        loaded = load_model(str(SHARED / "models" / "minilm-sst2"), device="cpu", task="sequence-classification")
        sentences = read_glue_tsv(SHARED / "data" / "glue-sst2" / "dev.tsv", config=loaded.model.config)
        examples: list[Any] = sentences[: args.limit or 200]
        evaluator = Evaluator.for_task("classification", loaded.model, loaded.tokenizer, examples,
                                       batch_size=args.batch_size, max_length=128)  # fmt: skip
        samples = [Sample(example.text) for example in examples]
    else:
        loaded = load_model(str(SHARED / "models" / "minilm-squad"), device="cpu", task="question-answering")
        questions = read_squad(SHARED / "data" / "squad-v1.1" / "dev-v1.1.json", articles=range(24, 48))
        examples = questions[: args.limit or 100]
        evaluator = Evaluator.for_task("squad", loaded.model, loaded.tokenizer, examples, batch_size=args.batch_size)
        samples = [Sample(example.question, example.context) for example in examples]
    baseline = evaluator.baseline()
    metric = primary_metric(evaluator.task, baseline.values)
    print(
        f"{args.task}: {len(examples)} examples, baseline {baseline.to_dict()} ({time.perf_counter() - started:.0f} s)"
    )

    result = score_evaluator(evaluator, ImportanceConfig("task"))
    scores = result.single_stack()
    print(f"importance over {result.n_examples} examples (windows) in {result.seconds:.1f} s")
    types = {}
    if "type" in args.rankings.split(","):
        types = catalog_types_of(loaded, samples)
        counts: dict[str, int] = {}
        for name in types.values():
            counts[name] = counts.get(name, 0) + 1
        print(f"types: {counts}")

    curves = {}
    plans: list[tuple[str, bool]] = [(name, False) for name in args.rankings.split(",") if name]
    if not args.no_iterative:
        plans.append(("importance", True))
    for ranking, iterative in plans:
        t = time.perf_counter()
        curve = pruning_curve(evaluator, ranking, steps=args.steps, max_share=args.max_share, iterative=iterative,  # type: ignore[arg-type]
                              scores=scores, types=types, seed=0)  # fmt: skip
        label = ranking + (" (iterative)" if iterative else "")
        curves[label] = curve
        print(
            f"{label:<24} "
            + " ".join(f"{v:6.2f}" for v in curve.metric(metric))
            + f"   ({time.perf_counter() - t:.0f} s)"
        )

    shares = [p.share for p in next(iter(curves.values())).points]
    print(f"\n{metric} against share of heads pruned ({args.task}, {len(examples)} examples)")
    print("| ranking | " + " | ".join(f"{100 * s:.0f} %" for s in shares) + " |")
    print("|---|" + "---|" * len(shares))
    for label, curve in curves.items():
        print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in curve.metric(metric)) + " |")
    area = {label: sum(curve.metric(metric)) / len(shares) for label, curve in curves.items()}
    print("mean over the points: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(area.items(), key=lambda kv: -kv[1])))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "task": args.task, "n_examples": len(examples), "metric": metric, "baseline": baseline.to_dict(),
            "types": {f"{layer}:{head}": t for (layer, head), t in types.items()},
            "scores": scores.tolist(),
            "curves": {label: {"shares": shares, "values": curve.metric(metric),
                               "order": [list(h) for h in curve.order]} for label, curve in curves.items()},
        }, indent=1))  # fmt: skip


def catalog_types_of(loaded, samples: list[Sample]) -> dict[tuple[int, int], str]:
    """:func:`bench.ablation.catalog_types` for samples that may be text pairs."""
    result = extract_features(loaded.model, loaded.tokenizer, samples, FeatureConfig(samples=len(samples)))
    layers, heads, width = result.vectors.shape
    clusterer = HeadClusterer(n_clusters=4, random_state=0).fit(result.vectors.reshape(-1, width))
    names = [clusterer.names_[label] for label in clusterer.labels_]
    return {(layer, head): names[layer * heads + head] for layer in range(layers) for head in range(heads)}


if __name__ == "__main__":
    main()
