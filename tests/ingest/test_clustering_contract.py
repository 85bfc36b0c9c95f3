"""Head-type clustering: the contract line by line (issue 14, the mutants of ``ingest/clustering.py``).

Every expectation is either derived by hand in the test (feature vectors built from binary
fractions, so sums and ties are exact) or computed by scikit-learn / numpy called directly here.
"""

from __future__ import annotations

import inspect
import re
import warnings

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.manifold import TSNE
from sklearn.mixture import GaussianMixture
from threadpoolctl import threadpool_limits

import ingest.clustering as clustering
from ingest.clustering import (
    HeadClusterer,
    canonical_order,
    check_features,
    local_mass,
    make_head_features,
    name_by_reference,
    name_clusters,
    prototype_profiles,
    shares_by_group,
    special_mass,
    thread_limit,
    tsne_embedding,
)
from ingest.types import HEAD_TYPES

# Two windows: columns w0, w1, self, cls, sep, period, comma.
W2 = 2


def row2(w0: float = 0, w1: float = 0, self_: float = 0, cls: float = 0, sep: float = 0, period: float = 0,
         comma: float = 0) -> list[float]:  # fmt: skip
    return [w0, w1, self_, cls, sep, period, comma]


def random_heads(n: int, d: int, seed: int) -> np.ndarray:
    """Heads without cluster structure, so a fit depends on every parameter (seed, restarts, ...)."""
    return np.random.default_rng(seed).dirichlet(np.ones(d), size=n)


def member_means(X: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    return np.stack([X[labels == j].mean(axis=0) for j in range(k)])


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Two labelings are the same partition (up to renaming the ids)."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


# -- feature-space helpers ----------------------------------------------------------------------


def test_special_and_local_mass_by_hand() -> None:
    # num_windows=3: w0 w1 w2 self cls sep period comma, powers of two so every sum is unique.
    X = np.array([[1, 2, 4, 8, 16, 32, 64, 128], [0, 0, 0, 0, 0, 0, 0, 1]])  # integers
    S = special_mass(X, num_windows=3)
    D = local_mass(X, num_windows=3)
    assert S.dtype == D.dtype == np.float64
    np.testing.assert_array_equal(S, [16 + 32 + 64 + 128, 1])  # cls + sep + period + comma
    np.testing.assert_array_equal(D, [8 + 1 + 2, 0])  # self + w0 + w1, not w2
    # One head vector alone (1-D) gives a scalar.
    assert special_mass(X[0], num_windows=3) == 240
    assert local_mass(X[0], num_windows=3) == 11
    # One window: D = self + w0.
    assert local_mass([1, 8, 16, 32, 64, 128], num_windows=1) == 9


def test_check_features_converts_and_accepts_one_window() -> None:
    arr = check_features(np.ones((2, 6), dtype=np.int64), num_windows=1)
    assert arr.dtype == np.float64
    assert arr.shape == (2, 6)


def test_check_features_messages_name_the_field() -> None:
    with pytest.raises(
        ValueError,
        match=r"^X must have shape \(n_heads, 7\) for num_windows=2 \(w1, self, cls, sep, period, comma last\), "
        r"got \(3, 6\)$",
    ):
        check_features(np.zeros((3, 6)), num_windows=2)
    with pytest.raises(ValueError, match="^X has no rows$"):
        check_features(np.zeros((0, 7)), num_windows=2)
    X = np.full((10, 7), 0.1)
    X[2, [0, 4]] = np.nan  # two bad values, one row
    X[5, 1] = np.inf
    with pytest.raises(ValueError, match=r"^X has non-finite values \(NaN or inf\) in 2 row\(s\)$"):
        check_features(X, num_windows=2)


# -- canonical order ----------------------------------------------------------------------------


def test_canonical_order_sorts_by_the_fixed_projection() -> None:
    # Weights sqrt(2), sqrt(3), sqrt(4) = 2: a -> 1.414, b -> 0.84 * 1.732 = 1.455, c -> 0.75 * 2 = 1.5.
    a, b, c = [1.0, 0.0, 0.0], [0.0, 0.84, 0.0], [0.0, 0.0, 0.75]
    np.testing.assert_array_equal(canonical_order(np.array([c, a, b])), [1, 2, 0])
    # Ties between identical rows keep the projection order (no lexicographic sort): [0, 1] -> sqrt 3 last.
    np.testing.assert_array_equal(canonical_order(np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])), [1, 2, 0])


