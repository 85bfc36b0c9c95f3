"""Stability of a head clustering (SPEC section 3; Von Luxburg 2010 as used in Guan et al. Table 1).

The clustering is fitted ``n_runs`` times, each on a random ``fraction`` of the heads; every fit
predicts *all* heads. A fit's label ids are arbitrary, so each fit's centroids are matched to
the reference centroids (the clustering of all heads) by the Hungarian algorithm on Euclidean
distance (:func:`match_clusters`), and its labels are rewritten in the reference's ids. A head
is *stable* when its aligned label is the same in all runs; the score is the share of stable
heads (Guan et al. report 94-96 %).

Per head, given the reference clustering's labels, ``agreement_`` is the share of the R fits
whose aligned label is the head's reference label: 1 for a head every fit types as the
clustering does, lower for one on a border (the confidence ``GET /heads`` serves). The strict
score asks every fit to agree with the first; ``run_agreement_`` is each fit's agreement with
the reference over all heads (``bench/stability_table.py`` compares these readings with the
paper's figure).

Run ``r`` is reproducible from ``seeds_[r]`` alone: the seed draws its subset
(``np.random.default_rng(seed).choice(n, m, replace=False)``) and is the clusterer's
``random_state``. The seeds are drawn from ``random_state``.
"""

from __future__ import annotations

import logging

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import linear_sum_assignment
from sklearn.base import BaseEstimator

from ingest.clustering import Algorithm, HeadClusterer, check_features
from ingest.types import DEFAULT_NUM_WINDOWS

logger = logging.getLogger(__name__)


def match_clusters(centroids: ArrayLike, reference_centroids: ArrayLike) -> NDArray[np.intp]:
    """Hungarian matching of ``centroids`` ``(k, d)`` to ``reference_centroids`` ``(k, d)``.

    Returns ``mapping`` ``(k,)``: cluster ``j`` of the fit is reference cluster ``mapping[j]``
    (a permutation minimising the summed Euclidean distance), so ``mapping[labels]`` aligns labels.
    """
    C = np.asarray(centroids, dtype=np.float64)
    R = np.asarray(reference_centroids, dtype=np.float64)
    if C.ndim != 2 or C.shape != R.shape:
        raise ValueError(f"centroids {C.shape} and reference_centroids {R.shape} must have the same (k, d)")
    cost = np.linalg.norm(C[:, None, :] - R[None, :, :], axis=-1)  # (k, k)
    rows, cols = linear_sum_assignment(cost)
    mapping = np.empty(C.shape[0], dtype=np.intp)
    mapping[rows] = cols
    return mapping


