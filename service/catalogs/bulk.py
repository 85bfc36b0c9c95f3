"""What the catalog's bulk paths (export, import) share: Python's cyclic garbage collector paused while they run.

A bulk path allocates many short-lived objects (Arrow arrays, numpy arrays, the small files' rows), and every 700
allocations CPython's collector runs; each of its oldest-generation runs walks every object the process holds
(numba's compiler, SQLAlchemy, Arrow). At 10^6 heads that was about 0.45 s of an export's 5.3 s to 6 s (runs taking
turns; ``perf`` put the collector at 13 % of its CPU) and 0.05 s to 0.2 s of an import's validation
(docs/usage/catalogs.md#cost). Reference counting still frees every object outside a cycle, which is what these
paths make: their peak memory is as it was with the collector running (``bench/catalog.py`` measures it). Nested
and concurrent pauses (two exports served at once) share one: the collector runs again when the last ends, if it
was enabled when the first began.
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
