"""What the catalog's bulk paths (export, import) share: Python's cyclic garbage collector paused while they run.

A bulk path allocates many short-lived objects (Arrow arrays, numpy arrays, the small files' rows), and every 700
allocations CPython's collector runs; each of its oldest-generation runs walks every object the process holds
(numba's compiler, SQLAlchemy, Arrow: about a million objects). At 10^6 heads that was about 0.5 s of an export's
4 to 5 s, and half a second of CPU of an import's validation (``perf``, docs/usage/catalogs.md#cost). Reference
counting still frees every object that is not in a cycle, which is all these paths make per row, part or batch:
their peak memory is the same with the collector paused (``bench/catalog.py`` measures it). Nested and concurrent
pauses (two exports served at once) share one: the collector runs again when the last ends, if it was enabled when
the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (a decorator too); see the module's docstring."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
