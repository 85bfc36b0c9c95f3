"""The catalog's bulk paths run with Python's cyclic garbage collector paused (service/catalogs/bulk.py), and the
pause ends as it began: nested, concurrent, on an error, and where the collector was off to begin with. That the
export, the validation and the import pause it: ``test_catalog_copy.py``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from service.catalogs import bulk
from service.catalogs.bulk import collector_paused


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_paused_inside_and_runs_again_after() -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_nested_pause_ends_with_the_outer_one() -> None:
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_inside_still_ends_the_pause() -> None:
    with pytest.raises(RuntimeError, match="boom"), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_pauses_share_one_that_ends_with_the_last() -> None:
    """Two exports served at once: the first to finish leaves the collector paused for the other."""
    entered, release_first, first_done, release_second = (threading.Event() for _ in range(4))
    seen: dict[str, bool] = {}

    def first() -> None:
        with collector_paused():
            entered.set()
            release_first.wait(timeout=60)
        first_done.set()

    def second() -> None:
        with collector_paused():
            entered.wait(timeout=60)
            release_first.set()
            first_done.wait(timeout=60)
            seen["after the first ended"] = gc.isenabled()
            release_second.wait(timeout=60)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_done.wait(timeout=60)
    release_second.set()
    for thread in threads:
        thread.join(timeout=60)
    assert seen == {"after the first ended": False}
    assert gc.isenabled()
    assert bulk._pauses == 0
