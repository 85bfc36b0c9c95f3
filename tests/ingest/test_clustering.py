"""Head-type clustering: naming rules, canonical labels, recovery of synthetic types, t-SNE."""

from __future__ import annotations

import numpy as np
import pytest

from ingest.clustering import (
    HeadClusterer,
    base_type,
    canonical_order,
    make_head_features,
    name_by_reference,
    name_clusters,
    prototype_profiles,
    shares_by_group,
    thread_limit,
    tsne_embedding,
)
from ingest.types import HEAD_TYPES, feature_names

N = 16
D = N + 5


def centroid(windows: list[float], self_: float, specials: list[float]) -> list[float]:
    """A 2-window head vector ``w0, w1, self, cls, sep, period, comma``."""
    return [*windows, self_, *specials]


@pytest.fixture(scope="module")
def heads() -> tuple[np.ndarray, np.ndarray]:
    """600 synthetic heads around the four prototypes; true ids are HEAD_TYPES positions."""
    return make_head_features(600, concentration=80.0, mixing=0.05, random_state=3)


@pytest.fixture(scope="module")
def fitted(heads: tuple[np.ndarray, np.ndarray]) -> HeadClusterer:
    return HeadClusterer(n_init=4).fit(heads[0])


# -- naming -------------------------------------------------------------------------------------


def test_prototypes_name_themselves() -> None:
    P = prototype_profiles(N)
    assert P.shape == (4, len(feature_names(N)))
    np.testing.assert_allclose(P.sum(axis=1), 1.0)
    assert name_clusters(P, N) == list(HEAD_TYPES)
    perm = [2, 0, 3, 1]
    assert name_clusters(P[perm], N) == [HEAD_TYPES[i] for i in perm]


def test_name_clusters_vertical_also_most_local_goes_vertical() -> None:
    # Cluster 0 has the highest S *and* the highest D: vertical wins; diagonal is the next D.
    C = [
        centroid([0.3, 0.1], 0.1, [0.2, 0.2, 0.05, 0.05]),  # S .5, D .5
        centroid([0.2, 0.1], 0.1, [0.3, 0.2, 0.0, 0.1]),  # S .6, D .4  -> vertical
        centroid([0.5, 0.4], 0.0, [0.05, 0.05, 0.0, 0.0]),  # S .1, D .9  -> diagonal
        centroid([0.6, 0.3], 0.0, [0.05, 0.0, 0.05, 0.0]),  # S .1, D .9 tie -> lower index
    ]
    assert name_clusters(C, num_windows=2) == ["dense_vertical", "vertical", "diagonal", "dense"]


def test_name_clusters_last_two_split_by_special_mass_not_locality() -> None:
    C = [
        centroid([0.4, 0.3], 0.1, [0.1, 0.1, 0.0, 0.0]),  # S .2, D .8 (more local than 3)
        centroid([0.1, 0.0], 0.8, [0.05, 0.05, 0.0, 0.0]),  # S .1, D .9 -> diagonal
        centroid([0.0, 0.0], 0.0, [0.5, 0.5, 0.0, 0.0]),  # S 1 -> vertical
        centroid([0.2, 0.1], 0.0, [0.3, 0.2, 0.1, 0.1]),  # S .7 -> dense_vertical
    ]
    assert name_clusters(C, num_windows=2) == ["dense", "diagonal", "vertical", "dense_vertical"]


def test_name_clusters_needs_four_centroids_of_the_right_width() -> None:
    with pytest.raises(ValueError, match="exactly 4"):
        name_clusters(prototype_profiles(N)[:3], N)
    with pytest.raises(ValueError, match="shape"):
        name_clusters(prototype_profiles(N), num_windows=8)


def test_name_by_reference_suffixes_in_order_of_distance() -> None:
    R = np.eye(3)
    names = ["dense", "diagonal", "vertical"]
    C = np.array([[0.0, 0.8, 0.2], [1.0, 0.0, 0.0], [0.0, 0.95, 0.05], [0.1, 0.6, 0.3]])
    assert name_by_reference(C, R, names) == ["diagonal_2", "dense", "diagonal", "diagonal_3"]
    with pytest.raises(ValueError, match="unique"):
        name_by_reference(C, R, ["dense", "dense", "vertical"])
    with pytest.raises(ValueError, match="same width"):
        name_by_reference(C[:, :2], R, names)


def test_base_type() -> None:
    assert base_type("dense_vertical") == "dense_vertical"
    assert base_type("dense_vertical_2") == "dense_vertical"
    assert base_type("diagonal_12") == "diagonal"
    assert base_type("cluster_0") is None
    assert base_type("dense_x") is None


# -- fitting ------------------------------------------------------------------------------------


