"""Every detector's role threshold at the threshold, just below and just above it (SPEC 10: a head has a
role when its score *reaches* the threshold), and the range a threshold may take, at its ends.

The cases are generated from :data:`ingest.detectors.DETECTORS` and :data:`DEFAULT_THRESHOLDS`, so a new
detector is covered without a new test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ingest.detectors import (
    DEFAULT_THRESHOLDS,
    DETECTORS,
    DetectionConfig,
    DetectionError,
    DetectionResult,
    SequencePlan,
    role_heads,
    roles_by_head,
)


def result(scores: np.ndarray, thresholds: dict[str, float]) -> DetectionResult:
    """A result whose encoder holds ``scores`` ``(layers, heads, len(DETECTORS))``."""
    plan = SequencePlan(prefix=(), suffix=(), pool=np.arange(10), prefix_source="none")
    return DetectionResult(
        scores={"encoder": scores}, sequences=np.zeros((1, 4), dtype=np.int64), plan=plan,
        config=DetectionConfig(thresholds=thresholds), loss_first=None, loss_later=None, example_maps={},
        example_tokens=[], seconds=0.0, device="cpu", dtype="float32",
    )  # fmt: skip


CASES = [(d, t) for d in DETECTORS for t in sorted({0.0, DEFAULT_THRESHOLDS[d], 0.5, 1.0})]


@pytest.mark.parametrize(("detector", "threshold"), CASES, ids=[f"{d}-{t}" for d, t in CASES])
def test_a_role_is_a_score_that_reaches_its_threshold(detector: str, threshold: float) -> None:
    """Head 0 scores just below the threshold, head 1 exactly at it, head 2 just above; the other detectors
    score far from their thresholds (0 under a threshold of 1), so only ``detector`` decides."""
    k = DETECTORS.index(detector)
    scores = np.zeros((1, 3, len(DETECTORS)))
    scores[0, :, k] = [math.nextafter(threshold, -math.inf), threshold, math.nextafter(threshold, math.inf)]
    thresholds = dict.fromkeys(DETECTORS, 1.0) | {detector: threshold}
    found = result(scores, thresholds)
    assert found.roles("encoder") == [[[], [detector], [detector]]]
    assert role_heads(found, detector) == [("encoder", 0, 1), ("encoder", 0, 2)]  # type: ignore[arg-type]
    assert roles_by_head(found) == {("encoder", 0, 0): [], ("encoder", 0, 1): [detector], ("encoder", 0, 2): [detector]}


def test_a_missing_score_has_no_role() -> None:
    """NaN (a detector a stack has not: induction on cross heads) reaches no threshold, even 0."""
    scores = np.full((1, 1, len(DETECTORS)), np.nan)
    found = result(scores, dict.fromkeys(DETECTORS, 0.0))
    assert found.roles("encoder") == [[[]]]
    assert all(role_heads(found, d) == [] for d in DETECTORS)  # type: ignore[arg-type]


@pytest.mark.parametrize("detector", DETECTORS)
def test_a_threshold_lies_in_zero_to_one_ends_included(detector: str) -> None:
    for inside in (0.0, 1.0):
        assert DetectionConfig(thresholds={detector: inside}).thresholds[detector] == inside
    for outside in (math.nextafter(0.0, -1.0), math.nextafter(1.0, 2.0), math.nan):
        with pytest.raises(DetectionError, match=rf"^thresholds\.{detector}: must lie in \[0, 1\]"):
            DetectionConfig(thresholds={detector: outside})


@pytest.mark.parametrize(
    ("field", "lowest"), [("sequences", 1), ("batch_size", 1), ("length", 2), ("copies", 2), ("seed", 0)]
)
def test_a_run_s_sizes_are_checked_at_their_lowest(field: str, lowest: int) -> None:
    assert getattr(DetectionConfig(**{field: lowest}), field) == lowest
    with pytest.raises(DetectionError, match=rf"^{field}: must be >= {lowest}"):
        DetectionConfig(**{field: lowest - 1})