def test_canonical_order_breaks_ties_between_distinct_rows_lexicographically() -> None:
    # 2**60 * sqrt(5) absorbs sqrt(2) and sqrt(3) (its float spacing is 512): r1 and r2 tie on the
    # projection but differ; r0 projects lower. Lexicographic, first column first: r0 < r2 < r1.
    big = 2.0**60
    r0, r1, r2 = [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, big], [0.0, 1.0, 0.0, big]
    np.testing.assert_array_equal(canonical_order(np.array([r1, r0, r2])), [1, 2, 0])
    np.testing.assert_array_equal(canonical_order(np.array([r2, r1, r0])), [2, 0, 1])


# -- naming -------------------------------------------------------------------------------------


def test_name_clusters_ties_go_to_the_lower_index() -> None:
    C = [
        row2(w0=0.5, cls=0.5),  # S .5, D .5: ties 1 on S -> vertical (lower index)
        row2(self_=0.5, sep=0.5),  # S .5, D .5 -> of the last two, higher S -> dense_vertical
        row2(w0=0.25, w1=0.5, cls=0.25),  # S .25, D .75: ties 3 on D -> diagonal
        row2(self_=0.75, comma=0.25),  # S .25, D .75 -> dense
    ]
    assert name_clusters(C, num_windows=W2) == ["vertical", "dense_vertical", "diagonal", "dense"]
    C = [
        row2(cls=0.5, sep=0.5),  # S 1 -> vertical
        row2(self_=1.0),  # D 1 -> diagonal
        row2(w0=0.25, w1=0.5, cls=0.25),  # S .25: ties 3 -> dense_vertical (lower index)
        row2(w0=0.25, w1=0.5, period=0.25),  # S .25 -> dense
    ]
    assert name_clusters(C, num_windows=W2) == ["vertical", "diagonal", "dense_vertical", "dense"]


def test_name_clusters_messages() -> None:
    with pytest.raises(ValueError, match=r"^centroids must have shape \(n_heads, 7\)"):
        name_clusters(np.zeros((4, 6)), num_windows=W2)
    with pytest.raises(ValueError, match="^name_clusters needs exactly 4 centroids, got 3$"):
        name_clusters(np.zeros((3, 7)), num_windows=W2)


def test_name_by_reference_validation() -> None:
    names = ["dense", "diagonal", "vertical"]
    with pytest.raises(ValueError, match="must be 2-D with the same width"):
        name_by_reference(np.zeros(3), np.eye(3), names)
    with pytest.raises(ValueError, match=r"^reference_names must be 2 unique names, got \['dense', 'diagonal', "):
        name_by_reference(np.eye(3), np.eye(3)[:2], names)
    # Bug found here: "x" and "x_2" as references gave a split "x" the names x, x_2 and the
    # "x_2" cluster x_2 as well (names must be unique); such references are now rejected.
    C = np.array([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [1.0, 1.0, 1.0]])
    R = np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    with pytest.raises(
        ValueError, match=r"^reference_names \['x_2'\] repeat another reference name with a _<n> suffix$"
    ):
        name_by_reference(C, R, ["x", "x_2"])
    assert name_by_reference(C, R, ["ref_0", "ref_1"]) == ["ref_0", "ref_0_2", "ref_1"]  # stability's names
    bad = np.eye(3)
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="^centroids and reference_centroids must be finite$"):
        name_by_reference(bad, np.eye(3), names)
    with pytest.raises(ValueError, match="^centroids and reference_centroids must be finite$"):
        name_by_reference(np.eye(3), bad, names)


# -- fitting: hand-built clusters ---------------------------------------------------------------


