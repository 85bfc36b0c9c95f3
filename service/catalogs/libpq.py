"""A ``COPY ... TO STDOUT``'s data in chunks, read by a compiled loop over libpq's own calls.

psycopg hands a COPY's data over a message at a time, and the server sends a message per row: a Python call and
a ``memoryview`` per row, about 1 µs each (2 s of CPU for the 2 x 10^6 per-head rows of 10^6 heads, as much as
the server's work). :func:`copy_out` takes the messages with ``PQgetCopyData`` in a loop compiled by numba (no
GIL held), straight into a chunk's buffer: the same bytes, 0.5 s to 0.8 s of CPU. The COPY is started and, where the
reader stops early, cancelled and drained by psycopg (:class:`psycopg.Copy`), so the connection is left as psycopg
leaves it.

The loop calls the libpq that psycopg itself calls (the one library of that name this process has loaded, or
the one psycopg's pure-Python layer loaded) on psycopg's own ``PGconn``. Where that library cannot be told for
sure (no ``/proc``, or two of them loaded), or ``HEADCAT_COPY_LOOP=0``, :func:`copy_out` reads through psycopg,
message by message: the same chunks, slower.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import selectors
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numba
import numpy as np
import psycopg

log = logging.getLogger(__name__)

# _drain's outcomes besides a libpq status (-1: the COPY's end, -2: libpq failed)
WAIT, GROW, FULL = 0, 1, 2


def _loaded_libpq(maps: str) -> str | None:
    """The path of the one libpq in ``maps`` (``/proc/self/maps``' lines; None: none, or several)."""
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/libpq" in line}
    paths = {p for p in paths if Path(p).name.startswith(("libpq.so", "libpq-"))}
    return paths.pop() if len(paths) == 1 else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The libpq psycopg calls, checked by its version; None where it cannot be told for sure (logged once, why)."""

    def without(why: str) -> ctypes.CDLL | None:
        log.info("COPY data read through psycopg, a message at a time: %s", why)
        return None

    if os.environ.get("HEADCAT_COPY_LOOP", "1") == "0":
        return without("HEADCAT_COPY_LOOP=0")
    if ctypes.sizeof(ctypes.c_void_p) != ctypes.sizeof(ctypes.c_size_t):
        return without("pointers are not the width of size_t here")
    if psycopg.pq.__impl__ == "python":
        from psycopg.pq import _pq_ctypes

        library: ctypes.CDLL = _pq_ctypes.pq  # type: ignore[attr-defined]
    else:
        try:
            path = _loaded_libpq(Path("/proc/self/maps").read_text())
        except OSError:
            return without("no /proc/self/maps to find psycopg's libpq in")
        if path is None:
            return without("not one libpq mapped in this process")
        library = ctypes.CDLL(path)
    try:
        ctypes.CDLL(None)["memcpy"]
    except (OSError, AttributeError):
        return without("no C library's memcpy")
    if library.PQlibVersion() != psycopg.pq.version():
        return without(f"the libpq found is version {library.PQlibVersion()}, psycopg's {psycopg.pq.version()}")
    return library


@functools.cache
def _functions() -> tuple[Any, Any, Any, Any] | None:
    """``PQgetCopyData``, ``PQconsumeInput``, ``PQfreemem`` and libc's ``memcpy``, their pointers as size_t (the same
    registers on the 64-bit platforms numba compiles for): function objects of their own, not those psycopg's
    pure-Python layer set its own argument types on."""
    library = _library()
    if library is None:
        return None
    pointer, int_ = ctypes.c_size_t, ctypes.c_int
    return (
        ctypes.CFUNCTYPE(int_, pointer, pointer, int_)(("PQgetCopyData", library)),
        ctypes.CFUNCTYPE(int_, pointer)(("PQconsumeInput", library)),
        ctypes.CFUNCTYPE(None, pointer)(("PQfreemem", library)),
        ctypes.CFUNCTYPE(pointer, pointer, pointer, ctypes.c_size_t)(("memcpy", ctypes.CDLL(None))),
    )


def available() -> bool:
    """Whether :func:`copy_out` reads through the compiled loop."""
    return _loop() is not None


def _loop() -> Callable[..., tuple[int, int]] | None:
    """:func:`_drain` over this process's libpq, or None."""
    functions = _functions()
    return None if functions is None else functools.partial(_drain, *functions)


