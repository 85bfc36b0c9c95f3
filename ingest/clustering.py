"""Head types: clustering of head distance vectors and the names of the clusters (SPEC section 2).

Input everywhere is ``X`` of shape ``(n_heads, num_windows + 5)`` in SPEC order
``w0..w{N-1}, self, cls, sep, period, comma`` (:func:`ingest.types.feature_names`). A joint fit
over several models is just their rows stacked; :func:`shares_by_group` splits the result again.

Algorithms
----------
``kmeans``
    ``sklearn.cluster.KMeans`` (Lloyd, k-means++ seeding) with ``n_init`` restarts (default
    10, the classic choice, so a bad seeding cannot decide a 384-head clustering). At
    ``10**6 x 21`` heads the fit takes about 10 s on 2 cores (``bench/clustering.py``), so
    MiniBatchKMeans is not needed.
``gmm``
    ``sklearn.mixture.GaussianMixture`` with ``covariance_type="diag"``, started from the
    best-of-``n_init`` K-means solution above (its weights, means and per-cluster variances),
    then one EM run: the restarts are spent on the cheap K-means, not on EM, which costs
    about 1-2 s per iteration at ``10**6`` heads. Diagonal, not full: a head vector lies on
    the simplex (its features sum to 1), so a full covariance is singular by construction
    and only ``reg_covar`` keeps it invertible; a full model also has
    ``k * d * (d + 1) / 2 = 924`` covariance parameters for ``k = 4, d = 21``, more than the
    384 heads of BERT-large, against 84 for diagonal; and it is about 5x slower at ``10**6``
    heads. Labels are the most probable component.

Threads: ``n_threads=None`` uses one OpenMP/BLAS thread below 20 000 heads (threads save
milliseconds there and, on a busy machine, cost seconds) and all cores above.

For both, ``centroids_`` are the means of each cluster's member heads (for K-means these are
the K-means centres; for the mixture they are the hard-assignment means, which is what the
names and the catalog describe).

Canonical form
--------------
A fit is made independent of the order of the rows and of the label ids the algorithm happened
to use:

1. The rows are put into a canonical order before fitting (stable sort on a fixed projection,
   full lexicographic sort when distinct rows tie), so the same set of heads with the same seed
   gives bit-identical centroids, whatever order the heads arrive in.
2. The clusters are named (rules below) and label ids are assigned in a fixed order of the
   names: for ``k = 4`` the id of a cluster is the position of its type in
   :data:`ingest.types.HEAD_TYPES` (``dense=0, diagonal=1, dense_vertical=2, vertical=3``).

Naming rules
------------
``k = 4`` (:func:`name_clusters`, SPEC section 2): special mass ``S = cls + sep + period +
comma``, local mass ``D = self + w0 + w1``. Highest ``S`` -> ``vertical``; of the other three,
highest ``D`` -> ``diagonal``; of the last two, higher ``S`` -> ``dense_vertical``, lower ->
``dense``. Ties go to the lower cluster index.

``k != 4`` (:func:`name_by_reference`): a ``k = 4`` clustering of the same data, same algorithm,
same seed and ``n_init`` is fitted (or passed in) as the reference. Every cluster takes the
type of its nearest named reference centroid (Euclidean). Names are unique per clustering: when
several clusters share a nearest type, the one closest to that reference centroid keeps the bare
name and the others get ``_2``, ``_3``, ... in order of increasing distance (ties: lower cluster
index first), e.g. ``diagonal, diagonal_2``. So for ``k = 3`` one type can be missing, for
``k = 5`` at least one type is split. :func:`base_type` maps a name back to its
:data:`~ingest.types.HeadType`. Label ids follow the reference order, then the suffix.

Where no ``k = 4`` reference exists (fewer than 4 heads or fewer than 4 distinct head vectors),
clusters are named ``cluster_<i>``, with ids ordered by decreasing ``S``, then decreasing
``D``, then the centroid values.

t-SNE
-----
:func:`tsne_embedding` embeds up to ``max_points`` heads exactly. Above that it fits t-SNE on a
seeded random subsample of ``max_points`` heads, and the other heads are either placed at the
mean embedding of their nearest embedded neighbours in feature space (``out_of_sample="knn"``,
the default: an interpolation for the scatter view, not a t-SNE optimum) or returned as NaN
(``out_of_sample="nan"``).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import sparse
from sklearn.base import BaseEstimator, ClusterMixin
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.manifold import TSNE
from sklearn.mixture import GaussianMixture
from sklearn.neighbors import NearestNeighbors
from threadpoolctl import threadpool_limits

from ingest.types import DEFAULT_NUM_WINDOWS, HEAD_TYPES, SPECIAL_GROUPS, HeadType, feature_names

logger = logging.getLogger(__name__)

Algorithm = Literal["kmeans", "gmm"]
ALGORITHMS: tuple[Algorithm, ...] = ("kmeans", "gmm")
NUM_SPECIAL = len(SPECIAL_GROUPS)

_SUFFIX = re.compile(r"^(?P<base>.+)_(?P<n>[0-9]+)$")


# --------------------------------------------------------------------------------------------
# Feature-space helpers
# --------------------------------------------------------------------------------------------


def num_features(num_windows: int) -> int:
    """Length of a head vector: ``num_windows`` windows, ``self`` and the special groups."""
    return num_windows + 1 + NUM_SPECIAL


def special_mass(X: ArrayLike, num_windows: int = DEFAULT_NUM_WINDOWS) -> NDArray[np.float64]:
    """``S = cls + sep + period + comma`` for each row of ``X`` ``(n, num_windows + 5)``."""
    X = np.asarray(X, dtype=np.float64)
    return X[..., num_windows + 1 :].sum(axis=-1)


def local_mass(X: ArrayLike, num_windows: int = DEFAULT_NUM_WINDOWS) -> NDArray[np.float64]:
    """``D = self + w0 + w1`` for each row of ``X`` (``self + w0`` when there is one window)."""
    X = np.asarray(X, dtype=np.float64)
    return X[..., num_windows] + X[..., : min(2, num_windows)].sum(axis=-1)


def check_features(X: ArrayLike, num_windows: int, *, name: str = "X") -> NDArray[np.float64]:
    """``X`` as a finite float64 array of shape ``(n >= 1, num_windows + 5)``, or a ValueError."""
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    arr = np.asarray(X, dtype=np.float64)
    d = num_features(num_windows)
    if arr.ndim != 2 or arr.shape[1] != d:
        raise ValueError(
            f"{name} must have shape (n_heads, {d}) for num_windows={num_windows} "
            f"({', '.join(feature_names(num_windows)[-6:])} last), got {arr.shape}"
        )
    if arr.shape[0] == 0:
        raise ValueError(f"{name} has no rows")
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).any(axis=1).sum())
        raise ValueError(f"{name} has non-finite values (NaN or inf) in {bad} row(s)")
    return arr


def canonical_order(X: NDArray[np.float64]) -> NDArray[np.intp]:
    """A row order that depends only on the rows' values, not on their input order.

    Stable sort on a fixed projection (cheap at ``10**6`` rows); if two distinct rows tie on it,
    a full lexicographic sort. Identical rows may stay in input order: they are interchangeable.
    """
    # A fixed, generic projection: irrational weights, no two columns alike. Summed column by
    # column (elementwise, fixed order) so a row's value never depends on its position, as a
    # BLAS matrix-vector product's blocking could make it.
    weights = np.sqrt(np.arange(2, X.shape[1] + 2, dtype=np.float64))
    proj = np.zeros(X.shape[0])  # (n,)
    for j, w in enumerate(weights):
        proj += X[:, j] * w
    order = np.argsort(proj, kind="stable")
    ps = proj[order]
    tie = ps[1:] == ps[:-1]
    if tie.any():
        i = np.flatnonzero(tie)
        if (X[order[i]] != X[order[i + 1]]).any():
            order = np.lexsort(X.T[::-1])
    return order


# --------------------------------------------------------------------------------------------
# Naming
# --------------------------------------------------------------------------------------------


def name_clusters(centroids: ArrayLike, num_windows: int = DEFAULT_NUM_WINDOWS) -> list[HeadType]:
    """Names of four centroids ``(4, num_windows + 5)`` by the SPEC rule (module docstring)."""
    C = check_features(centroids, num_windows, name="centroids")
    if C.shape[0] != len(HEAD_TYPES):
        raise ValueError(f"name_clusters needs exactly {len(HEAD_TYPES)} centroids, got {C.shape[0]}")
    S = special_mass(C, num_windows)
    D = local_mass(C, num_windows)
    names: list[HeadType | None] = [None] * 4
    rest = [0, 1, 2, 3]
    vertical = max(rest, key=lambda i: (S[i], -i))
    names[vertical] = "vertical"
    rest.remove(vertical)
    diagonal = max(rest, key=lambda i: (D[i], -i))
    names[diagonal] = "diagonal"
    rest.remove(diagonal)
    a, b = rest
    dense_vertical = a if S[a] >= S[b] else b
    names[dense_vertical] = "dense_vertical"
    names[b if dense_vertical == a else a] = "dense"
    return [n for n in names if n is not None]


def name_by_reference(
    centroids: ArrayLike, reference_centroids: ArrayLike, reference_names: Sequence[str]
) -> list[str]:
    """Name each centroid by its nearest reference centroid; duplicates get ``_2``, ``_3``, ...

    ``centroids`` ``(k, d)``, ``reference_centroids`` ``(m, d)`` with ``m`` unique
    ``reference_names``. The cluster nearest to a reference keeps the bare name. A reference name
    may not be another one plus ``_<number>`` (``x`` and ``x_2``): a split ``x`` would repeat it.
    """
    C = np.asarray(centroids, dtype=np.float64)
    R = np.asarray(reference_centroids, dtype=np.float64)
    if C.ndim != 2 or R.ndim != 2 or C.shape[1] != R.shape[1]:
        raise ValueError(f"centroids {C.shape} and reference_centroids {R.shape} must be 2-D with the same width")
    if len(reference_names) != R.shape[0] or len(set(reference_names)) != len(reference_names):
        raise ValueError(f"reference_names must be {R.shape[0]} unique names, got {list(reference_names)}")
    suffixed = [nm for nm in reference_names if (m := _SUFFIX.match(nm)) and m["base"] in reference_names]
    if suffixed:
        raise ValueError(f"reference_names {suffixed} repeat another reference name with a _<n> suffix")
    if not (np.isfinite(C).all() and np.isfinite(R).all()):
        raise ValueError("centroids and reference_centroids must be finite")
    dist = np.linalg.norm(C[:, None, :] - R[None, :, :], axis=-1)  # (k, m)
    nearest = dist.argmin(axis=1)  # (k,)
    names = [""] * C.shape[0]
    for r in np.unique(nearest):
        members = np.flatnonzero(nearest == r)
        members = members[np.lexsort((members, dist[members, r]))]
        for rank, i in enumerate(members):
            base = reference_names[r]
            names[i] = base if rank == 0 else f"{base}_{rank + 1}"
    return names


def base_type(name: str) -> HeadType | None:
    """The head type a cluster name stands for (``diagonal_2`` -> ``diagonal``), else ``None``."""
    if name in HEAD_TYPES:
        return name  # type: ignore[return-value]
    m = _SUFFIX.match(name)
    if m and m["base"] in HEAD_TYPES:
        return m["base"]  # type: ignore[return-value]
    return None


def _unnamed_order(C: NDArray[np.float64], num_windows: int) -> NDArray[np.intp]:
    """Order of clusters without a reference: decreasing S, decreasing D, then the values."""
    keys = [*C.T[::-1], -local_mass(C, num_windows), -special_mass(C, num_windows)]
    return np.lexsort(keys)


def _reference_order(names: Sequence[str], reference_names: Sequence[str]) -> NDArray[np.intp]:
    """Order of reference-named clusters: the reference's order, then the suffix number."""

    def key(name: str) -> tuple[int, int]:
        if name in reference_names:
            return reference_names.index(name), 1
        m = _SUFFIX.match(name)
        if m is None or m["base"] not in reference_names:
            raise ValueError(f"cluster name {name!r} is not one of {list(reference_names)} or a suffixed one")
        return reference_names.index(m["base"]), int(m["n"])

    return np.array(sorted(range(len(names)), key=lambda i: key(names[i])), dtype=np.intp)


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------