def four_groups() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Four tight groups of three heads (2 windows); their SPEC names by hand."""
    centres = np.array([
        row2(w0=0.25, w1=0.25, cls=0.25, sep=0.25),  # S .5  D .5  -> dense_vertical
        row2(w0=0.5, w1=0.25, self_=0.25),  # S 0  D 1   -> diagonal
        row2(cls=0.5, sep=0.5),  # S 1  D 0   -> vertical
        row2(w0=0.5, w1=0.25, cls=0.25),  # S .25 D .75 -> dense
    ])  # fmt: skip
    offsets = np.array([[0.01, -0.01, 0, 0, 0, 0, 0], [-0.01, 0.01, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    X = (centres[:, None, :] + offsets[None]).reshape(12, 7)
    return X, np.repeat(np.arange(4), 3), ["dense_vertical", "diagonal", "vertical", "dense"]


def test_k4_fit_on_two_windows_by_hand() -> None:
    X, group, names = four_groups()
    c = HeadClusterer(n_init=2, num_windows=W2).fit(X)
    # Ids are HEAD_TYPES positions; each group is one cluster with the name derived above.
    expected_labels = np.array([HEAD_TYPES.index(names[g]) for g in group])
    np.testing.assert_array_equal(c.labels_, expected_labels)
    assert c.names_ == list(HEAD_TYPES)
    means = member_means(X, expected_labels, 4)
    np.testing.assert_allclose(c.centroids_, means, rtol=0, atol=1e-15)
    assert c.inertia_ == pytest.approx(((X - means[expected_labels]) ** 2).sum(), rel=1e-12)
    np.testing.assert_array_equal(c.sizes_, [3, 3, 3, 3])
    assert c.n_features_in_ == 7
    assert c.reference_names_ is None
    assert c.reference_centroids_ is None


def test_no_reference_order_decreasing_s_then_d_then_first_columns() -> None:
    # num_windows=3 (w0 w1 w2 self cls sep period comma); three heads, so no k = 4 reference.
    hA = [0.25, 0.0, 0.0, 0.25, 0.5, 0.0, 0.0, 0.0]  # S .5, D .5, w0 .25
    hB = [0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0]  # S .5, D .5, w0 0 -> before hA
    hC = [0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0]  # S .5, D 0 (w2 is not local) -> last
    X = np.array([hA, hC, hB])
    c = HeadClusterer(n_clusters=3, n_init=2, num_windows=3).fit(X)
    assert c.names_ == ["cluster_0", "cluster_1", "cluster_2"]
    assert c.reference_names_ is None
    np.testing.assert_array_equal(c.centroids_, [hB, hA, hC])
    np.testing.assert_array_equal(c.labels_, [1, 2, 0])
    # Higher S first even against a higher D.
    hD = [0.25, 0.25, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0]  # S .25, D .75
    c = HeadClusterer(n_clusters=2, n_init=2, num_windows=3).fit(np.array([hD, hA]))
    np.testing.assert_array_equal(c.centroids_, [hA, hD])


def test_four_distinct_heads_are_enough_for_a_reference() -> None:
    P = prototype_profiles(W2)  # rows in HEAD_TYPES order, they name themselves (test_clustering.py)
    c = HeadClusterer(n_clusters=3, n_init=2, num_windows=W2).fit(P)
    assert c.reference_names_ == list(HEAD_TYPES)
    assert c.reference_centroids_ is not None
    np.testing.assert_array_equal(c.reference_centroids_, P)
    assert all(name.split("_")[0] in {"dense", "diagonal", "vertical"} for name in c.names_)


def test_split_types_ids_follow_reference_then_suffix() -> None:
    # Five tight groups, a reference of two centroids; distances by hand (Euclidean, 7 columns).
    Rv = row2(cls=0.5, sep=0.5)
    Rd = row2(w0=0.5, self_=0.5)
    groups = {
        "vertical": row2(cls=0.5, sep=0.5),  # distance 0 to Rv
        "vertical_2": row2(cls=0.75, sep=0.25),  # 0.354 to Rv
        "diagonal": row2(w0=0.5, self_=0.5),  # 0 to Rd
        "diagonal_2": row2(w0=0.75, self_=0.25),  # 0.354 to Rd
        "diagonal_3": row2(w0=1.0),  # 0.707 to Rd
    }
    expected = ["vertical", "vertical_2", "diagonal", "diagonal_2", "diagonal_3"]
    centres = np.array([groups[n] for n in expected])
    offsets = np.array([[0.005, -0.005, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    for seed in range(4):
        order = np.random.default_rng(seed).permutation(5)
        X = (centres[order][:, None, :] + offsets[None]).reshape(10, 7)
        c = HeadClusterer(n_clusters=5, n_init=2, num_windows=W2, random_state=seed).fit(
            X, reference_centroids=[Rv, Rd], reference_names=["vertical", "diagonal"]
        )
        assert c.names_ == expected
        np.testing.assert_allclose(c.centroids_, centres + offsets.mean(axis=0), atol=1e-15)
        np.testing.assert_array_equal(c.labels_, np.repeat(order, 2))


# -- fitting: scikit-learn as the reference -----------------------------------------------------


@pytest.mark.parametrize(("max_iter", "tol", "seed"), [(2, 1e-4, 5), (300, 0.5, 6)])
def test_kmeans_is_sklearn_kmeans_on_canonical_rows(max_iter: int, tol: float, seed: int) -> None:
    X = random_heads(60, 7, seed=seed)
    c = HeadClusterer(n_clusters=3, n_init=3, max_iter=max_iter, tol=tol, random_state=seed, num_windows=W2).fit(X)
    order = canonical_order(X)
    with threadpool_limits(limits=1):  # as headcat at this size: fast on a busy machine, and fork-safe
        km = KMeans(n_clusters=3, init="k-means++", n_init=3, max_iter=max_iter, tol=tol, random_state=seed)
        km.fit(X[order])
    labels = np.empty(len(X), dtype=np.intp)
    labels[order] = km.labels_
    assert same_partition(c.labels_, labels)
    assert c.n_iter_ == km.n_iter_
    means = member_means(X, c.labels_, 3)
    np.testing.assert_allclose(c.centroids_, means, rtol=1e-12)
    assert c.inertia_ == pytest.approx(((X - means[c.labels_]) ** 2).sum(), rel=1e-12)


def test_defaults_are_the_documented_ones() -> None:
    assert HeadClusterer().get_params() == {
        "algorithm": "kmeans",
        "n_clusters": 4,
        "random_state": 0,
        "n_init": 10,
        "num_windows": 16,
        "max_iter": 300,
        "tol": 1e-4,
        "n_threads": None,
    }


def reference_gmm(Xs: np.ndarray, k: int, n_init: int, max_iter: int, tol: float, seed: int) -> GaussianMixture:
    """Diagonal GMM started from the K-means member weights, means and variances (+ 1e-6), by hand."""
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        km = KMeans(n_clusters=k, n_init=n_init, max_iter=max_iter, tol=tol, random_state=seed).fit(Xs)
        lab = km.labels_
        weights = np.array([(lab == j).mean() for j in range(k)])
        means = np.stack([Xs[lab == j].mean(axis=0) for j in range(k)])
        var = np.stack([Xs[lab == j].var(axis=0) for j in range(k)]) + 1e-6
        return GaussianMixture(
            n_components=k,
            covariance_type="diag",
            reg_covar=1e-6,
            weights_init=weights,
            means_init=means,
            precisions_init=1.0 / var,
            max_iter=max_iter,
            tol=tol,
        ).fit(Xs)


@pytest.mark.parametrize(("max_iter", "tol"), [(3, 1e-4), (300, 1e-9)])
def test_gmm_is_a_diagonal_mixture_started_from_kmeans(max_iter: int, tol: float) -> None:
    X = random_heads(60, 7, seed=11)
    c = HeadClusterer(algorithm="gmm", n_clusters=3, n_init=2, max_iter=max_iter, tol=tol, random_state=4,
                      num_windows=W2).fit(X)  # fmt: skip
    Xs = X[canonical_order(X)]
    ref = reference_gmm(Xs, 3, n_init=2, max_iter=max_iter, tol=tol, seed=4)
    assert c.n_iter_ == ref.n_iter_
    np.testing.assert_allclose(c.model_.means_, ref.means_, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c.model_.precisions_, ref.precisions_, rtol=1e-9)
    np.testing.assert_allclose(c.model_.weights_, ref.weights_, rtol=1e-9)
    assert c.log_likelihood_ == pytest.approx(ref.score(Xs), rel=1e-9)
    assert same_partition(c.predict(X), ref.predict(X))


class _NoLastComponent(GaussianMixture):
    """A mixture whose hard assignment never picks its last component (so that component is empty)."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        proba = self.predict_proba(X)
        proba[:, -1] = -1.0
        return proba.argmax(axis=1)


