"""The page's axes and counts as pure functions under node (``service/web/static/plots.js``): ticks at round
values (1, 2 or 5 times a power of ten) that cover the data, never the data's own rounded min, mid and max;
a count with its noun, singular for exactly one. Skips, saying why, without node."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import PATIENCE

SCRIPT = Path(__file__).resolve().parents[2] / "service" / "web" / "static" / "plots.js"


def node(expression: str) -> Any:
    """``expression`` evaluated under node with plots.js's exports as ``p``, as JSON."""
    binary = shutil.which("node")
    if binary is None:
        pytest.skip("node is absent")
    program = f"const p = require({json.dumps(str(SCRIPT))}); console.log(JSON.stringify({expression}));"
    done = subprocess.run([binary, "-e", program], capture_output=True, text=True, timeout=PATIENCE, check=True)
    return json.loads(done.stdout)


def test_the_issue_s_pruning_curve_gets_round_ticks_that_cover_it() -> None:
    """The curve of issue 31 (accuracy 1.0 down to 0.7, its middle at 0.862): ticks every 0.1 from 0.7 to 1.0,
    none at the data's own middle."""
    axis = node("p.niceTicks(0.7, 1.0)")
    assert axis == {"lo": 0.7, "hi": 1, "step": 0.1, "ticks": [0.7, 0.8, 0.9, 1], "digits": 1}
    assert node("p.niceTicks(0.72, 0.99)")["ticks"] == [0.7, 0.8, 0.9, 1]  # widened to whole steps
    assert node("p.niceTicks(0.7, 1.0, 7)")["ticks"] == [0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1]


@pytest.mark.parametrize(
    ("lo", "hi", "count"),
    [(0.7, 1.0, 5), (0.0, 0.5, 6), (0.0, 0.35, 6), (-3.2, 41.0, 5), (0.0012, 0.0047, 5), (0.81, 0.81, 5),
     (0.0, 0.0, 5), (12.0, 1234.5, 4), (0.0, 1.0, 3), (1.0, 0.5, 5), (-0.8, -0.2, 5)],
)  # fmt: skip
def test_ticks_are_round_steps_covering_the_data(lo: float, hi: float, count: int) -> None:
    axis = node(f"p.niceTicks({lo}, {hi}, {count})")
    low, high = min(lo, hi), max(lo, hi)
    step, ticks = axis["step"], axis["ticks"]
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert min(abs(mantissa - m) for m in (1, 2, 5)) < 1e-9, f"step {step} is not 1, 2 or 5 x 10^n"
    assert ticks[0] <= low + 1e-12
    assert ticks[-1] >= high - 1e-12
    assert (axis["lo"], axis["hi"]) == (ticks[0], ticks[-1])
    for tick in ticks:  # each a whole multiple of the step, written with the digits it needs
        assert abs(tick / step - round(tick / step)) < 1e-6
        assert float(f"{tick:.{axis['digits']}f}") == pytest.approx(tick, abs=1e-12)
    assert all(b - a == pytest.approx(step) for a, b in zip(ticks, ticks[1:], strict=False))
    if high > low:  # at most about `count` ticks, and not needlessly wide: the next smaller step would give more
        assert len(ticks) <= count + 2
        assert (high - low) / (count - 1) > step / 2.5 - 1e-12


def test_numbers_that_are_not_finite_give_the_unit_axis() -> None:
    assert node("p.niceTicks(Infinity, -Infinity)")["ticks"] == [0, 0.5, 1]  # a curve with no number


def test_a_count_names_its_noun_singular_for_one() -> None:
    said = node(
        '[p.count(1, "sample"), p.count(2, "sample"), p.count(0, "probe"), p.count(1, "query", "queries"), '
        'p.count(3, "query", "queries"), p.count(1200, "pass", "passes")]'
    )
    assert said == ["1 sample", "2 samples", "0 probes", "1 query", "3 queries", "1,200 passes"]
