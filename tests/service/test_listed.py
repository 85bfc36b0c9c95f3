"""Lists in messages and log lines stay readable at catalog scale: the first SHOWN values, then how many more."""

from __future__ import annotations

from service.errors import SHOWN, known, listed


def test_up_to_the_bound_every_value_is_named() -> None:
    names = [f"model-{i}" for i in range(SHOWN)]
    assert listed(names) == ", ".join(names)
    assert listed([]) == ""
    assert known([]) == "none"
    assert known(["a", "b"]) == "'a', 'b'"


def test_past_the_bound_the_rest_are_counted() -> None:
    names = [f"model-{i}" for i in range(SHOWN + 1)]
    assert listed(names) == ", ".join(names[:SHOWN]) + " and 1 more"
    assert listed(f"m{i}" for i in range(3907)).endswith(f"m{SHOWN - 1} and {3907 - SHOWN} more")
    assert known(range(SHOWN + 2)) == ", ".join(repr(i) for i in range(SHOWN)) + " and 2 more"