def test_empty_gmm_component_gets_its_mean_as_centroid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clustering, "GaussianMixture", _NoLastComponent)
    X = random_heads(40, 7, seed=2)
    c = HeadClusterer(algorithm="gmm", n_clusters=4, n_init=2, num_windows=W2).fit(X)
    empty = np.flatnonzero(c.sizes_ == 0)
    assert empty.size == 1
    np.testing.assert_array_equal(c.centroids_[empty[0]], c.model_.means_[-1])
    full = np.flatnonzero(c.sizes_ > 0)
    for j in full:
        np.testing.assert_allclose(c.centroids_[j], X[c.labels_ == j].mean(axis=0), rtol=1e-12)
    assert c.shares_[empty[0]] == 0


class ProbeWarning(UserWarning):
    """A warning from outside scikit-learn, raised inside a fit."""


def test_other_warnings_pass_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    class WarningKMeans(KMeans):
        def fit(self, X: np.ndarray, y: object = None, sample_weight: object = None) -> KMeans:
            warnings.warn_explicit("probe message", ProbeWarning, "probe_file.py", 7)
            return super().fit(X, y, sample_weight)

    monkeypatch.setattr(clustering, "KMeans", WarningKMeans)
    X, _, _ = four_groups()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HeadClusterer(n_init=2, num_windows=W2).fit(X)
    probes = [w for w in caught if w.category is ProbeWarning]
    assert len(probes) == 1
    assert str(probes[0].message) == "probe message"
    assert (probes[0].filename, probes[0].lineno) == ("probe_file.py", 7)