def subset_indices(n_heads: int, size: int, seed: int) -> NDArray[np.intp]:
    """The sorted subset of ``size`` heads of ``n_heads`` that run seed ``seed`` fits on."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_heads, size=size, replace=False)).astype(np.intp)


class StabilityAnalysis(BaseEstimator):
    """Clustering stability by refitting on random subsets (module docstring).

    Parameters
    ----------
    algorithm, n_clusters, n_init, num_windows, n_threads : as for :class:`~ingest.clustering.HeadClusterer`.
    n_runs : ``R >= 2`` fits.
    fraction : share of heads each fit sees, ``0 < fraction <= 1`` (``round(fraction * n)``
        heads, at least ``n_clusters`` of them).
    random_state : seed from which the runs' seeds are drawn.

    Attributes
    ----------
    score_ : share of heads with the same aligned label in all runs.
    stable_ : ``(n,)`` bool, that head's labels agree across runs.
    labels_ : ``(R, n)`` each run's prediction of every head, in the reference's label ids.
    centroids_ : ``(R, k, d)`` each run's centroids, rows in the reference's order.
    seeds_ : ``(R,)`` per-run seeds (subset draw and clusterer ``random_state``).
    subset_sizes_ : ``(R,)`` heads each run was fitted on.
    reference_centroids_ : ``(k, d)`` the centroids the runs were aligned to.
    reference_labels_ : ``(n,)`` the reference clustering's labels when it was fitted here,
        else ``None``.
    run_agreement_ : ``(R,)`` share of heads where each run agrees with the reference labels
        (``None`` where no reference labels exist).
    agreement_ : ``(n,)`` per-head confidence: the share of the R fits whose aligned label is
        the head's label in the reference clustering (``None`` where no reference labels exist:
        pass ``reference_labels`` with ``reference_centroids``).
    """

    def __init__(
        self,
        *,
        algorithm: Algorithm = "kmeans",
        n_clusters: int = 4,
        n_runs: int = 10,
        fraction: float = 0.5,
        random_state: int = 0,
        n_init: int = 10,
        num_windows: int = DEFAULT_NUM_WINDOWS,
        n_threads: int | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.n_clusters = n_clusters
        self.n_runs = n_runs
        self.fraction = fraction
        self.random_state = random_state
        self.n_init = n_init
        self.num_windows = num_windows
        self.n_threads = n_threads

    def _clusterer(self, random_state: int) -> HeadClusterer:
        return HeadClusterer(
            algorithm=self.algorithm,
            n_clusters=self.n_clusters,
            random_state=random_state,
            n_init=self.n_init,
            num_windows=self.num_windows,
            n_threads=self.n_threads,
        )

    def fit(
        self,
        X: ArrayLike,
        reference_centroids: ArrayLike | None = None,
        reference_labels: ArrayLike | None = None,
    ) -> StabilityAnalysis:
        """Measure the stability of clustering ``X`` ``(n_heads, num_windows + 5)``.

        ``reference_centroids`` ``(k, d)``: the full-data clustering's centroids (e.g. the stored
        clustering); when ``None``, a :class:`HeadClusterer` with the same parameters and
        ``random_state`` is fitted on all of ``X``. ``reference_labels`` ``(n,)``: that
        clustering's label of each head (ids index ``reference_centroids``' rows), for the
        per-head ``agreement_``; only with ``reference_centroids``.
        """
        X = check_features(X, self.num_windows)
        n, d = X.shape
        k = int(self.n_clusters)
        if int(self.n_runs) != self.n_runs or self.n_runs < 2:
            raise ValueError(f"n_runs must be an integer >= 2, got {self.n_runs}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if k < 2:
            raise ValueError(f"n_clusters must be >= 2, got {k}")
        size = int(round(self.fraction * n))
        if size < k:
            raise ValueError(f"a {self.fraction} subset of {n} heads has {size} heads, fewer than n_clusters={k}")

        self.reference_labels_: NDArray[np.intp] | None = None
        if reference_labels is not None and reference_centroids is None:
            raise ValueError("reference_labels go with reference_centroids (the clustering they label)")
        if reference_centroids is None:
            reference = self._clusterer(self.random_state).fit(X)
            ref = reference.centroids_
            self.reference_labels_ = reference.labels_
        else:
            ref = check_features(reference_centroids, self.num_windows, name="reference_centroids")
            if ref.shape[0] != k:
                raise ValueError(f"reference_centroids must have n_clusters={k} rows, got {ref.shape[0]}")
            if reference_labels is not None:
                given = np.asarray(reference_labels)
                if given.shape != (n,) or not np.issubdtype(given.dtype, np.integer):
                    raise ValueError(f"reference_labels must be ({n},) integers, got {given.shape} {given.dtype}")
                if given.min() < 0 or given.max() >= k:
                    raise ValueError(f"reference_labels must be ids in [0, {k})")
                self.reference_labels_ = given.astype(np.intp)

        seed_rng = np.random.default_rng(self.random_state)
        seeds = seed_rng.integers(0, 2**31 - 1, size=int(self.n_runs))
        labels = np.empty((seeds.size, n), dtype=np.intp)  # (R, n)
        centroids = np.empty((seeds.size, k, d))  # (R, k, d)
        for r, seed in enumerate(seeds):
            subset = subset_indices(n, size, int(seed))
            # The reference names the clusters for k != 4, so no k = 4 refit per run.
            fit = self._clusterer(int(seed)).fit(
                X[subset],
                reference_centroids=ref,
                reference_names=[f"ref_{i}" for i in range(k)],
            )
            mapping = match_clusters(fit.centroids_, ref)
            labels[r] = mapping[fit.predict(X)]
            centroids[r, mapping] = fit.centroids_
            logger.debug("stability run %d/%d (seed %d) done", r + 1, seeds.size, seed)

        self.seeds_ = seeds
        self.subset_sizes_ = np.full(seeds.size, size, dtype=np.intp)
        self.reference_centroids_ = ref
        self.labels_ = labels
        self.centroids_ = centroids
        self.stable_ = (labels == labels[0]).all(axis=0)
        self.score_ = float(self.stable_.mean())
        self.run_agreement_ = (
            None if self.reference_labels_ is None else (labels == self.reference_labels_).mean(axis=1)
        )
        self.agreement_: NDArray[np.float64] | None = (
            None if self.reference_labels_ is None else (labels == self.reference_labels_).mean(axis=0)
        )
        logger.info(
            "stability of %s k=%d over %d runs of %d/%d heads: %.2f%%",
            self.algorithm,
            k,
            seeds.size,
            size,
            n,
            100 * self.score_,
        )
        return self
