"""The docs harness's matcher (``tests/docs/examples.py``) against a plain recursive comparison, on
generated answers (Hypothesis), and the generation's power: matchers that look at fewer elements than
they should (mutants of the real one) are caught.

An answer is drawn first (any JSON value), then what a page might show for it: the same value with
numbers shown to a few decimals, subtrees replaced by ``"..."``, lists cut short before a ``"..."``,
and, at random, one change (a number moved past its shown decimals, a string or a boolean changed, an
element or a key added or left out). :func:`reference` decides each pair by the rules of the
harness's docstring, written again without its code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.docs import examples
from tests.docs.examples import ELLIPSIS, match_json

Matcher = Callable[[Any, Any], list[str]]

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(-1e6, 1e6, allow_nan=False)
    | st.sampled_from(["", "a", "b", "..x", "vertical"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from("abcde"), children, max_size=4),
    max_leaves=12,
)


def reference(shown: Any, real: Any) -> bool:
    """Whether ``real`` is an answer ``shown`` stands for: the harness's rules, plainly."""
    if isinstance(shown, str) and shown == ELLIPSIS:
        return True
    if isinstance(shown, Decimal):
        if type(real) not in (int, float):
            return False
        places = -shown.as_tuple().exponent  # type: ignore[operator]
        return abs(Decimal(repr(real)) - shown) * 10**places <= Decimal("0.5")
    if isinstance(shown, list):
        if type(real) is not list:
            return False
        if shown and isinstance(shown[-1], str) and shown[-1] == ELLIPSIS:
            head = shown[:-1]
            return len(real) >= len(head) and all(reference(s, r) for s, r in zip(head, real, strict=False))
        return len(real) == len(shown) and all(reference(s, r) for s, r in zip(shown, real, strict=True))
    if isinstance(shown, dict):
        if type(real) is not dict or sorted(shown) != sorted(real):
            return False
        return all(reference(shown[key], real[key]) for key in shown)
    return type(shown) is type(real) and shown == real


MODES = ("same", "same", "same", "same", "elide", "change", "cut")  # how a page shows a value (cut: lists)


@st.composite
def shown_for(draw: st.DrawFn, real: Any) -> Any:
    """What a page might show for ``real``: faithful, elided, rounded, or changed in one place."""
    mode = draw(st.sampled_from(MODES))
    if mode == "elide":
        return ELLIPSIS
    change = mode == "change"
    if isinstance(real, bool) or real is None:
        if change:
            return draw(st.sampled_from([False, 0] if real is None else [not real, int(real)]))
        return real
    if isinstance(real, int):
        return draw(st.sampled_from([real + 1, Decimal(real).quantize(Decimal("0.1"))])) if change else real
    if isinstance(real, float):
        places = draw(st.integers(1, 6))
        shown = Decimal(repr(real)).quantize(Decimal(1).scaleb(-places))
        if change:  # moved past its shown decimals, or shown as an integer (which must be equal)
            return draw(st.sampled_from([shown + Decimal(1).scaleb(-places), round(real)]))
        return shown
    if isinstance(real, str):
        return real + "x" if change else real
    if isinstance(real, list):
        items = [draw(shown_for(item)) for item in real]
        if change:
            items = items[:-1] if items and draw(st.booleans()) else [*items, "added"]
        if mode == "cut":
            items = [*items[: draw(st.integers(0, len(items)))], ELLIPSIS]
        return items
    shown = {key: draw(shown_for(value)) for key, value in real.items()}
    if change:
        if shown and draw(st.booleans()):
            shown.pop(draw(st.sampled_from(sorted(shown))))
        else:
            shown["z"] = 1
    return shown


def as_shown(real: Any) -> Any:
    """``real`` as a page shows it exactly (floats with all their decimals)."""
    if isinstance(real, float):
        return Decimal(repr(real))
    if isinstance(real, list):
        return [as_shown(item) for item in real]
    if isinstance(real, dict):
        return {key: as_shown(value) for key, value in real.items()}
    return real


PAIRS = JSON.flatmap(lambda real: st.tuples(shown_for(real), st.just(real)))
PROPERTY = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def agrees(matcher: Matcher, *, shrink: bool = True) -> None:
    """Raises when ``matcher`` and :func:`reference` disagree on some generated pair (the smallest such pair,
    unless ``shrink`` is false: then the first found, searching longer)."""

    searching = {"max_examples": 3000, "phases": [Phase.explicit, Phase.generate]}  # stops at the first found

    @settings(PROPERTY, **({} if shrink else searching))  # type: ignore[arg-type]
    @given(PAIRS)
    def check(pair: tuple[Any, Any]) -> None:
        shown, real = pair
        assert (matcher(shown, real) == []) == reference(shown, real), (shown, real, matcher(shown, real))

    check()