# -- parameters and messages --------------------------------------------------------------------


def test_one_restart_and_one_thread_are_allowed() -> None:
    X, group, _ = four_groups()
    c = HeadClusterer(n_init=1, n_threads=1, num_windows=W2).fit(X)
    assert same_partition(c.labels_, group)
    assert thread_limit(None, 19_999) == 1
    assert thread_limit(None, 20_000) is None


def test_fit_messages() -> None:
    X, _, _ = four_groups()
    with pytest.raises(ValueError, match=r"^random_state must be an int \(stored with the run\), got None$"):
        HeadClusterer(random_state=None, num_windows=W2).fit(X)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^pass reference_centroids and reference_names together$"):
        HeadClusterer(n_clusters=3, num_windows=W2).fit(X, reference_names=["dense"])
    with pytest.raises(ValueError, match=r"^reference_centroids must have shape \(n_heads, 7\)"):
        HeadClusterer(n_clusters=3, num_windows=W2).fit(X, reference_centroids=np.zeros((1, 6)),
                                                        reference_names=["dense"])  # fmt: skip
    with pytest.raises(ValueError, match="^this HeadClusterer is not fitted yet; call fit first$"):
        HeadClusterer().predict(X)


@pytest.mark.parametrize("algorithm", ["kmeans", "gmm"])
def test_too_few_distinct_heads_counts_what_kmeans_found(algorithm: str) -> None:
    P = prototype_profiles(W2)
    X = P[[0, 1, 2, 2]]  # 3 distinct heads, one of them twice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        with pytest.raises(ValueError, match=r"^X has fewer than n_clusters=4 distinct head vectors \(K-means found "
                                             r"3 clusters\)$"):  # fmt: skip
            HeadClusterer(algorithm=algorithm, n_init=2, num_windows=W2).fit(X)  # type: ignore[arg-type]


def test_shares_by_group_bounds() -> None:
    keys, shares = shares_by_group([0, 0, 0], ["a", "b", "a"], k=1)
    assert keys.tolist() == ["a", "b"]
    np.testing.assert_array_equal(shares, [[1.0], [1.0]])
    with pytest.raises(ValueError, match="^k must be >= 1, got 0$"):
        shares_by_group([0], ["a"], k=0)
    with pytest.raises(ValueError, match=r"^labels must be integers in \[0, 2\)$"):
        shares_by_group([0.0, 1.0], ["a", "a"], k=2)
    with pytest.raises(ValueError, match=r"^labels must be integers in \[0, 2\)$"):
        shares_by_group([0, 2], ["a", "a"], k=2)


# -- t-SNE --------------------------------------------------------------------------------------


