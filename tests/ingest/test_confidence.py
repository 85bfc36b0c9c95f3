"""Per-head confidence in a head's type: the margin (``ingest.clustering.margins``) and the stability
agreement (``StabilityAnalysis.agreement_``), on data where the answer is known, and the agreement
against an independent recomputation with plain scikit-learn K-means and scipy's Hungarian matching."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans

from ingest.clustering import HeadClusterer, make_head_features, margins, prototype_profiles
from ingest.stability import StabilityAnalysis


def test_margin_by_hand() -> None:
    centroids = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 10.0]])
    X = np.array([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [0.5, 0.0], [0.0, 5.0]])
    labels = np.array([0, 0, 0, 1, 2])
    # exactly between 0 and 1; on centroid 0; a quarter of the way (d1 = .5, d2 = 1.5);
    # the same point given to the farther centroid (a mixture may): negative; between 0 and 2 (d1 = d2 = 5)
    expected = [0.0, 1.0, (1.5 - 0.5) / 1.5, -(1.5 - 0.5) / 1.5, 0.0]
    np.testing.assert_allclose(margins(X, centroids, labels), expected, atol=1e-12)


def test_margin_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="at least 2 centroids"):
        margins(np.zeros((2, 3)), np.zeros((1, 3)), np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match="labels"):
        margins(np.zeros((2, 3)), np.zeros((2, 3)), np.array([0, 2]))
    with pytest.raises(ValueError, match="same width"):
        margins(np.zeros((2, 3)), np.zeros((2, 4)), np.array([0, 1]))


def _blobs_with_known_heads() -> tuple[np.ndarray, int, int]:
    """Four tight clusters of 30 heads around the prototype profiles, a head on the dense
    prototype (deep inside its cluster) and one halfway between the dense and dense_vertical
    prototypes; returns (X, deep index, between index)."""
    X, _ = make_head_features(120, concentration=3000.0, mixing=0.0, weights=[1, 1, 1, 1], random_state=4)
    P = prototype_profiles()
    deep, between = P[0], (P[0] + P[2]) / 2  # dense, and between dense and dense_vertical
    return np.vstack([X, deep, between]), 120, 121


def test_a_head_deep_inside_its_cluster_is_certain_and_one_between_two_is_not() -> None:
    X, deep, between = _blobs_with_known_heads()
    full = HeadClusterer(n_clusters=4, random_state=0).fit(X)
    margin = margins(X, full.centroids_, full.labels_)
    assert margin[deep] > 0.9
    assert abs(margin[between]) < 0.05  # the two centroids sit within a few % of the prototypes
    assert {full.names_[full.labels_[between]]} <= {"dense", "dense_vertical"}
    analysis = StabilityAnalysis(n_runs=20, fraction=0.5, random_state=0).fit(
        X, reference_centroids=full.centroids_, reference_labels=full.labels_
    )
    assert analysis.agreement_ is not None
    assert analysis.agreement_[deep] == 1.0
    assert 0.0 < analysis.agreement_[between] < 1.0  # some fits put it on the other side
    others = np.delete(np.arange(len(X)), [between])
    assert (analysis.agreement_[others] == 1.0).all()  # tight clusters: every other head is certain


def border_heads(n: int, borders: int, seed: int) -> np.ndarray:
    """``n`` heads in four tight clusters around the prototypes and ``borders`` heads on the segments
    between two prototypes, 40-60 % of the way: the border heads change sides between subsets."""
    X, _ = make_head_features(n, concentration=3000.0, mixing=0.0, random_state=seed)
    rng = np.random.default_rng(seed)
    P = prototype_profiles()
    pairs = rng.choice(4, size=(borders, 2), replace=True)
    pairs[:, 1] = (pairs[:, 0] + rng.integers(1, 4, size=borders)) % 4
    t = rng.uniform(0.4, 0.6, size=(borders, 1))
    return np.vstack([X, (1 - t) * P[pairs[:, 0]] + t * P[pairs[:, 1]]])


def test_agreement_equals_a_recomputation_with_plain_kmeans_and_hungarian_matching() -> None:
    """The data (seed 2) is one where every run's subset has a single K-means optimum that
    ten restarts find from any seed (checked below): elsewhere two K-means implementations may
    stop in different local optima, and the recomputation could not be exact."""
    X = border_heads(140, 10, seed=2)
    full = HeadClusterer(n_clusters=4, random_state=0).fit(X)
    analysis = StabilityAnalysis(n_runs=10, fraction=0.5, random_state=3).fit(
        X, reference_centroids=full.centroids_, reference_labels=full.labels_
    )
    assert analysis.agreement_ is not None
    votes = np.zeros(len(X))
    for seed in analysis.seeds_:  # the documented recipe: the seed draws the subset and seeds the fit
        subset = np.sort(np.random.default_rng(int(seed)).choice(len(X), size=len(X) // 2, replace=False))
        km = KMeans(n_clusters=4, n_init=10, random_state=int(seed)).fit(X[subset])
        best = KMeans(n_clusters=4, n_init=50, random_state=0).fit(X[subset])
        assert np.isclose(km.inertia_, best.inertia_)  # the premise: one optimum
        cost = np.linalg.norm(km.cluster_centers_[:, None, :] - full.centroids_[None, :, :], axis=-1)
        rows, cols = linear_sum_assignment(cost)
        mapping = np.empty(4, dtype=int)
        mapping[rows] = cols
        votes += mapping[km.predict(X)] == full.labels_
    expected = votes / len(analysis.seeds_)
    assert 0 < (expected < 1).sum() < len(X)  # the data has uncertain heads and certain ones
    np.testing.assert_array_equal(analysis.agreement_, expected)
    assert np.isclose(analysis.score_, float((analysis.labels_ == analysis.labels_[0]).all(axis=0).mean()))


def test_agreement_needs_the_reference_labels() -> None:
    X, _ = make_head_features(40, random_state=1)
    full = HeadClusterer(n_clusters=4, random_state=0).fit(X)
    without = StabilityAnalysis(n_runs=2).fit(X, reference_centroids=full.centroids_)
    assert without.agreement_ is None
    fitted_here = StabilityAnalysis(n_runs=2).fit(X)
    assert fitted_here.agreement_ is not None
    assert fitted_here.agreement_.shape == (40,)
    with pytest.raises(ValueError, match="reference_labels go with reference_centroids"):
        StabilityAnalysis(n_runs=2).fit(X, reference_labels=full.labels_)
    with pytest.raises(ValueError, match=r"ids in \[0, 4\)"):
        StabilityAnalysis(n_runs=2).fit(X, reference_centroids=full.centroids_, reference_labels=full.labels_ + 1)