def test_four_types_recovered(heads: tuple[np.ndarray, np.ndarray], fitted: HeadClusterer) -> None:
    X, truth = heads
    assert fitted.names_ == list(HEAD_TYPES)
    assert fitted.types_ == list(HEAD_TYPES)
    # Canonical ids are HEAD_TYPES positions, as are the true ids.
    assert (fitted.labels_ == truth).mean() > 0.95
    np.testing.assert_allclose(fitted.centroids_, prototype_profiles(N), atol=0.05)
    assert fitted.centroids_.shape == (4, D)
    assert fitted.sizes_.sum() == len(X)
    np.testing.assert_allclose(fitted.shares_, fitted.sizes_ / len(X))
    assert fitted.log_likelihood_ is None
    assert fitted.inertia_ > 0
    np.testing.assert_array_equal(fitted.predict(X), fitted.labels_)
    assert fitted.predict_names(X[:2]) == [fitted.names_[i] for i in fitted.labels_[:2]]


def test_repeated_and_permuted_fits_are_identical(heads: tuple[np.ndarray, np.ndarray]) -> None:
    X, _ = heads
    a = HeadClusterer(n_init=4, random_state=7).fit(X)
    b = HeadClusterer(n_init=4, random_state=7).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.centroids_, b.centroids_)

    perm = np.random.default_rng(0).permutation(len(X))
    c = HeadClusterer(n_init=4, random_state=7).fit(X[perm])
    np.testing.assert_array_equal(c.labels_, a.labels_[perm])
    np.testing.assert_array_equal(c.centroids_, a.centroids_)
    assert c.names_ == a.names_
    assert c.inertia_ == a.inertia_


def test_other_seed_gives_same_names_for_same_clusters(
    heads: tuple[np.ndarray, np.ndarray], fitted: HeadClusterer
) -> None:
    other = HeadClusterer(n_init=4, random_state=123).fit(heads[0])
    assert other.names_ == fitted.names_
    np.testing.assert_allclose(other.centroids_, fitted.centroids_, atol=1e-6)


def test_canonical_order_ignores_row_order_and_breaks_projection_ties() -> None:
    X = np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5], [1.0, 0.0]])
    order = canonical_order(X)
    perm = np.array([3, 1, 2, 0])
    np.testing.assert_array_equal(X[order], X[perm][canonical_order(X[perm])])
    # Distinct rows with the same projection (weights sqrt(2), sqrt(3)) fall back to lexsort.
    w = np.sqrt([2.0, 3.0])
    Y = np.array([[w[1], 0.0], [0.0, w[0]]])
    assert Y[0] @ w == Y[1] @ w
    np.testing.assert_array_equal(Y[canonical_order(Y)], Y[::-1][canonical_order(Y[::-1])])


@pytest.mark.parametrize("k", [3, 5])
def test_other_k_named_by_nearest_k4_centroid(heads: tuple[np.ndarray, np.ndarray], k: int) -> None:
    X, _ = heads
    c = HeadClusterer(n_clusters=k, n_init=4).fit(X)
    assert len(c.names_) == k == len(set(c.names_))
    assert c.reference_names_ == list(HEAD_TYPES)
    assert c.reference_centroids_ is not None
    ref = c.reference_centroids_
    for name, cen in zip(c.names_, c.centroids_, strict=True):
        nearest = HEAD_TYPES[int(np.linalg.norm(ref - cen, axis=1).argmin())]
        assert base_type(name) == nearest
    # Ids follow HEAD_TYPES order, then the suffix.
    ranks = [(HEAD_TYPES.index(base_type(nm)), nm) for nm in c.names_]
    assert ranks == sorted(ranks)
    if k == 5:
        assert set(c.types_) == set(HEAD_TYPES)


def test_explicit_reference_is_used_for_naming(heads: tuple[np.ndarray, np.ndarray]) -> None:
    X, _ = heads
    P = prototype_profiles(N)
    c = HeadClusterer(n_clusters=2, n_init=2).fit(
        X, reference_centroids=P[[0, 3]], reference_names=["dense", "vertical"]
    )
    assert c.reference_names_ == ["dense", "vertical"]
    assert {base_type(nm) for nm in c.names_} <= {"dense", "vertical"}
    assert len(set(c.names_)) == 2
    with pytest.raises(ValueError, match="together"):
        HeadClusterer(n_clusters=2).fit(X, reference_centroids=P)


def test_no_reference_gives_cluster_names_ordered_by_special_mass() -> None:
    P = prototype_profiles(N)
    X = P[[1, 3, 0]]  # diagonal, vertical, dense: three heads, no k = 4 run possible
    c = HeadClusterer(n_clusters=3, n_init=2).fit(X)
    assert c.names_ == ["cluster_0", "cluster_1", "cluster_2"]
    assert c.types_ == [None, None, None]
    assert c.reference_centroids_ is None
    np.testing.assert_array_equal(c.labels_, [2, 0, 1])  # vertical highest S, then dense


def test_too_few_distinct_heads_for_reference_falls_back_without_warnings() -> None:
    P = prototype_profiles(N)
    X = np.repeat(P[:3], 4, axis=0)  # 12 heads, 3 distinct: the k = 4 reference cannot exist
    c = HeadClusterer(n_clusters=3, n_init=2).fit(X)
    assert c.names_ == ["cluster_0", "cluster_1", "cluster_2"]
    with pytest.raises(ValueError, match="distinct"):
        HeadClusterer(n_clusters=4, n_init=2).fit(X)