def test_tsne_knn_places_the_rest_at_the_mean_of_their_nearest_embedded_heads() -> None:
    X = random_heads(40, 7, seed=8)
    nan = tsne_embedding(X, max_points=20, random_state=0, out_of_sample="nan")
    knn = tsne_embedding(X, max_points=20, random_state=0, n_neighbors=3)
    embedded = np.flatnonzero(~np.isnan(nan).any(axis=1))
    rest = np.flatnonzero(np.isnan(nan).any(axis=1))
    assert embedded.size == 20
    for i in rest:
        nearest = embedded[np.argsort(((X[embedded] - X[i]) ** 2).sum(axis=1))[:3]]  # brute force
        np.testing.assert_allclose(knn[i], nan[nearest].mean(axis=0), rtol=1e-6)  # float32 t-SNE


def sklearn_tsne(X: np.ndarray, seed: int) -> np.ndarray:
    """scikit-learn's t-SNE with the documented parameters: perplexity ``min(30, (n - 1) / 3)``, PCA start."""
    X = np.asarray(X, dtype=np.float64)
    tsne = TSNE(n_components=2, perplexity=min(30.0, (len(X) - 1) / 3), init="pca", learning_rate="auto",
                random_state=seed)  # fmt: skip
    with threadpool_limits(limits=1, user_api="openmp"):  # one thread, as headcat at this size
        return tsne.fit_transform(X)


def test_tsne_is_sklearn_tsne_with_the_documented_parameters() -> None:
    for n in (100, 30):  # perplexity 30 (the cap), and 29 / 3
        X = random_heads(n, 7, seed=n)
        found = tsne_embedding(X)  # the default seed is 0
        assert found.dtype == np.float64
        np.testing.assert_array_equal(found, sklearn_tsne(X, 0))
    # above 500 columns scikit-learn's PCA start is randomized: the seed reaches it
    wide = random_heads(30, 501, seed=2)
    np.testing.assert_array_equal(tsne_embedding(wide, random_state=4), sklearn_tsne(wide, 4))
    # any array-like of numbers is read as float64 (here decimal strings, as read from a text file)
    text = [[str(v / 8) for v in row] for row in np.random.default_rng(3).integers(0, 9, size=(20, 5))]
    np.testing.assert_array_equal(tsne_embedding(text, random_state=1), sklearn_tsne(np.array(text, float), 1))


def test_tsne_defaults_seed_the_subsample_and_place_by_five_neighbours() -> None:
    X = random_heads(40, 7, seed=9)
    nan = tsne_embedding(X, max_points=20, out_of_sample="nan")  # default seed 0 and 5 neighbours
    knn = tsne_embedding(X, max_points=20)
    embedded = np.flatnonzero(~np.isnan(nan).any(axis=1))
    np.testing.assert_array_equal(embedded, np.sort(np.random.default_rng(0).choice(40, size=20, replace=False)))
    np.testing.assert_array_equal(nan[embedded], sklearn_tsne(X[embedded], 0))
    for i in np.setdiff1d(np.arange(40), embedded):
        nearest = embedded[np.argsort(((X[embedded] - X[i]) ** 2).sum(axis=1))[:5]]  # brute force
        np.testing.assert_allclose(knn[i], nan[nearest].mean(axis=0), rtol=1e-6)
    # the README's contract, t-SNE on every head up to 5,000, read off the signature: a 5,001-head fit is too
    # slow for a test (mutmut's trampoline shows inspect the original signature, so a mutated default survives)
    assert inspect.signature(tsne_embedding).parameters["max_points"].default == 5000


def test_tsne_refusals_in_full_and_the_smallest_subsample() -> None:
    for bad, shape in (([0.5, 0.5], "(2,)"), (np.zeros((0, 4)), "(0, 4)"), (np.zeros((2, 2, 2)), "(2, 2, 2)")):
        with pytest.raises(ValueError, match=f"^{re.escape(f'X must be a non-empty 2-D array, got shape {shape}')}$"):
            tsne_embedding(bad)
    with pytest.raises(ValueError, match="^X has non-finite values$"):
        tsne_embedding([[0.5, np.inf], [0.5, 0.5]])
    with pytest.raises(ValueError, match="^max_points must be >= 2, got 1$"):
        tsne_embedding(np.eye(3), max_points=1)
    X = np.array([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1]])
    nan = tsne_embedding(X, max_points=2, out_of_sample="nan", random_state=5)  # two embedded, one placed
    knn = tsne_embedding(X, max_points=2, n_neighbors=1, random_state=5)
    embedded = np.sort(np.random.default_rng(5).choice(3, size=2, replace=False))
    assert np.flatnonzero(~np.isnan(nan).any(axis=1)).tolist() == embedded.tolist()
    rest = int(np.setdiff1d(np.arange(3), embedded)[0])
    nearest = embedded[np.argmin(((X[embedded] - X[rest]) ** 2).sum(axis=1))]
    np.testing.assert_array_equal(knn[rest], nan[nearest])