# The functions come as arguments (numba's first-class functions), not as globals: compiled once and cached on disk,
# as the decoding's loops are, where a function's address compiled in would be this process's alone.
@numba.njit(nogil=True, cache=True)
def _drain(get: Any, consume: Any, free: Any, memcpy: Any, conn: int, out: np.ndarray, at: int, size: int,
           held: np.ndarray) -> tuple[int, int]:  # fmt: skip  # pragma: no cover - compiled
    """Messages into ``out`` from ``at`` until ``size`` bytes are there (:data:`FULL`), the COPY ends (-1) or libpq
    fails (-2), no message is in (:data:`WAIT`: wait for the socket), or one does not fit in ``out`` (:data:`GROW`:
    ``held`` holds its pointer and length). Returns ``(bytes in out, outcome)``."""
    slot = held.ctypes.data
    tried = False
    while at < size:
        n = get(conn, slot, 1)
        if n == 0:  # nothing whole in libpq's buffer: take what the socket holds, once, then wait
            if tried:
                return at, WAIT
            if consume(conn) == 0:
                return at, -2
            tried = True
            continue
        if n < 0:
            return at, n
        tried = False
        if at + n > out.size:
            held[1] = n
            return at, GROW
        memcpy(out.ctypes.data + at, held[0], n)
        free(held[0])
        at += n
    return at, FULL


def warm() -> None:
    """Load the loop (compiled at its first use in a checkout, cached on disk after): called beside the export's
    first queries."""
    drain = _loop()
    if drain is not None:
        drain(0, np.empty(1, dtype=np.uint8), 1, 1, np.zeros(2, dtype=np.uint64))  # at == size: returns at once


def _messages(copy: psycopg.Copy, size: int) -> Iterator[bytes]:
    """psycopg's way: a Python call per message, joined into chunks of at least ``size`` bytes."""
    held: list[Any] = []
    have = 0
    while data := copy.read():
        held.append(data)
        have += len(data)
        if have >= size:
            yield b"".join(held)
            held, have = [], 0
    if held:
        yield b"".join(held)


def copy_out(raw: psycopg.Connection[Any], statement: str, size: int) -> Iterator[bytes]:
    """The data of ``statement`` (a ``COPY ... TO STDOUT``) as chunks of whole messages, each of at least ``size``
    bytes but the last. An error of the server is raised as psycopg raises it; closed early, the COPY is cancelled
    and its rest drained (psycopg's ``Copy`` ended by the exception)."""
    drain = _loop()
    with raw.cursor() as cursor, cursor.copy(statement) as copy:
        if drain is None:
            yield from _messages(copy, size)
            return
        pgconn = raw.pgconn
        conn = pgconn.pgconn_ptr  # type: ignore[attr-defined]  # the C and ctypes PGconn both have it
        held = np.zeros(2, dtype=np.uint64)  # a message that did not fit: its pointer and length
        out = np.empty(size + (size >> 2), dtype=np.uint8)
        at = 0
        # epoll where there is one: select() refuses a descriptor numbered past 1024 (a busy server's)
        with selectors.DefaultSelector() as socket:
            socket.register(pgconn.socket, selectors.EVENT_READ)
            while True:
                at, outcome = drain(conn, out, at, size, held)
                if outcome == WAIT:
                    socket.select()
                elif outcome == GROW:  # the message, libpq's to free (also where no larger buffer is had)
                    n, message = int(held[1]), int(held[0])
                    try:
                        larger = np.empty(max(2 * out.size, at + n), dtype=np.uint8)
                        larger[:at] = out[:at]
                        ctypes.memmove(larger.ctypes.data + at, message, n)
                    finally:
                        _free(message)
                    out, at = larger, at + n
                elif outcome == FULL:
                    yield out[:at].tobytes()
                    at = 0
                elif outcome == -1:  # the COPY's end: its result now, so that nothing is left pending at a yield
                    _finish(pgconn)
                    if at:
                        yield out[:at].tobytes()
                    return
                else:
                    raise psycopg.OperationalError(f"receiving copy data failed: {_message(pgconn)}")


def _free(pointer: int) -> None:
    functions = _functions()
    assert functions is not None
    functions[2](pointer)


def _message(pgconn: Any) -> str:
    return bytes(pgconn.error_message).decode("utf-8", "replace").strip()


def _finish(pgconn: Any) -> None:
    """The COPY's results after its end: COMMAND_OK, or the server's error raised as psycopg raises it."""
    results = []
    while (result := pgconn.get_result()) is not None:
        results.append(result)
    if not results:
        raise psycopg.OperationalError(f"the COPY ended without a result: {_message(pgconn)}")
    if results[0].status != psycopg.pq.ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(results[0], encoding=getattr(pgconn, "_encoding", "utf-8"))
