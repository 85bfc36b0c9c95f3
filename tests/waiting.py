"""Waiting in tests: on the state itself, never for a guessed number of seconds.

A deadline here only bounds a hang. The suite runs on shared machines where seconds stretch
(a job that takes 60 s alone took over 260 s beside other work), so every deadline is
:data:`PATIENCE`, far beyond any normal run: a busy machine never fails a test, a hang still does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

#: Seconds after which a wait is a hang; ``HEADCAT_TEST_PATIENCE`` overrides it (30 minutes by default).
PATIENCE = float(os.environ.get("HEADCAT_TEST_PATIENCE", "1800"))


def wait_until(condition: Callable[[], bool], what: str | Callable[[], str], poll: float = 0.2) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` (or what it returns then) only after
    :data:`PATIENCE` seconds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what() if callable(what) else what}: not within {PATIENCE:.0f} s (HEADCAT_TEST_PATIENCE)")
        time.sleep(poll)