# -- synthetic heads ----------------------------------------------------------------------------


def test_prototype_profiles_by_hand() -> None:
    # N = 2: the triangle 2 (1 - (i + 1/2) / N) is [1.5, 0.5], normalised [0.75, 0.25]; special
    # split cls .35, sep .45, period .15, comma .05. Windows, self and special mass of each row:
    # dense .86 tri, .02, .12; diagonal w0 .62 + .08 tri, w1 .08 + .08 tri, .17, .05;
    # dense_vertical .5 tri, .02, .48; vertical .06 tri, .02, .92 (each row already sums to 1).
    special = np.array([0.35, 0.45, 0.15, 0.05])
    expected = {
        "dense": [0.645, 0.215, 0.02, *(0.12 * special)],
        "diagonal": [0.68, 0.10, 0.17, *(0.05 * special)],
        "dense_vertical": [0.375, 0.125, 0.02, *(0.48 * special)],
        "vertical": [0.045, 0.015, 0.02, *(0.92 * special)],
    }
    np.testing.assert_allclose(prototype_profiles(2), [expected[t] for t in HEAD_TYPES], rtol=1e-12)
    # N = 1: the triangle is [1]; diagonal w0 .62 + .08 = .70, self .17, special .05, sum .92.
    P1 = prototype_profiles(1)
    np.testing.assert_allclose(P1[HEAD_TYPES.index("diagonal")], np.array([0.70, 0.17, *(0.05 * special)]) / 0.92,
                               rtol=1e-12)  # fmt: skip
    np.testing.assert_allclose(P1[HEAD_TYPES.index("dense")], [0.86, 0.02, *(0.12 * special)], rtol=1e-12)


def test_make_head_features_without_mixing_centres_on_the_prototypes() -> None:
    # Dirichlet(c P_t + 0.02): mean (c P_t + 0.02) / (c + 0.02 d), so at c = 1e6 the prototype itself.
    X, types = make_head_features(400, num_windows=2, concentration=1e6, mixing=0.0, random_state=1)
    P = prototype_profiles(2)
    np.testing.assert_allclose(X, P[types], atol=0.01)
    assert np.bincount(types, minlength=4).min() > 60  # equal weights: about 100 each
    X, types = make_head_features(50, num_windows=2, weights=[0, 0, 3, 0], random_state=1)
    assert (types == 2).all()


def test_make_head_features_mixing_moves_towards_other_types() -> None:
    # All dense; lambda ~ Beta(1, 1/m - 1) has mean m, the partner is uniform over the 3 others:
    # E[x] = (1 - m) P_dense + m mean(P_other) at a concentration high enough to ignore the floor.
    m = 0.3
    X, types = make_head_features(4000, num_windows=2, concentration=1e6, mixing=m, weights=[1, 0, 0, 0],
                                  random_state=2)  # fmt: skip
    assert (types == 0).all()
    P = prototype_profiles(2)
    np.testing.assert_allclose(X.mean(axis=0), (1 - m) * P[0] + m * P[1:].mean(axis=0), atol=0.006)


def test_make_head_features_floor_is_a_dirichlet_of_0_02() -> None:
    # concentration 0: every row is Dirichlet(0.02, ..., 0.02) over d = 7 features, so
    # E[sum x_i^2] = d a (a + 1) / (A (A + 1)) with a = 0.02, A = 7 a = 0.14: 1.02 / 1.14 = 0.895.
    X, _ = make_head_features(3000, num_windows=2, concentration=0.0, random_state=3)
    a, A = 0.02, 0.14
    assert (X**2).sum(axis=1).mean() == pytest.approx(7 * a * (a + 1) / (A * (A + 1)), abs=0.02)


def test_make_head_features_messages() -> None:
    with pytest.raises(ValueError, match="^n_heads must be >= 1, got 0$"):
        make_head_features(0)
    with pytest.raises(ValueError, match=r"^mixing must be in \[0, 1\), got 1.0$"):
        make_head_features(5, mixing=1.0)
    with pytest.raises(ValueError, match=r"^mixing must be in \[0, 1\), got -0.1$"):
        make_head_features(5, mixing=-0.1)