def test_the_matcher_agrees_with_a_plain_recursive_comparison() -> None:
    agrees(match_json)


@given(JSON)
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
def test_an_answer_shown_as_it_is_matches_and_a_changed_one_names_where(real: Any) -> None:
    assert match_json(as_shown(real), real) == []
    for shown in ([as_shown(real), "added"], {"key": as_shown(real), "other": 1}):
        wrapper = [real] if isinstance(shown, list) else {"key": real}
        problems = match_json(shown, wrapper)
        assert problems, shown
        assert problems[0].startswith("$"), problems


def test_the_generated_pairs_reach_both_answers() -> None:
    """The property is not vacuous: matching and non-matching pairs, at depth, are both generated."""
    seen: set[tuple[bool, bool]] = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(PAIRS)
    def collect(pair: tuple[Any, Any]) -> None:
        shown, real = pair
        seen.add((reference(shown, real), isinstance(real, list | dict) and bool(real)))

    collect()
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


# Matchers that look at fewer elements (or fewer places) than they should: each is the real matcher's
# source with one line changed. The property must catch every one.
BLIND = {
    "skips a list's last element": ("in enumerate(fixed):", "in enumerate(fixed[:-1]):"),
    "skips a list's first element": ("in enumerate(fixed):", "in list(enumerate(fixed))[1:]:"),
    "skips an object's last key": ("for key in shown:", "for key in list(shown)[:-1]:"),
    "ignores extra elements of a closed list": ("(not open_ended and len(real) != len(fixed))", "False"),
    "ignores missing keys": ("if set(shown) != set(real):", "if set(shown) - set(real):"),
    "ignores extra keys": ("if set(shown) != set(real):", "if set(real) - set(shown) and False:"),
    "compares one decimal fewer": ("-int(shown.as_tuple().exponent)", "-int(shown.as_tuple().exponent) - 1"),
    "treats 1 and 1.0 alike": ("shown == real and type(shown) is type(real)", "shown == real"),
}  # fmt: skip


def mutant(before: str, after: str) -> Matcher:
    source = inspect.getsource(examples.match_json)
    assert source.count(before) == 1, f"the matcher no longer has {before!r}: update BLIND"
    namespace = dict(vars(examples))
    exec(compile(source.replace(before, after), examples.__file__, "exec"), namespace)  # noqa: S102
    return namespace["match_json"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("blind", list(BLIND))
def test_a_matcher_that_looks_at_fewer_elements_is_caught(blind: str) -> None:
    with pytest.raises(AssertionError):
        agrees(mutant(*BLIND[blind]), shrink=False)


# Survivors of mutmut over examples.py (docs/mutation.md): the edges the property's draws did not reach.


def test_a_real_exactly_half_a_last_place_off_matches_either_neighbour() -> None:
    """0.125 is exactly 0.12 + 0.005 and 0.13 - 0.005 (binary-exact): within half a last place of both."""
    assert match_json(Decimal("0.12"), 0.125) == []
    assert match_json(Decimal("0.13"), 0.125) == []
    assert match_json(Decimal("0.12"), 0.126) == ["$: shown 0.12, got 0.126"]


@pytest.mark.parametrize("real", [True, False, "0.5", None, [0.5], {"x": 0.5}])
def test_a_decimal_shown_where_the_answer_is_no_number_is_a_difference_not_an_error(real: Any) -> None:
    assert match_json(Decimal("0.5"), real) == [f"$: shown Decimal('0.5'), got {real!r}"]


def test_an_open_ended_list_checks_every_element_shown_before_its_ellipsis() -> None:
    assert match_json(["a", "b", ELLIPSIS], ["a", "b", "c"]) == []
    assert match_json(["a", "b", ELLIPSIS], ["a", "x", "c"]) == ["$[1]: shown 'b', got 'x'"]
    assert match_json(["a", "b", ELLIPSIS], ["a"]) == ["$: shown 2 or more elements, got 1"]
    assert match_json(["a", "b"], ["a"]) == ["$: shown 2 elements, got 1"]


def test_a_difference_names_its_place_through_objects_and_lists() -> None:
    assert match_json({"a": [{"b": 1}]}, {"a": [{"b": 2}]}) == ["$.a[0].b: shown 1, got 2"]
    with pytest.raises(TypeError, match=r"^\$\.a: unexpected JSON value \(1\+2j\)$"):
        match_json({"a": 1 + 2j}, {"a": 1})
