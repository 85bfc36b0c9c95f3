"""``bench/mutation.py``'s 95 % Wilson interval, which the mutation page quotes for a sampled module, against
scipy's (an independent implementation), on proportions where a wrong formula would differ."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from bench import mutation


@pytest.mark.parametrize(("killed", "total"), [(60, 60), (0, 20), (90, 100), (7, 9), (1, 1), (433, 500)])
def test_the_wilson_interval_is_scipy_s(killed: int, total: int) -> None:
    want = binomtest(killed, total).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = mutation.wilson(killed, total)
    assert low == pytest.approx(want.low, abs=2e-4)  # z = 1.96, where scipy takes the exact quantile 1.95996
    assert high == pytest.approx(want.high, abs=2e-4)


def test_no_mutants_give_the_whole_interval() -> None:
    assert mutation.wilson(0, 0) == (0.0, 1.0)