def test_make_head_features_is_seeded_with_documented_defaults() -> None:
    X, t = make_head_features(30)
    X0, t0 = make_head_features(30, concentration=60.0, random_state=0)  # the signature's defaults
    np.testing.assert_array_equal(X, X0)
    np.testing.assert_array_equal(t, t0)
    X1, _ = make_head_features(30, random_state=1)
    assert not np.array_equal(X, X1)
    assert make_head_features(1)[0].shape == (1, 21)


# -- after the mutation run ---------------------------------------------------------------------


def test_name_by_reference_reads_any_array_like_of_numbers_as_float64() -> None:
    # Decimal strings, as read from a text file, for either argument: the names of the float case in
    # test_name_by_reference_validation.
    C = [["0", "0", "0"], ["0.1", "0", "0"], ["1", "1", "1"]]
    R = [["0", "0", "0"], ["1", "1", "1"]]
    expected = ["ref_0", "ref_0_2", "ref_1"]
    assert name_by_reference(C, np.array(R, dtype=float), ["ref_0", "ref_1"]) == expected
    assert name_by_reference(np.array(C, dtype=float), R, ["ref_0", "ref_1"]) == expected


def test_a_foreign_warning_repeated_in_a_fit_keeps_the_callers_once_per_place_filter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class TwiceWarningKMeans(KMeans):
        def fit(self, X: np.ndarray, y: object = None, sample_weight: object = None) -> KMeans:
            for _ in range(2):  # twice from one place: the "default" action shows it once
                warnings.warn("probe message", ProbeWarning, stacklevel=1)
            return super().fit(X, y, sample_weight)

    monkeypatch.setattr(clustering, "KMeans", TwiceWarningKMeans)
    X, _, _ = four_groups()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        HeadClusterer(n_init=2, num_windows=W2).fit(X)
    assert [str(w.message) for w in caught if w.category is ProbeWarning] == ["probe message"]


def test_tsne_embeds_up_to_5000_heads_by_default_and_places_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # scikit-learn's TSNE with its embedding replaced by the first two features, so that 5,001 heads
    # take no time; what it is given and where the other heads go are headcat's.
    fitted: list[np.ndarray] = []

    class FirstTwoFeatures(TSNE):
        def fit_transform(self, X: np.ndarray, y: object = None) -> np.ndarray:
            fitted.append(np.array(X))
            return np.array(X)[:, :2]

    monkeypatch.setattr(clustering, "TSNE", FirstTwoFeatures)
    X = random_heads(5001, 7, seed=12)
    emb = tsne_embedding(X)  # defaults: 5,000 heads, seed 0, 5 neighbours
    embedded = np.sort(np.random.default_rng(0).choice(5001, size=5000, replace=False))
    assert len(fitted) == 1
    np.testing.assert_array_equal(fitted[0], X[embedded])
    np.testing.assert_array_equal(emb[embedded], X[embedded, :2])
    rest = int(np.setdiff1d(np.arange(5001), embedded)[0])
    nearest = embedded[np.argsort(((X[embedded] - X[rest]) ** 2).sum(axis=1))[:5]]  # brute force
    np.testing.assert_allclose(emb[rest], X[nearest, :2].mean(axis=0), rtol=1e-12)
    fitted.clear()
    np.testing.assert_array_equal(tsne_embedding(X[:5000]), X[:5000, :2])  # 5,000: all of them
    np.testing.assert_array_equal(fitted[0], X[:5000])


def test_make_head_features_normalises_weights_in_float64_whatever_their_dtype() -> None:
    # [1, 2, 3, 4] are exact in float16, their shares are not (0.1 -> 0.0999755859375): the type
    # draws must be those of the exact shares, as for the same weights given as integers.
    n = 100_000  # some fifteen draws fall between a float16 share and the exact one
    X, types = make_head_features(n, num_windows=1, mixing=0.0, weights=[1, 2, 3, 4], random_state=5)
    X16, types16 = make_head_features(n, num_windows=1, mixing=0.0, weights=np.array([1, 2, 3, 4], dtype=np.float16),
                                      random_state=5)  # fmt: skip
    np.testing.assert_array_equal(types16, types)
    np.testing.assert_array_equal(X16, X)
