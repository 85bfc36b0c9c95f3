"""Benchmark head-type clustering at catalog scale: K-means, GMM and a stability run.

    python bench/clustering.py                      # 1e3, 1e5, 1e6 heads
    python bench/clustering.py --sizes 1e3 1e5      # pick sizes
    python bench/clustering.py --threads 1          # OpenMP/BLAS threads for every fit

Data: ``make_head_features`` (heads drawn around the four prototype profiles, 10 % average
mixing towards another prototype, Dirichlet concentration 60; every row on the simplex), 21
features. Timed per size, the same data for all:

- ``headcat kmeans``: ``HeadClusterer(algorithm="kmeans", n_init=10)`` (canonical row order,
  naming, member means included);
- ``sklearn KMeans``: plain ``KMeans(n_clusters=4, n_init=10).fit`` as the baseline;
- ``headcat gmm``: ``HeadClusterer(algorithm="gmm")`` (K-means start, diagonal EM);
- ``stability R=10``: ``StabilityAnalysis(n_runs=10, fraction=0.5)`` with K-means, including
  its full-data reference fit (11 fits and 10 predictions of every head).

Threads: ``n_threads=None`` (headcat's rule: one thread below 20 000 heads, all cores above)
unless ``--threads`` is given; the sklearn baseline runs under the same limit.

Sizes up to 1e4 take the best of 3 repeats; larger ones are timed once. The growth column is
the time factor per decade of heads between consecutive sizes, ``(t2 / t1) ** (1 / decades)``
(10 = linear). At 1e6 the whole run takes a few minutes on 2 cores (GMM and stability dominate);
``--methods`` skips what you do not need.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import numpy as np
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits

from ingest.clustering import HeadClusterer, make_head_features, thread_limit
from ingest.stability import StabilityAnalysis

METHODS = ("kmeans", "sklearn", "gmm", "stability")
LABELS = {
    "kmeans": "headcat kmeans (n_init=10)",
    "sklearn": "sklearn KMeans(4, n_init=10)",
    "gmm": "headcat gmm (diag)",
    "stability": "stability R=10 (kmeans)",
}


def estimator(method: str, seed: int, threads: int | None) -> Any:
    if method == "kmeans":
        return HeadClusterer(n_init=10, random_state=seed, n_threads=threads)
    if method == "sklearn":
        return KMeans(n_clusters=4, n_init=10, random_state=seed)
    if method == "gmm":
        return HeadClusterer(algorithm="gmm", n_init=10, random_state=seed, n_threads=threads)
    return StabilityAnalysis(n_runs=10, fraction=0.5, random_state=seed, n_threads=threads)


def timed_fit(method: str, seed: int, threads: int | None, X: np.ndarray, repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` fresh fits, and the last fit.

    The sklearn baseline runs under the thread limit headcat would choose for the same data.
    """
    best, fit = math.inf, None
    for _ in range(repeats):
        est = estimator(method, seed, threads)
        t0 = time.perf_counter()
        with threadpool_limits(limits=thread_limit(threads, len(X))):
            fit = est.fit(X)
        best = min(best, time.perf_counter() - t0)
    return best, fit


def run(sizes: list[int], methods: list[str], seed: int, threads: int | None) -> dict[str, dict[int, float]]:
    times: dict[str, dict[int, float]] = {m: {} for m in methods}
    for n in sizes:
        X, truth = make_head_features(n, random_state=seed)
        repeats = 3 if n <= 10_000 else 1
        notes = []
        for m in methods:
            t, fit = timed_fit(m, seed, threads, X, repeats)
            times[m][n] = t
            if m in ("kmeans", "gmm"):
                notes.append(f"{m} accuracy {(fit.labels_ == truth).mean():.3f}")
            elif m == "stability":
                notes.append(f"stability score {fit.score_:.3f}")
            print(f"  n={n:>9,d} {LABELS[m]:<30} {t:9.3f} s", flush=True)
        print(f"  n={n:>9,d} " + ", ".join(notes), flush=True)
    return times


def table(times: dict[str, dict[int, float]], sizes: list[int]) -> str:
    head = f"{'method':<30}" + "".join(f"{f'n=1e{round(math.log10(n))}' if _is_pow10(n) else n:>12}" for n in sizes)
    pairs = list(zip(sizes, sizes[1:], strict=False))
    head += "".join(f"{f'x/dec {_short(a)}-{_short(b)}':>18}" for a, b in pairs)
    lines = [head, "-" * len(head)]
    for m, by_n in times.items():
        row = f"{LABELS[m]:<30}" + "".join(f"{by_n[n]:>11.3f}s" for n in sizes)
        for a, b in pairs:
            decades = math.log10(b / a)
            row += f"{(by_n[b] / by_n[a]) ** (1 / decades):>18.2f}"
        lines.append(row)
    return "\n".join(lines)


def _is_pow10(n: int) -> bool:
    return n > 0 and 10 ** round(math.log10(n)) == n


def _short(n: int) -> str:
    return f"1e{round(math.log10(n))}" if _is_pow10(n) else str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e5, 1e6], help="numbers of heads")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--threads", type=int, default=None, help="OpenMP/BLAS threads (default: headcat's rule, n_threads=None)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes})
    print(f"cpus: {os.cpu_count()}, threads cap: {args.threads}, load: {os.getloadavg()[0]:.1f}", flush=True)
    times = run(sizes, args.methods, args.seed, args.threads)
    print()
    print(table(times, sizes))


if __name__ == "__main__":
    main()