def _cluster_means(
    X: NDArray[np.float64], labels: NDArray[np.intp], k: int
) -> tuple[NDArray[np.float64], NDArray[np.intp]]:
    """Member means ``(k, d)`` and sizes ``(k,)``; empty clusters get NaN rows."""
    n = X.shape[0]
    sizes = np.bincount(labels, minlength=k)
    onehot = sparse.csr_matrix((np.ones(n), (labels, np.arange(n))), shape=(k, n))  # (k, n)
    sums = np.asarray(onehot @ X)  # (k, d)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / sizes[:, None]
    return means, sizes


# Below this many heads, one OpenMP/BLAS thread: threads cannot save more than milliseconds,
# and on a busy machine they cost seconds (1e3 heads, K-means with n_init=10 on a loaded
# 2-core box: 1.6 s with 2 threads, 0.01 s with one).
SINGLE_THREAD_BELOW = 20_000


def thread_limit(n_threads: int | None, n_rows: int) -> int | None:
    """Thread limit for fitting ``n_rows`` heads (``None``: no limit); see ``SINGLE_THREAD_BELOW``."""
    if n_threads is not None:
        return n_threads
    return 1 if n_rows < SINGLE_THREAD_BELOW else None


class HeadClusterer(ClusterMixin, BaseEstimator):
    """K-means or Gaussian-mixture clustering of head vectors, with canonical, named clusters.

    Parameters
    ----------
    algorithm : ``"kmeans"`` or ``"gmm"``.
    n_clusters : number of clusters ``k`` (``2 <= k <= n_heads``).
    random_state : seed of the fit (int, stored with the clustering).
    n_init : K-means restarts; the lowest inertia is kept (for ``gmm``, it is the EM start).
    num_windows : ``N``; ``X`` has ``N + 5`` columns.
    max_iter, tol : passed to the sklearn estimator.
    n_threads : OpenMP/BLAS threads for fitting and predicting; ``None``: one below
        ``SINGLE_THREAD_BELOW`` (20 000) heads, the libraries' default (all cores) above.

    Attributes
    ----------
    labels_ : ``(n,)`` canonical cluster id of each head.
    centroids_ : ``(k, d)`` mean of each cluster's members, rows in id order.
    names_ : ``k`` unique names (module docstring), in id order.
    types_ : ``k`` head types (:func:`base_type` of each name, ``None`` for ``cluster_<i>``).
    sizes_ : ``(k,)`` members per cluster; ``shares_`` ``(k,)`` the fraction of heads.
    inertia_ : sum of squared distances of heads to their ``centroids_`` row.
    log_likelihood_ : mean per-head log-likelihood (``gmm``), ``None`` for ``kmeans``.
    n_iter_ : iterations of the kept run.
    reference_centroids_, reference_names_ : the ``k = 4`` reference used for naming when
        ``k != 4`` (``None`` otherwise or where none exists).
    model_ : the fitted sklearn estimator (its own label ids are not canonical).
    n_features_in_ : ``num_windows + 5``.
    """

    def __init__(
        self,
        *,
        algorithm: Algorithm = "kmeans",
        n_clusters: int = 4,
        random_state: int = 0,
        n_init: int = 10,
        num_windows: int = DEFAULT_NUM_WINDOWS,
        max_iter: int = 300,
        tol: float = 1e-4,
        n_threads: int | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.n_clusters = n_clusters
        self.random_state = random_state
        self.n_init = n_init
        self.num_windows = num_windows
        self.max_iter = max_iter
        self.tol = tol
        self.n_threads = n_threads

    # -- fitting ------------------------------------------------------------------------------

    def _check_params(self, n_heads: int) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if int(self.n_clusters) != self.n_clusters or self.n_clusters < 2:
            raise ValueError(f"n_clusters must be an integer >= 2, got {self.n_clusters}")
        if self.n_clusters > n_heads:
            raise ValueError(f"n_clusters={self.n_clusters} is more than the {n_heads} heads in X")
        if self.n_init < 1:
            raise ValueError(f"n_init must be >= 1, got {self.n_init}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1 or None, got {self.n_threads}")
        if not isinstance(self.random_state, int | np.integer):
            raise ValueError(f"random_state must be an int (stored with the run), got {self.random_state!r}")

    def _kmeans(self) -> KMeans:
        return KMeans(
            n_clusters=int(self.n_clusters),
            init="k-means++",
            n_init=self.n_init,
            max_iter=self.max_iter,
            tol=self.tol,
            algorithm="lloyd",
            random_state=self.random_state,
        )

    def _gmm(self, Xs: NDArray[np.float64], km_labels: NDArray[np.intp]) -> GaussianMixture:
        """A diagonal mixture started from the K-means clusters (weights, means, variances)."""
        k = int(self.n_clusters)
        means, sizes = _cluster_means(Xs, km_labels, k)
        sq, _ = _cluster_means(Xs * Xs, km_labels, k)
        reg_covar = 1e-6
        var = np.maximum(sq - means * means, 0.0) + reg_covar  # (k, d)
        return GaussianMixture(
            n_components=k,
            covariance_type="diag",
            reg_covar=reg_covar,
            weights_init=sizes / sizes.sum(),
            means_init=means,
            precisions_init=1.0 / var,
            # Overridden by the *_init above (scikit-learn 1.9 skips its initialisation when all
            # three are given); "random_from_data" kept so that older releases run no second,
            # discarded K-means.
            init_params="random_from_data",
            n_init=1,
            max_iter=self.max_iter,
            tol=self.tol,
            random_state=self.random_state,
        )

    def fit(
        self,
        X: ArrayLike,
        y: None = None,
        *,
        reference_centroids: ArrayLike | None = None,
        reference_names: Sequence[str] | None = None,
    ) -> HeadClusterer:
        """Cluster ``X`` ``(n_heads, num_windows + 5)``.

        ``reference_centroids`` ``(m, d)`` with ``reference_names`` name the clusters when
        ``n_clusters != 4`` instead of fitting a ``k = 4`` reference on ``X`` (ignored for
        ``k = 4``, which always uses the SPEC rule).
        """
        X = check_features(X, self.num_windows)
        n, d = X.shape
        self._check_params(n)
        k = int(self.n_clusters)
        if (reference_centroids is None) != (reference_names is None):
            raise ValueError("pass reference_centroids and reference_names together")

        order = canonical_order(X)
        Xs = X[order]
        with threadpool_limits(limits=thread_limit(self.n_threads, n)):
            model, raw_sorted = self._fit_model(Xs)  # raw_sorted (n,): sklearn ids, canonical row order
        raw = np.empty(n, dtype=np.intp)
        raw[order] = raw_sorted
        # Sums in canonical row order too, so permuted input gives bit-identical centroids.
        means, sizes = _cluster_means(Xs, raw_sorted, k)
        if (sizes == 0).any():
            if isinstance(model, KMeans):
                raise ValueError(
                    f"X has fewer than n_clusters={k} distinct head vectors "
                    f"(K-means found {int((sizes > 0).sum())} clusters)"
                )
            empty = np.flatnonzero(sizes == 0)
            logger.warning("GMM components %s got no heads; their centroid is the component mean", empty)
            means[empty] = model.means_[empty]

        # Names and canonical ids.
        self.reference_centroids_: NDArray[np.float64] | None = None
        self.reference_names_: list[str] | None = None
        if k == len(HEAD_TYPES):
            raw_names: list[str] = list(name_clusters(means, self.num_windows))
            perm = np.array([raw_names.index(t) for t in HEAD_TYPES], dtype=np.intp)
        else:
            ref = self._reference(X, reference_centroids, reference_names)
            if ref is None:
                perm = _unnamed_order(means, self.num_windows)
                raw_names = [""] * k
                for new, old in enumerate(perm):
                    raw_names[old] = f"cluster_{new}"
            else:
                self.reference_centroids_, self.reference_names_ = ref
                raw_names = name_by_reference(means, *ref)
                perm = _reference_order(raw_names, ref[1])
        # perm[new_id] = sklearn id; inverse maps sklearn ids to canonical ids.
        inverse = np.empty(k, dtype=np.intp)
        inverse[perm] = np.arange(k)

        self.model_ = model
        self._inverse = inverse
        self.n_features_in_ = d
        self.labels_ = inverse[raw]
        self.centroids_ = means[perm]
        self.sizes_ = sizes[perm]
        self.shares_ = self.sizes_ / n
        self.names_ = [raw_names[i] for i in perm]
        self.types_ = [base_type(name) for name in self.names_]
        diff = Xs - self.centroids_[inverse[raw_sorted]]
        self.inertia_ = float(np.einsum("ij,ij->", diff, diff))
        self.log_likelihood_: float | None = None
        if isinstance(model, GaussianMixture):
            with threadpool_limits(limits=thread_limit(self.n_threads, n)):
                self.log_likelihood_ = float(model.score(Xs))
        self.n_iter_ = int(model.n_iter_)
        logger.info(
            "%s k=%d on %d heads: %s",
            self.algorithm,
            k,
            n,
            ", ".join(f"{nm} {s:.1%}" for nm, s in zip(self.names_, self.shares_, strict=True)),
        )
        return self

    def _fit_model(self, Xs: NDArray[np.float64]) -> tuple[KMeans | GaussianMixture, NDArray[np.intp]]:
        """Fit on the canonically ordered rows; sklearn's convergence warnings go to the log."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            model: KMeans | GaussianMixture = self._kmeans().fit(Xs)
            labels = np.asarray(model.labels_, dtype=np.intp)
            if self.algorithm == "gmm" and np.bincount(labels, minlength=self.n_clusters).all():
                model = self._gmm(Xs, labels).fit(Xs)
                labels = np.asarray(model.predict(Xs), dtype=np.intp)
        for w in caught:
            if issubclass(w.category, ConvergenceWarning):
                logger.warning("%s: %s", self.algorithm, w.message)
            else:  # not ours to swallow
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return model, labels

    def _reference(
        self,
        X: NDArray[np.float64],
        reference_centroids: ArrayLike | None,
        reference_names: Sequence[str] | None,
    ) -> tuple[NDArray[np.float64], list[str]] | None:
        """The ``k = 4`` reference for naming, passed in or fitted on ``X``; ``None`` if none exists."""
        if reference_centroids is not None and reference_names is not None:
            R = check_features(reference_centroids, self.num_windows, name="reference_centroids")
            return R, list(reference_names)
        if X.shape[0] < len(HEAD_TYPES):
            logger.info("fewer than 4 heads: no k=4 reference, clusters are named cluster_<i>")
            return None
        params = {**self.get_params(), "n_clusters": len(HEAD_TYPES)}
        try:
            ref = HeadClusterer(**params).fit(X)
        except ValueError as err:  # fewer than 4 distinct heads
            logger.info("no k=4 reference (%s): clusters are named cluster_<i>", err)
            return None
        return ref.centroids_, list(ref.names_)

    # -- using a fit --------------------------------------------------------------------------

    def predict(self, X: ArrayLike) -> NDArray[np.intp]:
        """Canonical cluster id of each row of ``X`` (nearest centre / most probable component)."""
        if not hasattr(self, "model_"):
            raise ValueError("this HeadClusterer is not fitted yet; call fit first")
        X = check_features(X, self.num_windows)
        with threadpool_limits(limits=thread_limit(self.n_threads, X.shape[0])):
            raw = np.asarray(self.model_.predict(X), dtype=np.intp)
        return self._inverse[raw]

    def predict_names(self, X: ArrayLike) -> list[str]:
        """Cluster name of each row of ``X``."""
        return [self.names_[i] for i in self.predict(X)]


def margins(X: ArrayLike, centroids: ArrayLike, labels: ArrayLike) -> NDArray[np.float64]:
    """How far each head sits from the border of its cluster: ``(n,)`` in ``[-1, 1]``.

    ``d1`` is the Euclidean distance of the head to its own cluster's centroid (``labels``),
    ``d2`` the distance to the nearest *other* centroid; the margin is
    ``(d2 - d1) / max(d1, d2)`` (0 where both are 0). A head exactly between its centroid and
    another has margin 0; one on its centroid has margin 1. Where the head's centroid is its
    nearest (always for K-means, whose labels are the nearest centre), this is
    ``(d2 - d1) / d2 = 1 - d1 / d2`` in ``[0, 1]``; it is negative only when the label is not
    the nearest centroid (a Gaussian mixture can give a head to a wider component), and says so.
    """
    arr = np.asarray(X, dtype=np.float64)
    C = np.asarray(centroids, dtype=np.float64)
    lab = np.asarray(labels)
    if arr.ndim != 2 or C.ndim != 2 or arr.shape[1] != C.shape[1]:
        raise ValueError(f"X {arr.shape} and centroids {C.shape} must be 2-D with the same width")
    if C.shape[0] < 2:
        raise ValueError(f"a margin needs at least 2 centroids, got {C.shape[0]}")
    if lab.shape != (arr.shape[0],) or (lab.size and (lab.min() < 0 or lab.max() >= C.shape[0])):
        raise ValueError(f"labels must be ({arr.shape[0]},) ids in [0, {C.shape[0]})")
    lab = lab.astype(np.intp)
    dist = np.linalg.norm(arr[:, None, :] - C[None, :, :], axis=-1)  # (n, k)
    rows = np.arange(arr.shape[0])
    d1 = dist[rows, lab]
    dist[rows, lab] = np.inf
    d2 = dist.min(axis=1)
    top = np.maximum(d1, d2)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(top > 0, (d2 - d1) / np.where(top > 0, top, 1.0), 0.0)
    return out


# --------------------------------------------------------------------------------------------
# Groups (joint fits over several models) and t-SNE
# --------------------------------------------------------------------------------------------


def shares_by_group(labels: ArrayLike, groups: ArrayLike, k: int) -> tuple[NDArray[np.generic], NDArray[np.float64]]:
    """Per-group cluster shares of a joint fit.

    ``labels`` ``(n,)`` ids in ``[0, k)``, ``groups`` ``(n,)`` any sortable keys (e.g. model
    names). Returns ``(keys, shares)``: the sorted unique groups ``(g,)`` and ``shares`` ``(g, k)``,
    each row the fraction of that group's heads in each cluster (rows sum to 1).
    """
    lab = np.asarray(labels)
    grp = np.asarray(groups)
    if lab.ndim != 1 or grp.shape != lab.shape:
        raise ValueError(f"labels {lab.shape} and groups {grp.shape} must be 1-D of the same length")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if lab.size and (not np.issubdtype(lab.dtype, np.integer) or lab.min() < 0 or lab.max() >= k):
        raise ValueError(f"labels must be integers in [0, {k})")
    keys, g = np.unique(grp, return_inverse=True)
    counts = np.zeros((keys.size, k), dtype=np.float64)
    np.add.at(counts, (g, lab.astype(np.intp)), 1.0)
    return keys, counts / counts.sum(axis=1, keepdims=True)


def tsne_embedding(
    X: ArrayLike,
    *,
    random_state: int = 0,
    max_points: int = 5000,
    out_of_sample: Literal["knn", "nan"] = "knn",
    n_neighbors: int = 5,
) -> NDArray[np.float64]:
    """2-D t-SNE of head vectors ``X`` ``(n, d)`` -> ``(n, 2)``.

    Perplexity ``min(30, (n - 1) / 3)`` (always below ``n``), PCA initialisation. For
    ``n > max_points``, t-SNE runs on a seeded random subsample of ``max_points`` heads and the
    others get the mean embedding of their ``n_neighbors`` nearest embedded heads in feature
    space (``"knn"``) or NaN (``"nan"``); see the module docstring. ``n = 1`` gives ``[[0, 0]]``.
    """
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"X must be a non-empty 2-D array, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("X has non-finite values")
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    if out_of_sample not in ("knn", "nan"):
        raise ValueError(f"out_of_sample must be 'knn' or 'nan', got {out_of_sample!r}")
    n = arr.shape[0]
    if n == 1:
        return np.zeros((1, 2))
    rng = np.random.default_rng(random_state)
    sample = np.arange(n) if n <= max_points else np.sort(rng.choice(n, size=max_points, replace=False))
    m = sample.size
    tsne = TSNE(
        n_components=2,
        perplexity=min(30.0, (m - 1) / 3),
        init="pca",
        learning_rate="auto",
        random_state=random_state,
    )
    # Small embeddings: OpenMP threads cost more than they save (30 heads, busy 2-core box:
    # 9 s with 2 threads, 0.15 s with one).
    with threadpool_limits(limits=1 if m <= 2000 else None, user_api="openmp"):
        emb = tsne.fit_transform(arr[sample])  # (m, 2)
    if m == n:
        return np.asarray(emb, dtype=np.float64)
    out = np.full((n, 2), np.nan)
    out[sample] = emb
    if out_of_sample == "knn":
        rest = np.setdiff1d(np.arange(n), sample, assume_unique=True)
        nn = NearestNeighbors(n_neighbors=min(n_neighbors, m)).fit(arr[sample])
        idx = nn.kneighbors(arr[rest], return_distance=False)  # (n - m, n_neighbors)
        out[rest] = emb[idx].mean(axis=1)
    logger.info("t-SNE on %d of %d heads; the rest %s", m, n, "placed by k-NN" if out_of_sample == "knn" else "NaN")
    return out


# --------------------------------------------------------------------------------------------
# Synthetic head vectors (tests and benchmarks), in the manner of sklearn.datasets.make_blobs
# --------------------------------------------------------------------------------------------


def prototype_profiles(num_windows: int = DEFAULT_NUM_WINDOWS) -> NDArray[np.float64]:
    """Four idealised head vectors ``(4, num_windows + 5)``, rows in :data:`HEAD_TYPES` order.

    ``dense``: mass spread over the windows as uniform attention would put it (triangular in the
    distance), little on special tokens; ``diagonal``: mostly ``self`` and ``w0``; ``vertical``:
    mostly ``[CLS]``/``[SEP]``; ``dense_vertical``: half dense, half vertical. Rows sum to 1.
    """
    N = num_windows
    tri = 2.0 * (1.0 - (np.arange(N) + 0.5) / N)
    tri /= tri.sum()
    special = np.array([0.35, 0.45, 0.15, 0.05])  # cls, sep, period, comma

    def row(windows: NDArray[np.float64], self_: float, spec: NDArray[np.float64]) -> NDArray[np.float64]:
        r = np.concatenate([windows, [self_], spec])
        return r / r.sum()

    dense = row(0.86 * tri, 0.02, 0.12 * special)
    local = np.zeros(N)
    local[0] = 0.62
    if N > 1:
        local[1] = 0.08
    local += 0.08 * tri
    diagonal = row(local, 0.17, 0.05 * special)
    vertical = row(0.06 * tri, 0.02, 0.92 * special)
    dense_vertical = row(0.5 * tri, 0.02, 0.48 * special)
    by_name = {"dense": dense, "diagonal": diagonal, "dense_vertical": dense_vertical, "vertical": vertical}
    return np.stack([by_name[t] for t in HEAD_TYPES])


def make_head_features(
    n_heads: int,
    *,
    num_windows: int = DEFAULT_NUM_WINDOWS,
    concentration: float = 60.0,
    mixing: float = 0.1,
    weights: ArrayLike | None = None,
    random_state: int = 0,
) -> tuple[NDArray[np.float64], NDArray[np.intp]]:
    """Synthetic head vectors around :func:`prototype_profiles`: ``(X (n, d), true type ids (n,))``.

    Each head draws a type (``weights``, default equal), moves its prototype towards a random
    other prototype by ``Beta(1, 1/mixing - 1)`` (mean ``mixing``; 0 disables), then draws its
    vector from a Dirichlet with that mean and ``concentration``. Rows lie on the simplex.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    if not 0.0 <= mixing < 1.0:
        raise ValueError(f"mixing must be in [0, 1), got {mixing}")
    rng = np.random.default_rng(random_state)
    P = prototype_profiles(num_windows)  # (4, d)
    k = P.shape[0]
    p = np.full(k, 1.0 / k) if weights is None else np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    types = rng.choice(k, size=n_heads, p=p).astype(np.intp)
    mean = P[types]
    if mixing > 0:
        other = (types + rng.integers(1, k, size=n_heads)) % k
        lam = rng.beta(1.0, 1.0 / mixing - 1.0, size=n_heads)[:, None]
        mean = (1 - lam) * mean + lam * P[other]
    alpha = concentration * mean + 0.02  # (n, d); the floor keeps every feature possible
    g = rng.gamma(alpha)
    return g / g.sum(axis=1, keepdims=True), types