def test_gmm(heads: tuple[np.ndarray, np.ndarray]) -> None:
    X, truth = heads
    g = HeadClusterer(algorithm="gmm", n_init=2).fit(X)
    assert g.names_ == list(HEAD_TYPES)
    assert (g.labels_ == truth).mean() > 0.9
    assert g.log_likelihood_ is not None
    assert np.isfinite(g.log_likelihood_)
    np.testing.assert_array_equal(g.predict(X), g.labels_)
    g3 = HeadClusterer(algorithm="gmm", n_clusters=3, n_init=2).fit(X)
    assert {base_type(n) for n in g3.names_} <= set(HEAD_TYPES)


def test_small_model_heads() -> None:
    """A 2-layer x 4-head model: 8 heads."""
    X, _ = make_head_features(8, random_state=1)
    c = HeadClusterer(n_clusters=2, n_init=2).fit(X)
    assert c.labels_.shape == (8,)
    assert len(set(c.names_)) == 2


def test_thread_limit_rule() -> None:
    assert thread_limit(None, 384) == 1
    assert thread_limit(None, 10**6) is None
    assert thread_limit(2, 384) == 2


def test_get_params_round_trip() -> None:
    c = HeadClusterer(algorithm="gmm", n_clusters=5, random_state=3)
    assert HeadClusterer(**c.get_params()).get_params() == c.get_params()
    assert not hasattr(c, "labels_")


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "X", "match"),
    [
        ({"n_clusters": 1}, np.full((5, D), 1 / D), "n_clusters must be"),
        ({"n_clusters": 6}, np.full((5, D), 1 / D), "more than the 5 heads"),
        ({}, np.full((5, D - 1), 1 / D), r"shape \(n_heads, 21\)"),
        ({"num_windows": 8}, np.full((5, D), 1 / D), r"shape \(n_heads, 13\)"),
        ({}, np.full(D, 1 / D), "shape"),
        ({}, np.zeros((0, D)), "no rows"),
        ({"algorithm": "dbscan"}, np.full((5, D), 1 / D), "algorithm"),
        ({"n_init": 0}, np.full((5, D), 1 / D), "n_init"),
        ({"num_windows": 0}, np.full((5, 5), 0.2), "num_windows"),
        ({"n_threads": 0}, np.full((5, D), 1 / D), "n_threads"),
    ],
)
def test_validation(params: dict, X: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeadClusterer(**params).fit(X)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_rejected(bad: float) -> None:
    X, _ = make_head_features(10)
    X[3, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        HeadClusterer().fit(X)


def test_predict_needs_fit_and_right_width(fitted: HeadClusterer) -> None:
    with pytest.raises(ValueError, match="not fitted"):
        HeadClusterer().predict(np.zeros((1, D)))
    with pytest.raises(ValueError, match="shape"):
        fitted.predict(np.zeros((1, D + 1)))


# -- groups and t-SNE ---------------------------------------------------------------------------


def test_shares_by_group() -> None:
    labels = np.array([0, 1, 1, 3, 0, 0])
    groups = np.array(["b", "a", "a", "a", "b", "b"])
    keys, shares = shares_by_group(labels, groups, k=4)
    assert keys.tolist() == ["a", "b"]
    np.testing.assert_allclose(shares, np.array([[0.0, 2 / 3, 0.0, 1 / 3], [1.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        shares_by_group(labels, groups, k=2)
    with pytest.raises(ValueError, match="same length"):
        shares_by_group(labels, groups[:3], k=4)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_tsne_tiny(n: int) -> None:
    X, _ = make_head_features(n, random_state=2)
    emb = tsne_embedding(X, random_state=0)
    assert emb.shape == (n, 2)
    assert np.isfinite(emb).all()


def test_tsne_subsample_knn_and_nan() -> None:
    X, _ = make_head_features(60, random_state=2)
    knn = tsne_embedding(X, max_points=30, random_state=0)
    nan = tsne_embedding(X, max_points=30, random_state=0, out_of_sample="nan")
    assert knn.shape == nan.shape == (60, 2)
    assert np.isfinite(knn).all()
    embedded = ~np.isnan(nan).any(axis=1)
    assert embedded.sum() == 30
    np.testing.assert_array_equal(knn[embedded], nan[embedded])
    np.testing.assert_array_equal(knn, tsne_embedding(X, max_points=30, random_state=0))
    with pytest.raises(ValueError, match="out_of_sample"):
        tsne_embedding(X, out_of_sample="zero")  # type: ignore[arg-type]


def test_make_head_features_on_simplex() -> None:
    X, t = make_head_features(500, num_windows=8, random_state=0)
    assert X.shape == (500, 13)
    np.testing.assert_allclose(X.sum(axis=1), 1.0)
    assert (X >= 0).all()
    assert set(np.unique(t)) == {0, 1, 2, 3}
