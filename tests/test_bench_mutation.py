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


def test_the_target_class_is_the_comparison_operators_and_whatever_is_in_a_max_or_min_call() -> None:
    from mutmut.mutation.file_mutation import mutate_file_contents

    source = (
        "def pick(runs, bound, name):\n"
        "    if name == 'x' and bound <= 3:\n"
        "        return max(runs, key=len)\n"
        "    return bound + 1\n"
    )
    mutated = mutate_file_contents("m.py", source)
    found = mutation.target_class(mutated.code)
    lines = mutated.code.splitlines()

    def body(name: str) -> str:
        span = mutated.line_span_by_function_name[name]
        return "\n".join(lines[span.start : span.end])

    comparisons = {name for name, kind in found.items() if kind == "comparison"}
    in_max = {name for name, kind in found.items() if kind == "max/min"}
    assert {body(n).splitlines()[0].strip() for n in comparisons} == {
        "if name != 'x' and bound <= 3:",
        "if name == 'x' and bound < 3:",
    }
    assert in_max
    assert all("max(" in body(n) for n in in_max)
    others = set(mutated.mutant_names) - set(found)
    assert any("bound - 1" in body(n) for n in others)  # an arithmetic mutant is not in the class
    assert any(" or " in body(n) for n in others)  # nor and/or
