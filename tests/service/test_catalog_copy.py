"""Catalog archives at COPY speed (issue 35): the binary COPY encoder, the streaming export, every table
alike after a round trip, a part of an archive (``--model``), and an import killed while it writes.

The catalog is ``test_catalog_archive``'s (two models, a joint clustering, every kind of run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import sqlalchemy
import sqlalchemy.orm
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from service.catalogs import binary, export, importer, libpq
from service.catalogs.tables import BY_NAME as TABLES_BY_NAME
from service.catalogs.tables import TABLES
from service.errors import InvalidInput
from service.jobs.runner import run_inline
from tests.service import test_catalog_archive as base
from tests.service.synthetic import dirichlet, store_model
from tests.service.test_catalog_archive import WRITTEN, api, counts, import_archive
from tests.service.test_catalog_archive import export as export_archive
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# The catalog archive tests' fixtures: the source catalog, its archive, new catalogs.
new_catalog, source, archive = base.new_catalog, base.source, base.archive


# --- the binary COPY encoder ------------------------------------------------------------------------------


def test_binary_rows_read_back_as_written(engine: Engine) -> None:
    """Every type the per-head tables use, with nulls (rows and array elements), empty arrays and a two-dimensional
    array, and the run files' times, COPYed in as :func:`binary.encode` writes them and read back by PostgreSQL."""
    columns = {
        "a": ("int2", pa.array([1, -2, None, 32767], pa.int64())),
        "b": ("int4", pa.array([7, None, -2147483648, 0], pa.int64())),
        "c": ("int8", pa.array([2**40, 0, -1, None], pa.int64())),
        "d": ("float8", pa.array([0.1, None, -1e300, 1 / 3], pa.float64())),
        "e": ("real", pa.array([0.5, 1.25, None, -3.0], pa.float64())),
        "f": ("boolean", pa.array([True, False, None, True])),
        "g": ("varchar(16)", pa.array(["nsubj", "", None, "é ü, \"x\""])),
        "h": ("double precision[]", pa.array([[0.25, 0.75], [], None, [1.0, None, 2.5]], pa.list_(pa.float64()))),
        "i": ("real[]", pa.array([[1.5], None, [0.0, 0.125], []], pa.list_(pa.float32()))),
        "j": ("real[][]", pa.array([[[1, 2], [3, 4]], None, [], [[0.5, 0.25, 0.125]]],
                                   pa.list_(pa.list_(pa.float32())))),
        "k": ("varchar(16)[]", pa.array([["induction", "sink"], [], None, ["a,b", "NULL"]], pa.list_(pa.string()))),
        # PostgreSQL's epoch exactly, a microsecond before it, before 1970, and a null (the run files' times)
        "l": ("timestamptz", pa.array([datetime(2000, 1, 1, tzinfo=UTC), datetime(1999, 12, 31, 23, 59, 59, 999999,
                                                                             tzinfo=UTC),
                                       datetime(1969, 7, 20, 20, 17, 40, 1, tzinfo=UTC), None],
                                      pa.timestamp("us", tz="UTC"))),
    }  # fmt: skip
    with engine.connect() as connection, connection.begin():
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            cursor.execute(f"CREATE TEMP TABLE t ({', '.join(f'{n} {t}' for n, (t, _) in columns.items())})")
            types = binary.column_types(cursor, "t")
            data = binary.encode([(array, types[name]) for name, (_, array) in columns.items()])
            with cursor.copy(f"COPY t ({', '.join(columns)}) FROM STDIN (FORMAT binary)") as copy:
                copy.write(binary.HEADER + data + binary.TRAILER)
            cursor.execute(f"SELECT {', '.join(columns)} FROM t")
            got = cursor.fetchall()
    want = list(zip(*(array.to_pylist() for _, array in columns.values()), strict=True))
    assert got == want


def test_binary_rows_of_equal_arrays_read_back_as_written(engine: Engine) -> None:
    """Rows whose arrays are all as long and free of nulls take a faster path (a 2-D block): the same values."""
    rng = np.random.default_rng(3)
    vectors = np.round(rng.random((50, 21)) * 1024) / 1024  # exact in float32 and in short decimal text
    columns = {
        "v": ("double precision[]", pa.array(list(vectors), pa.list_(pa.float64()))),
        "w": ("real[]", pa.array(list(vectors[:, :4].astype(np.float32)), pa.list_(pa.float32()))),
        "n": ("bigint", pa.array(np.arange(50) * 2**33)),
        "m": ("real[][]", pa.nulls(50, pa.list_(pa.list_(pa.float32())))),
    }
    with engine.connect() as connection, connection.begin():
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            cursor.execute(f"CREATE TEMP TABLE u ({', '.join(f'{n} {t}' for n, (t, _) in columns.items())})")
            types = binary.column_types(cursor, "u")
            data = binary.encode([(array, types[name]) for name, (_, array) in columns.items()])
            with cursor.copy(f"COPY u ({', '.join(columns)}) FROM STDIN (FORMAT binary)") as copy:
                copy.write(binary.HEADER + data + binary.TRAILER)
            cursor.execute(f"SELECT {', '.join(columns)} FROM u")
            got = list(zip(*cursor.fetchall(), strict=True))
    assert list(got[0]) == columns["v"][1].to_pylist()
    # real is read back through its shortest text, which is the float32's value, not the double's
    assert np.array(got[1], dtype=np.float32).tolist() == columns["w"][1].to_pylist()
    assert list(got[2]) == columns["n"][1].to_pylist()
    assert list(got[3]) == [None] * 50


def test_a_ragged_two_dimensional_array_is_refused() -> None:
    ragged = pa.array([[[1.0, 2.0], [3.0]]], pa.list_(pa.list_(pa.float32())))
    with pytest.raises(ValueError, match="differ in length"):
        binary.encode([(ragged, binary.PgType("array", binary.PgType("float4", oid=700)))])


# --- the binary COPY decoder ------------------------------------------------------------------------------

SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 5e-324, 1 / 3]


def _copy_out(engine: Engine, columns: dict[str, tuple[str, pa.Array]], extra: str = "") -> tuple[bytes, list[Any]]:
    """The rows of ``columns`` COPYed in as :func:`binary.encode` writes them, then COPYed out in the binary format:
    the stream's bytes and the columns' types (rolled back after)."""
    with engine.connect() as connection, connection.begin() as transaction:
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            if extra:
                cursor.execute(extra)
            cursor.execute(f"CREATE TEMP TABLE d ({', '.join(f'{n} {t}' for n, (t, _) in columns.items())})")
            types = binary.column_types(cursor, "d")
            data = binary.encode([(array, types[name]) for name, (_, array) in columns.items()])
            with cursor.copy(f"COPY d ({', '.join(columns)}) FROM STDIN (FORMAT binary)") as copy:
                copy.write(binary.HEADER + data + binary.TRAILER)
            kinds = binary.result_types(cursor, f"SELECT {', '.join(columns)} FROM d")
            with cursor.copy(f"COPY d ({', '.join(columns)}) TO STDOUT (FORMAT binary)") as copy:
                out = b"".join(bytes(chunk) for chunk in copy)
        transaction.rollback()
    return out, kinds


def _decoded(stream: bytes, kinds: list[Any], schema: pa.Schema, chunk: int) -> pa.Table:
    decoder = binary.Decoder(kinds, schema)
    batches = [b for at in range(0, len(stream), chunk) if (b := decoder.feed(stream[at : at + chunk])) is not None]
    decoder.finish()
    return pa.Table.from_batches(batches, schema=schema)


def _bits(array: pa.ChunkedArray) -> list[Any]:
    """Floats as their bits (NaN, -0.0 and the rest compared exactly), at any depth of lists."""
    if pa.types.is_list(array.type):
        return [None if v is None else _bits(pa.chunked_array([pa.array(v, array.type.value_type)]))
                for v in array.to_pylist()]  # fmt: skip
    if pa.types.is_floating(array.type):
        values = array.to_numpy(zero_copy_only=False)
        bits = values.view(np.uint64 if values.dtype == np.float64 else np.uint32)
        return [None if not ok else int(b) for b, ok in zip(bits, pc.is_valid(array).to_numpy(zero_copy_only=False),
                                                                   strict=True)]  # fmt: skip
    return array.to_pylist()


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_binary_copy_out_decodes_every_type_exactly(engine: Engine, chunk: int) -> None:
    """Every type the decoder reads, COPYed out by PostgreSQL in the binary format and fed in chunks that cut rows,
    fields and length words anywhere: the values as written, floats bit for bit (NaN, infinities, -0.0, the
    smallest subnormal), nulls (values and array elements), empty arrays, enums, two-dimensional maps, times to
    the microsecond at the edges a datetime holds, arrays of text (the run files' names)."""
    n = len(SPECIAL)
    columns = {
        "a": ("int2", pa.array([1, -2, None, 32767, -32768, 0, 5], pa.int64())),
        "b": ("int4", pa.array([7, None, -2147483648, 0, 2147483647, 1, 2], pa.int64())),
        "c": ("int8", pa.array([2**62, 0, -1, None, -(2**63), 3, 4], pa.int64())),
        "d": ("float8", pa.array(SPECIAL, pa.float64())),
        "e": ("real", pa.array(np.array(SPECIAL, dtype=np.float32), pa.float32())),
        "f": ("boolean", pa.array([True, False, None, True, False, True, None])),
        "g": ("varchar(16)", pa.array(["nsubj", "", None, "é ü, \"x\"", "a\nb", "\\N", "NULL"])),
        "h": ("double precision[]", pa.array([SPECIAL, [], None, [1.0, None, 2.5], [-0.0], [float("nan")], [1e300]],
                                             pa.list_(pa.float64()))),
        "i": ("real[]", pa.array([[1.5], None, [0.0, 0.125], [], [float("inf")], [None], [-0.0, 2.0]],
                                 pa.list_(pa.float32()))),
        "j": ("real[][]", pa.array([[[1, 2], [3, 4]], None, [], [[0.5, 0.25, 0.125]], [[float("nan")]], [[-0.0], [1]],
                                    [[None, 1.0]]], pa.list_(pa.list_(pa.float32())))),
        "k": ("mood", pa.array(["happy", None, "sad", "happy", "sad", "sad", None])),
        "l": ("text", pa.array([None] * n, pa.string())),
        # PostgreSQL's epoch, a microsecond before it, before 1970, the first and last a datetime holds, a null
        "m": ("timestamptz", pa.array([datetime(2000, 1, 1, tzinfo=UTC),
                                       datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
                                       datetime(1969, 7, 20, 20, 17, 40, 1, tzinfo=UTC), None,
                                       datetime(1, 1, 1, tzinfo=UTC),
                                       datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
                                       datetime(2026, 11, 30, 5, 45, 0, 123456, tzinfo=UTC)],
                                      pa.timestamp("us", tz="UTC"))),
        "o": ("varchar(16)[]", pa.array([["induction", "sink"], [], None, ["a,b", None, "NULL"], ["é ü, \"x\""],
                                         [""], ["{}", "a\nb", "\\N"]], pa.list_(pa.string()))),
        "p": ("text[]", pa.array([None, ["x" * 300], [None], [], ["model-a", "model-b", "model-c"], None, ["z"]],
                                 pa.list_(pa.string()))),
    }  # fmt: skip
    stream, kinds = _copy_out(engine, columns, "CREATE TYPE mood AS ENUM ('sad', 'happy')")
    schema = pa.schema([pa.field(name, array.type) for name, (_, array) in columns.items()])
    assert all(binary.decodable(k, f.type) for k, f in zip(kinds, schema, strict=True))
    got = _decoded(stream, kinds, schema, chunk)
    for name, (_, array) in columns.items():
        assert _bits(got.column(name)) == _bits(pa.chunked_array([array])), name


def test_binary_copy_out_of_no_rows_and_of_many(engine: Engine) -> None:
    """An empty table decodes to no rows; a table of more rows than one chunk holds to every row, in order, across
    the chunks' boundaries; a stream cut short is refused."""
    columns = {
        "v": ("double precision[]", pa.array([], pa.list_(pa.float64()))),
        "n": ("bigint", pa.array([], pa.int64())),
    }
    stream, kinds = _copy_out(engine, columns)
    schema = pa.schema([("v", pa.list_(pa.float64())), ("n", pa.int64())])
    assert _decoded(stream, kinds, schema, 1 << 20).num_rows == 0
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((3000, 26))
    columns = {"v": ("double precision[]", pa.array(list(vectors), pa.list_(pa.float64()))),
               "n": ("bigint", pa.array(np.arange(3000) * 2**33))}  # fmt: skip
    stream, kinds = _copy_out(engine, columns)
    got = _decoded(stream, kinds, schema, 4096)
    assert got.column("n").to_pylist() == columns["n"][1].to_pylist()
    assert np.array(got.column("v").to_pylist()).view(np.uint64).tolist() == vectors.view(np.uint64).tolist()
    with pytest.raises(ValueError, match="ended early"):
        _decoded(stream[:-2], kinds, schema, 4096)


@pytest.mark.parametrize("value", ["infinity", "-infinity", "10000-01-01 00:00:00+00", "0001-01-01 00:00:00+00 BC"])
def test_a_time_no_datetime_holds_is_refused(engine: Engine, value: str) -> None:
    """PostgreSQL's infinite times and years beyond 1-9999 are refused, as the rows read one by one refuse them, not
    read as other times."""
    stream = _records(engine, f"SELECT '{value}'::timestamptz")
    kind = binary.PgType("timestamptz", oid=1184)
    with pytest.raises(ValueError, match="outside the years 1 to 9999"):
        _decoded(stream, [kind], pa.schema([("t", pa.timestamp("us", tz="UTC"))]), 1 << 20)


def test_a_column_of_an_unexpected_shape_is_refused() -> None:
    """A two-dimensional array where one dimension is expected: refused, not read as something else."""
    kind = binary.PgType("array", binary.PgType("float4", oid=700))
    data = binary.encode([(pa.array([[[1.0, 2.0]]], pa.list_(pa.list_(pa.float32()))), kind)])
    decoder = binary.Decoder([kind], pa.schema([("m", pa.list_(pa.float32()))]))
    with pytest.raises(ValueError, match="2 dimensions, expected 1"):
        decoder.feed(binary.HEADER + data + binary.TRAILER)


# --- the streaming export ---------------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["compiled-loop", "psycopg"])
def copy_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A COPY read by libpq.copy_out's compiled loop, or (False) by psycopg a message at a time."""
    if not request.param:
        monkeypatch.setattr(libpq, "_loop", lambda: None)
    return bool(request.param)


@pytest.mark.skipif(sys.platform != "linux", reason="the loop finds psycopg's libpq through /proc/self/maps")
def test_the_compiled_copy_loop_is_used_on_linux() -> None:
    """psycopg's libpq is found here (one mapped, its version psycopg's), so the export reads its COPYs through
    the compiled loop: were it not found, every export would silently take the slower path."""
    assert libpq.available()


def test_the_compiled_copy_loop_is_off_where_asked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """HEADCAT_COPY_LOOP=0 (docs/usage/cli.md): COPYs are read through psycopg, and the log says why."""
    monkeypatch.setenv("HEADCAT_COPY_LOOP", "0")
    libpq._library.cache_clear()
    libpq._functions.cache_clear()
    try:
        with caplog.at_level("INFO", logger="service.catalogs.libpq"):
            assert not libpq.available()
        assert "read through psycopg, a message at a time: HEADCAT_COPY_LOOP=0" in caplog.text
    finally:
        monkeypatch.delenv("HEADCAT_COPY_LOOP")
        libpq._library.cache_clear()
        libpq._functions.cache_clear()


def test_the_libpq_the_loop_calls_is_the_one_mapped() -> None:
    """libpq._loaded_libpq: the one libpq in /proc/self/maps, by its file's name (a bundled ``libpq-HASH.so``
    too); none where two different ones are mapped, or none."""
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42                         {}"
    bundled = "/venv/site-packages/psycopg_binary.libs/libpq-e9b5c9ac.so.5.18"
    system = "/usr/lib/x86_64-linux-gnu/libpq.so.5.15"
    maps = "\n".join(line.format(p) for p in (bundled, bundled, "/usr/lib/libpqwalreceiver.so", "/opt/libpq/libssl.so"))
    assert libpq._loaded_libpq(maps) == bundled
    assert libpq._loaded_libpq(maps + "\n" + line.format(system)) is None
    assert libpq._loaded_libpq(line.format("/usr/lib/libc.so.6")) is None
    assert libpq._loaded_libpq(line.format("/opt/with space/libpq.so.5")) == "/opt/with space/libpq.so.5"


def _received_parts(engine: Engine, statements: list[str], size: int) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """Per statement: its COPY's chunks as :func:`export._received` hands them over (split at its None markers),
    and its messages as psycopg reads them directly; over a temporary table of 500 rows with null values, null
    array elements and empty text."""
    with engine.connect() as connection, connection.begin():
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            cursor.execute("CREATE TEMP TABLE r (n bigint, v double precision[], s text) ON COMMIT DROP")
            cursor.execute(
                "INSERT INTO r SELECT i, CASE WHEN i % 3 = 0 THEN NULL ELSE ARRAY[i, NULL, 0.5] END, "
                "CASE WHEN i % 2 = 0 THEN NULL ELSE repeat('x', i % 7) END FROM generate_series(1, 500) i"
            )
            messages = []
            for statement in statements:
                with cursor.copy(statement) as copy:
                    messages.append([bytes(d) for d in copy])
        parts: list[list[bytes]] = [[]]
        for data in export._received(raw, statements, size=size):
            if data is None:
                parts.append([])
            else:
                parts[-1].append(data)
        assert parts.pop() == []
    return parts, messages


def test_the_copy_reading_thread_hands_over_every_part_whole_and_in_order(engine: Engine, copy_loop: bool) -> None:
    """COPYs read ahead by their thread: each part's bytes as psycopg reads them, whole and in order, a None after
    each (also after a part of no rows); rows with null values and null array elements; every chunk but a part's
    last at least the chunk size, and one that the messages fill exactly is handed over as it is. Chunks of at
    least a byte are the messages one by one (the compiled loop's buffer grown for every one)."""
    statements = [f"COPY (SELECT n, v, s FROM r WHERE {w} ORDER BY n) TO STDOUT (FORMAT binary)"
                  for w in ("n <= 250", "false", "n > 250")]  # fmt: skip
    parts, messages = _received_parts(engine, statements, 1 << 20)
    assert [b"".join(p) for p in parts] == [b"".join(m) for m in messages]
    assert b"".join(parts[1]) == binary.HEADER + binary.TRAILER  # the part of no rows
    exact = sum(len(m) for m in messages[0][:10])  # a size the first ten messages reach exactly
    parts, messages = _received_parts(engine, statements, exact)
    assert [b"".join(p) for p in parts] == [b"".join(m) for m in messages]
    assert parts[0][0] == b"".join(messages[0][:10])
    assert all(len(c) >= exact for p in parts for c in p[:-1])
    parts, messages = _received_parts(engine, statements, 1)
    assert parts == messages
    schema = pa.schema([("n", pa.int64()), ("v", pa.list_(pa.float64())), ("s", pa.string())])
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            kinds = binary.result_types(cursor, "SELECT 1::bigint, ARRAY[1.0]::double precision[], ''::text")
    got = _decoded(b"".join(parts[0]), kinds, schema, exact)
    want = [(i, None if i % 3 == 0 else [float(i), None, 0.5], None if i % 2 == 0 else "x" * (i % 7))
            for i in range(1, 251)]  # fmt: skip
    assert list(zip(*(got.column(c).to_pylist() for c in ("n", "v", "s")), strict=True)) == want


def _records(engine: Engine, query: str) -> bytes:
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor, cursor.copy(f"COPY ({query}) TO STDOUT (FORMAT binary)") as copy:
            return b"".join(bytes(chunk) for chunk in copy)


def test_rows_of_nulls_only_read_back_with_their_trailer(engine: Engine) -> None:
    """Rows as short as a row can be (every field null): the stream, fed whole, is its rows and its end."""
    schema = pa.schema([("n", pa.int64())])
    stream = _records(engine, "SELECT NULL::bigint FROM generate_series(1, 5)")
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            kinds = binary.result_types(cursor, "SELECT NULL::bigint")
    decoder = binary.Decoder(kinds, schema)
    batch = decoder.feed(stream)
    assert batch is not None
    assert batch.column("n").to_pylist() == [None] * 5
    decoder.finish()


def test_records_read_back_as_the_rows_they_aggregate(engine: Engine) -> None:
    """Rows sent as ``string_agg(record_send(ROW(...)))`` in groups (as a regular part of a per-head file is):
    the same values as the rows one by one, nulls (values and array elements), empty text and arrays included;
    no group at all is no rows; a null group or a cut stream is refused."""
    rows = """SELECT g::bigint AS n, CASE WHEN g % 3 = 0 THEN NULL ELSE g / 7.0 END::float8 AS f,
                     CASE WHEN g % 4 = 0 THEN '' ELSE repeat('x', g % 5) END AS s,
                     CASE WHEN g % 5 = 0 THEN NULL ELSE ARRAY[g, NULL, -g]::float8[] END AS v
              FROM generate_series(1, 40) g"""
    schema = pa.schema([("n", pa.int64()), ("f", pa.float64()), ("s", pa.string()), ("v", pa.list_(pa.float64()))])
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cursor:
            kinds = binary.result_types(cursor, rows)
            cursor.execute(rows)
            want = cursor.fetchall()
    aggregated = (
        f"SELECT string_agg(record_send(ROW(n, f, s, v)), ''::bytea ORDER BY n) FROM ({rows}) r GROUP BY n / 16"
    )
    records = binary.Records(kinds, schema)
    stream = _records(engine, aggregated)
    for start in range(0, len(stream), 1000):  # in chunks, as the COPY reading thread hands them over
        records.feed(stream[start : start + 1000])
    got = records.finish()
    assert got is not None
    assert sorted(zip(*(got.column(c).to_pylist() for c in schema.names), strict=True)) == sorted(want)
    empty = binary.Records(kinds, schema)
    empty.feed(_records(engine, aggregated.replace("generate_series(1, 40)", "generate_series(1, 0)")))
    assert empty.finish() is None
    null = binary.Records(kinds, schema)
    null.feed(_records(engine, "SELECT NULL::bytea"))
    with pytest.raises(ValueError, match="a null where records were expected"):
        null.finish()
    cut = binary.Records(kinds, schema)
    cut.feed(stream[:-3])
    with pytest.raises(ValueError, match="ended early"):
        cut.finish()
    other = binary.Records(kinds[:2], schema.remove(3).remove(2))  # records of 4 fields read as 2
    other.feed(stream)
    with pytest.raises(ValueError, match="not records of 2 fields"):
        other.finish()


def test_the_copy_reading_thread_raises_its_error_in_the_reader(engine: Engine, copy_loop: bool) -> None:
    """A COPY that fails on the server: its error raised where the data is read, and the thread ended."""
    import psycopg

    with engine.connect() as connection, connection.begin():
        raw = connection.connection.driver_connection
        assert raw is not None
        received = export._received(raw, ["COPY (SELECT 1 / (g - 3) FROM generate_series(1, 5) g) TO STDOUT"])
        with pytest.raises(psycopg.errors.DivisionByZero):
            list(received)
        assert not any(t.name.startswith(("catalog-copy-out", "catalog-parquet")) and t.is_alive()
                   for t in threading.enumerate())  # fmt: skip


def test_a_copy_read_in_part_leaves_the_connection_free(engine: Engine, copy_loop: bool) -> None:
    """libpq.copy_out closed after its first chunk, the COPY still running: it is cancelled and its rest drained
    (psycopg's way), and the connection runs the next statement. Read whole: every row's bytes, then the trailer,
    also in chunks a row and a half long, and the connection idle."""
    import psycopg

    from service.jobs.queue import conninfo

    rows, text_bytes = 100_000, 100
    statement = (f"COPY (SELECT g::int, repeat('x', {text_bytes}) FROM generate_series(1, {rows}) g) "
                 "TO STDOUT (FORMAT binary)")  # fmt: skip
    url = engine.url.render_as_string(hide_password=False)
    with psycopg.connect(conninfo(url), autocommit=True) as raw:
        chunks = libpq.copy_out(raw, statement, 1 << 16)
        assert len(next(chunks)) >= 1 << 16
        chunks.close()
        assert raw.execute("SELECT 41 + 1").fetchone() == (42,)
        whole = b"".join(libpq.copy_out(raw, statement, 1 << 16))
        row = 2 + (4 + 4) + (4 + text_bytes)  # its field count, then each field's length and bytes
        assert len(whole) == len(binary.HEADER) + rows * row + len(binary.TRAILER)
        assert whole.startswith(binary.HEADER)
        assert whole.endswith(binary.TRAILER)
        # Chunks of 150 bytes: a row fits, the second does not fit beside it (the loop's buffer grown, the first kept).
        small = list(libpq.copy_out(raw, statement, 150))
        assert b"".join(small) == whole
        assert all(len(c) >= 150 for c in small[:-1])
        assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert raw.execute("SELECT 1").fetchone() == (1,)


def test_a_message_held_when_no_larger_buffer_is_had_is_freed(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop holds a message that does not fit its buffer; where the larger buffer cannot be had (MemoryError),
    libpq's message is freed all the same, the error is raised, and the connection runs the next statement."""
    import psycopg

    from service.jobs.queue import conninfo

    assert libpq.available()
    freed: list[int] = []
    free = libpq._free
    monkeypatch.setattr(libpq, "_free", lambda pointer: (freed.append(pointer), free(pointer)))
    sizes: list[int] = []

    def empty(size: int, dtype: Any) -> np.ndarray:
        sizes.append(size)
        if len(sizes) > 1:  # the first, the loop's own buffer; the next, a larger one
            raise MemoryError(f"no {size} bytes")
        return np.zeros(size, dtype=dtype)

    monkeypatch.setattr(libpq.np, "empty", empty)
    statement = "COPY (SELECT repeat('x', 1000) FROM generate_series(1, 10)) TO STDOUT (FORMAT binary)"
    with psycopg.connect(conninfo(engine.url.render_as_string(hide_password=False)), autocommit=True) as raw:
        with pytest.raises(MemoryError, match="no .* bytes"):
            list(libpq.copy_out(raw, statement, 150))
        monkeypatch.undo()
        assert len(sizes) == 2
        assert len(freed) == 1
        assert freed[0] != 0
        assert raw.execute("SELECT 1").fetchone() == (1,)


def test_a_copy_the_server_sends_slowly_is_waited_for(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled loop finds no whole message while the server is still making its rows (a sleep per row): it
    waits on the socket (libpq.WAIT, a selector's wait), and the bytes are psycopg's."""
    import selectors

    import psycopg

    from service.jobs.queue import conninfo

    if not libpq.available():
        pytest.skip("no libpq the compiled loop can call here")
    waits: list[int] = []

    class Counted(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def select(self, timeout: float | None = None) -> Any:
            waits.append(1)
            return super().select(timeout)

    # Rows of a kilobyte: the server sends its buffer (8 kB) as it fills, not only at the COPY's end.
    statement = ("COPY (SELECT g, repeat('x', 1000), pg_sleep(0.005) FROM generate_series(1, 200) g) "
                 "TO STDOUT (FORMAT binary)")  # fmt: skip
    with psycopg.connect(conninfo(engine.url.render_as_string(hide_password=False)), autocommit=True) as raw:
        with raw.cursor() as cursor, cursor.copy(statement) as copy:
            expected = b"".join(bytes(m) for m in copy)
        monkeypatch.setattr(libpq.selectors, "DefaultSelector", Counted)
        libpq.warm()  # loaded before the COPY starts: the server is still making its rows when the loop first looks
        assert b"".join(libpq.copy_out(raw, statement, 1 << 16)) == expected
    assert waits


def export_params(connection: Any) -> dict[str, list[int]]:
    model_ids = export._model_ids(connection, None)
    return {"models": model_ids, "clusterings": export._clustering_ids(connection, model_ids)}


def _derived_by_row(vectors: list[list[float | None] | None], windows: list[int]) -> dict[str, list[float | None]]:
    """head_features' window and special columns as Table.select defines them, row by row in Python."""

    def at(vector: list[float | None] | None, index: int, present: bool) -> float | None:
        return vector[index] if vector is not None and present and 0 <= index < len(vector) else None

    out = {f"w{i}": [at(v, i, w > i) for v, w in zip(vectors, windows, strict=True)] for i in range(16)}
    specials = ("self", "cls", "sep", "period", "comma")
    return out | {
        n: [at(v, w + j, True) for v, w in zip(vectors, windows, strict=True)] for j, n in enumerate(specials)
    }


@pytest.mark.parametrize(
    ("vectors", "windows"),
    [
        ([[float(10 * r + i) for i in range(21)] for r in range(5)], [16] * 5),  # one shape: a matrix's columns
        ([[float(i) for i in range(13)], [0.5] * 21, [float(-i) for i in range(9)]], [8, 16, 4]),  # mixed
        ([[1.0] * 21, None, [2.0, None] + [3.0] * 19], [16, 16, 16]),  # a null vector, a null element
        ([[float(i) for i in range(3)]] * 2, [16, 16]),  # shorter than its windows: nulls, not wrapped values
        ([], []),
    ],
)
def test_the_window_and_special_columns_are_the_vectors_values(vectors: list[Any], windows: list[int]) -> None:
    """Taken client-side from the vector (both the one-matrix way and the general one), as the reference
    query takes them: ``w{i}`` the i-th value below the run's windows, a special the value after the windows."""
    for offset in (0, 3):  # also a slice of a longer array, as a part's arrays can be
        padded = [[9.0] * 21] * offset + vectors
        array = pa.array(padded, pa.list_(pa.float64())).slice(offset)
        got = export._derived(array, pa.array(windows, pa.int64()))
        assert {name: values.to_pylist() for name, values in got.items()} == _derived_by_row(vectors, windows)


def _fetched(connection: Any, table: Any, params: dict[str, Any]) -> pa.Table:
    """A file's reference query (``Table.select``: every name joined on the server and sorted there) read row by
    row through SQLAlchemy: the reference the COPYs are checked against."""
    rows = connection.execute(text(table.select()), params).all()
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(table.columns)
    return pa.Table.from_arrays(
        [pa.array(list(values), type=column.type) for values, column in zip(columns, table.columns, strict=True)],
        schema=table.schema,
    )


def _assert_copied_as_queried(engine: Engine) -> None:
    """Each per-head file's batches from binary COPY (decoded by numpy), with the lookups' columns attached and the
    rows ordered client-side, equal the file's reference query read row by row (:func:`_fetched`)."""
    with engine.connect() as connection, connection.begin():
        connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        connection.execute(text("SET LOCAL TimeZone = 'UTC'"))
        params = export_params(connection)
        for table in TABLES:
            if not table.per_head:
                continue
            copied = pa.Table.from_batches(list(export._copied(connection, table, params)), schema=table.schema)
            assert copied.num_rows > 0, table.name
            assert copied.equals(_fetched(connection, table, params)), table.name


@pytest.mark.parametrize(
    ("part", "group", "loop"), [(1, 3, False), (export.PART, export.GROUP, False), (1, 3, True), (export.PART, 3, True)]
)
def test_the_copied_rows_are_the_rows_the_query_returns(source: Engine, part: int, group: int, loop: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Value for value and in order: floats, arrays, two-dimensional maps, nulls, roles, three stacks; also when
    the COPY is made one run (or clustering) at a time. Read by the compiled loop, a row per message; read by psycopg,
    a run's records as values of 3 heads (a run in several values, the last one short)."""
    if not loop:
        monkeypatch.setattr(libpq, "_loop", lambda: None)
    monkeypatch.setattr(export, "PART", part)
    monkeypatch.setattr(export, "GROUP", group)
    _assert_copied_as_queried(source)


def test_the_small_files_copied_are_the_rows_the_query_returns(source: Engine) -> None:
    """The files of a row per run, cluster or point come by binary COPY (export._small): each equals its reference
    query read row by row, every file with rows but the series' (exported and imported in
    tests/service/test_catalog_series.py)."""
    with source.connect() as connection, connection.begin():
        connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        connection.execute(text("SET LOCAL TimeZone = 'UTC'"))
        params = export_params(connection)
        small = [table for table in TABLES if not table.per_head]
        fetched = {t.name: _fetched(connection, t, params) for t in small}
        for table in small:
            copied = pa.Table.from_batches(list(export._small(connection, table, params)), schema=table.schema)
            assert copied.equals(fetched[table.name]), table.name
    assert [t.name for t in small if fetched[t.name].num_rows == 0] == ["series"]


def test_a_column_without_a_binary_decoding_is_named_before_any_copy(source: Engine) -> None:
    """A file's column of a type the decoding does not read (a mistake in tables.py) is refused by name, for a
    per-head file and a small one alike, before a COPY starts."""
    features, runs = TABLES_BY_NAME["head_features"], TABLES_BY_NAME["feature_runs"]
    as_interval = [dataclasses.replace(c, sql="interval '1 day'") if c.name == "entropy" else c
                   for c in features.columns]  # fmt: skip
    with source.connect() as connection, connection.begin():
        connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        params = export_params(connection)
        with pytest.raises(TypeError, match=r"head_features.parquet: column 'entropy' \(interval\) has no binary"):
            next(export._copied(connection, dataclasses.replace(features, columns=as_interval), params))
        point = [dataclasses.replace(c, sql="point(0, 0)") if c.name == "created_at" else c
                 for c in runs.columns]  # fmt: skip
        with pytest.raises(TypeError, match=r"feature_runs.parquet: column 'created_at' \(point\) has no binary"):
            next(export._small(connection, dataclasses.replace(runs, columns=point), params))


def test_the_parts_are_grouped_by_hashing_and_the_setting_is_restored(
    source: Engine, monkeypatch: pytest.MonkeyPatch, copy_loop: bool
) -> None:
    """export._grouped_by_hashing: sorts are off while a per-head file's aggregated parts are read (the client
    orders the rows, test_the_copied_rows_are_the_rows_the_query_returns), and as they were after. Parts read a
    row per message (the compiled loop) leave the setting alone."""
    decoded = export._decoded
    seen: list[str] = []

    def probed(raw: Any, parts: list[Any]) -> Any:
        seen.append(raw.execute("SHOW enable_sort").fetchone()[0])
        return decoded(raw, parts)

    monkeypatch.setattr(export, "_decoded", probed)
    with source.connect() as connection, connection.begin():
        connection.execute(text("SET LOCAL TimeZone = 'UTC'"))
        params = export_params(connection)
        for setting in ("on", "off"):
            connection.execute(text(f"SET LOCAL enable_sort = {setting}"))
            assert list(export._copied(connection, TABLES_BY_NAME["head_features"], params))
            assert connection.execute(text("SHOW enable_sort")).scalar_one() == setting
    assert seen == (["on", "off"] if copy_loop else ["off", "off"])


def test_the_heads_are_checked_beside_the_export_in_its_snapshot(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """export._heads_in_snapshot: on a connection of its own, seeing the heads as the export's snapshot does. Two
    heads swapped and committed after the export's snapshot was taken: the check still finds every stack a grid,
    and the files hold the heads as they were."""
    engine = new_catalog()
    import_archive(engine, archive)
    before = export_archive(engine, tmp_path / "before")
    checks: list[tuple[int, set[int]]] = []
    made = export._Heads.__init__

    def recorded(self: Any, connection: Any, models: list[int]) -> None:
        made(self, connection, models)
        checks.append((connection.connection.driver_connection.info.backend_pid, set(self.irregular)))

    def swapped_meanwhile(connection: Any, model_ids: list[int]) -> list[int]:
        with engine.begin() as other:  # committed after the export's first query took its snapshot
            for was, now in ((0, 99), (1, 0), (99, 1)):  # layer 0's heads 0 and 1 swap places
                other.execute(
                    text(
                        "UPDATE heads SET head = :now WHERE model_id = (SELECT min(id) FROM models) "
                        "AND stack = 'encoder' AND layer = 0 AND head = :was"
                    ),
                    {"was": was, "now": now},
                )
        checks.append((connection.connection.driver_connection.info.backend_pid, set()))
        return clustering_ids(connection, model_ids)

    clustering_ids = export._clustering_ids
    monkeypatch.setattr(export._Heads, "__init__", recorded)
    monkeypatch.setattr(export, "_clustering_ids", swapped_meanwhile)
    during = export_archive(engine, tmp_path / "during")
    (exporting, _), (checking, irregular) = checks
    assert checking != exporting
    assert irregular == set()
    for name, entry in before["files"].items():
        assert entry["sha256"] == during["files"][name]["sha256"], name
    monkeypatch.undo()
    with engine.connect() as connection:
        assert export._Heads(connection, export._model_ids(connection, None)).irregular  # the swap is there now


def test_without_a_second_connection_the_export_checks_the_heads_on_its_own(
    source: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No connection beside (the server at max_connections, here a port nothing listens on): the same files."""
    whole = export_archive(source, tmp_path / "whole")
    unreachable = make_url("postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    monkeypatch.setattr(export, "create_engine", lambda url, **kwargs: sqlalchemy.create_engine(unreachable, **kwargs))
    with caplog.at_level("INFO", logger="service.catalogs.export"):
        alone = export_archive(source, tmp_path / "alone")
    assert "checked on the export's own connection" in caplog.text
    assert {n: f["sha256"] for n, f in alone["files"].items()} == {n: f["sha256"] for n, f in whole["files"].items()}


# Each run table with a per-head table: the per-head table and its column naming the run.
PER_RUN = {
    "feature_runs": ("head_features", "feature_run_id"), "importance_runs": ("importance_scores", "run_id"),
    "attribution_runs": ("head_attributions", "attribution_run_id"),
    "syntax_runs": ("head_syntax_scores", "syntax_run_id"),
    "detection_runs": ("head_detector_scores", "detection_run_id"),
}  # fmt: skip


def _columns(connection: Any, table: str) -> list[str]:
    return list(connection.scalars(text(
        "SELECT column_name FROM information_schema.columns WHERE table_name = :t AND column_name <> 'id' "
        "ORDER BY ordinal_position"), {"t": table}))  # fmt: skip


@pytest.fixture(scope="module")
def reordered(new_catalog: Callable[[], Engine], archive: Path, tiny_bert_path: Path) -> Engine:
    """The archive's catalog where ids disagree with the files' order: each run copied as a new run (a higher id)
    that started an hour earlier (so comes first) with other values; a second stability run, and a second
    clustering, each made earlier than the first. Heads whose ids do not give their places: two of bart's decoder
    heads swapped, a-first's last head deleted; a third model, "c-regular", as ingest makes heads, whose feature
    run has 8 windows where the others have 16."""
    engine = new_catalog()
    import_archive(engine, archive, {"tiny-a": "a-first"})  # the models' names in the other order than before
    sessions = base._sessions(engine)
    with sessions() as session, session.begin():
        vectors = {"encoder": dirichlet(np.random.default_rng(7), 2, 4, num_windows=8)}  # a part of mixed widths
        store_model(session, tiny_bert_path, "c-regular", vectors, num_windows=8)
    clustering = run_inline(sessions, "clustering", {"models": ["a-first", "bart"], "k": 2, "seed": 5})
    assert clustering.status == "succeeded", clustering.error
    with engine.begin() as connection:
        connection.execute(text("UPDATE clusterings SET created_at = created_at - interval '1 day' WHERE id = :c"),
                           {"c": clustering.result["clustering_id"]})  # type: ignore[index]  # fmt: skip
        for runs, (rows, run_id) in PER_RUN.items():
            columns = _columns(connection, runs)
            listed = ", ".join(f'"{c}"' for c in columns)
            changed = listed.replace('"started_at"', "started_at - interval '1 hour'")
            copied = _columns(connection, rows)
            numbers = {"entropy", "raw", "normalized", "discrepancy", "accuracy", "induction"}
            values = ", ".join(":run" if c == run_id else f"{c} / 2" if c in numbers else f'"{c}"' for c in copied)
            for (old,) in connection.execute(text(f"SELECT id FROM {runs} ORDER BY id")).all():
                new = connection.scalar(
                    text(f"INSERT INTO {runs} ({listed}) SELECT {changed} FROM {runs} WHERE id = :old RETURNING id"),
                    {"old": old},
                )
                connection.execute(  # written in the other order than the first run's rows (a head's too)
                    text(f"INSERT INTO {rows} ({', '.join(copied)}) SELECT {values} FROM {rows} "
                         f"WHERE {run_id} = :old ORDER BY ctid DESC"),
                    {"old": old, "run": new},
                )  # fmt: skip
        connection.execute(text(
            "UPDATE stability_runs s SET created_at = created_at - interval '1 day' WHERE s.id = "
            "(SELECT max(id) FROM stability_runs t WHERE t.clustering_id = s.clustering_id)"))  # fmt: skip
        bart = "(SELECT id FROM models WHERE name = 'bart')"
        for was, now in (((0, 1), (9, 9)), ((1, 2), (0, 1)), ((9, 9), (1, 2))):  # (0, 1) and (1, 2) swap places
            connection.execute(text(f"UPDATE heads SET layer = :l, head = :h WHERE model_id = {bart} AND "
                                    "stack = 'decoder' AND layer = :wl AND head = :wh"),
                               {"l": now[0], "h": now[1], "wl": was[0], "wh": was[1]})  # fmt: skip
        connection.execute(text("DELETE FROM heads WHERE id = (SELECT max(h.id) FROM heads h JOIN models m "
                                "ON m.id = h.model_id WHERE m.name = 'a-first')"))  # fmt: skip
    return engine


@pytest.mark.parametrize("part", [1, 2, export.PART])
def test_the_copied_rows_take_the_files_order_not_the_ids(reordered: Engine, part: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Runs whose ids are in another order than the file's (by model name, start, key; stability runs by
    creation), several models and clusterings, heads whose ids do not give their places beside heads whose ids
    do, parts of 1, 2 and 32 runs: the same rows as the reference query."""
    monkeypatch.setattr(export, "PART", part)
    with reordered.connect() as connection:
        models = dict(connection.execute(text("SELECT name, id FROM models")).tuples().all())
        heads = export._Heads(connection, list(models.values()))
        assert heads.irregular == {models["a-first"], models["bart"]}  # read through the join; c-regular by id
        for runs in [*PER_RUN, "stability_runs", "clusterings"]:  # the catalog is what the test means it to be
            when = "created_at" if runs in ("stability_runs", "clusterings") else "started_at"
            order = connection.scalars(text(f"SELECT id FROM {runs} ORDER BY {when}, id")).all()
            assert order != sorted(order), runs
    _assert_copied_as_queried(reordered)


def test_an_export_that_fails_mid_file_leaves_no_copy_running(reordered: Engine, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A Parquet file that cannot be written (a full disk, say) after its first row group, while the rest of its
    COPYs are still being read: the error is the export's, the reading thread has ended, and the connection is
    free (its transaction rolls back instead of waiting on a COPY that nobody reads)."""
    written = []

    def fail(self: Any, group: pa.Table, *args: Any, **kwargs: Any) -> None:
        written.append(group.num_rows)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "PART", 1)  # six parts: more than the reading thread may hold ahead
    monkeypatch.setattr(export, "BATCH_ROWS", 1)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with reordered.connect() as connection, connection.begin():
                export._write(connection, TABLES_BY_NAME["head_features"], tmp_path / "f.parquet",
                              export_params(connection), None)  # fmt: skip
        except BaseException as error:  # handed to the test
            failed.append(error)

    worker = threading.Thread(target=run, name="failing-export")
    worker.start()
    wait_until(lambda: not worker.is_alive(), "the failed export's connection released")
    assert 1 <= len(written) <= 1 + export.WRITING  # the writing thread stops at the first error
    assert set(written) == {1}
    assert len(failed) == 1, failed
    assert isinstance(failed[0], OSError), failed
    assert not any(t.name in ("catalog-copy-out", "catalog-decode") and t.is_alive() for t in threading.enumerate())


def test_a_thread_beside_hands_over_its_error_and_ends_when_closed_early() -> None:
    """The decoding thread (``export._beside``): an error there is raised in the caller after the items before
    it; a caller that stops early ends the thread, and the thread closes what it was reading from."""
    closed = threading.Event()

    def failing() -> Any:
        yield from (1, 2)
        raise ValueError("a part that is not records")

    got: list[int] = []
    with pytest.raises(ValueError, match="not records"):
        got.extend(export._beside(failing(), 1, "catalog-decode"))
    assert got == [1, 2]

    def endless() -> Any:
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.set()

    items = export._beside(endless(), 2, "catalog-decode")
    assert [next(items), next(items)] == [1, 2]
    items.close()
    assert closed.is_set()
    assert not any(t.name == "catalog-decode" and t.is_alive() for t in threading.enumerate())


def test_an_empty_catalog_exports_every_file_empty(new_catalog: Callable[[], Engine], tmp_path: Path) -> None:
    """No model, run or head: every file is written with its schema and no rows (no lookup, part or COPY)."""
    manifest = export_archive(new_catalog(), tmp_path / "empty")
    assert manifest["models"] == {}
    for table in TABLES:
        assert manifest["files"][table.file]["rows"] == 0, table.name
        assert pq.read_table(tmp_path / "empty" / table.file).schema.equals(table.schema), table.name


def test_the_export_writes_bounded_row_groups(source: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows reach the files in row groups of ``BATCH_ROWS`` (the last: the rest), never a whole table at once;
    the files hold the same rows as with the usual batch size."""
    whole = export_archive(source, tmp_path / "whole")
    monkeypatch.setattr(export, "BATCH_ROWS", 5)
    small = export_archive(source, tmp_path / "small")
    for table in TABLES:
        file = pq.ParquetFile(tmp_path / "small" / table.file)
        sizes = [file.metadata.row_group(i).num_rows for i in range(file.metadata.num_row_groups)]
        rows = small["files"][table.file]["rows"]
        assert rows == whole["files"][table.file]["rows"]
        assert sizes == [5] * (rows // 5) + ([rows % 5] if rows % 5 else []), table.name
        assert file.read().equals(pq.read_table(tmp_path / "whole" / table.file)), table.name


def test_export_validation_and_import_run_with_the_collector_paused(
    source: Engine, new_catalog: Callable[[], Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """service/catalogs/bulk.py: each entry point pauses Python's cyclic collector for its whole run (seen from
    what each calls inside), and it runs again after."""
    import gc

    seen: list[tuple[str, bool]] = []

    def probed(module: Any, name: str) -> None:
        inner = getattr(module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, gc.isenabled()))
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for module, name in ((export, "_write"), (importer, "_check_heads"), (importer, "_write_tables")):
        probed(module, name)
    assert gc.isenabled()
    export_archive(source, tmp_path / "catalog")
    import_archive(new_catalog(), tmp_path / "catalog")
    assert {name for name, _ in seen} == {"_write", "_check_heads", "_write_tables"}
    assert not any(enabled for _, enabled in seen)
    assert gc.isenabled()


# --- every table alike --------------------------------------------------------------------------------------


# Columns an archive does not carry: when this catalog first saw a corpus.
NOT_CARRIED = {("corpora", "created_at")}


def table_rows(engine: Engine, table: str) -> list[tuple[Any, ...]]:
    """Every row of ``table`` without the columns that hold this catalog's own ids, sorted."""
    with engine.connect() as connection:
        columns = [c for c in connection.execute(text(f"SELECT * FROM {table} LIMIT 0")).keys()
                   if c != "id" and not c.endswith("_id") and (table, c) not in NOT_CARRIED]  # fmt: skip
        listed = ", ".join(f'"{c}"' for c in columns)
        return sorted(map(tuple, connection.execute(text(f"SELECT {listed} FROM {table}"))), key=repr)


COMPARED = [t for t in WRITTEN if t != "catalog_imports"]


def test_every_table_is_alike_after_a_round_trip(new_catalog: Callable[[], Engine], source: Engine,
                                                 archive: Path) -> None:  # fmt: skip
    copy = new_catalog()
    import_archive(copy, archive)
    for table in COMPARED:
        rows = table_rows(source, table)
        assert rows, table
        assert table_rows(copy, table) == rows, table


# --- a part of an archive -----------------------------------------------------------------------------------


def import_part(engine: Engine, directory: Path, models: list[str]) -> dict[str, Any]:
    job = run_inline(base._sessions(engine), "catalog_import", {"archive": str(directory), "renames": {},
                                                           "models": models})  # fmt: skip
    assert job.status == "succeeded", job.error
    assert job.result is not None
    return job.result


# Files whose rows keep a left-out clustering as null (a kept model's run): not left out.
NULLED = {"ablation_runs", "pruning_curves"}


def left_out_rows(archive: Path, keep: set[str], clusterings: set[str]) -> dict[str, int]:
    """Each file's rows that a part of ``keep``'s models leaves out, read from the files: a row of another model,
    or one naming a clustering left out (but the runs in :data:`NULLED`); files that lose none are not listed."""
    out = {}
    for table in TABLES:
        rows = pq.read_table(archive / table.file).to_pylist()
        left = sum(("model" in row and row["model"] not in keep)
                   or (table.name not in NULLED and row.get("clustering") in clusterings) for row in rows)  # fmt: skip
        if left:
            out[table.file] = left
    return out


def test_a_part_of_an_archive_is_what_an_export_of_that_part_imports(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, tmp_path: Path
) -> None:
    """``--model tiny-a`` of the whole archive writes what the archive of ``--model tiny-a`` writes: tiny-a's
    runs, not the joint clustering (bart does not come along), its ablation run's clustering null; the report
    says what was left out. The whole archive imported after it adds the rest."""
    part = new_catalog()
    result = import_part(part, archive, ["tiny-a"])
    assert result["models"] == ["tiny-a"]
    left = result["left_out"]
    assert left["models"] == ["bart"]
    clusterings = pq.read_table(archive / "clusterings.parquet").column("clustering").to_pylist()
    assert len(clusterings) == 1
    assert left["clusterings"] == clusterings
    bart_features = pq.read_table(archive / "head_features.parquet").to_pandas().query("model == 'bart'")
    assert left["rows"]["head_features.parquet"] == len(bart_features) > 0
    assert left["rows"]["head_types.parquet"] == pq.ParquetFile(archive / "head_types.parquet").metadata.num_rows
    assert left["rows"] == left_out_rows(archive, {"tiny-a"}, set(clusterings))
    reference = new_catalog()
    export_archive(source, tmp_path / "tiny-a", ["tiny-a"])
    import_archive(reference, tmp_path / "tiny-a")
    for table in COMPARED:
        assert table_rows(part, table) == table_rows(reference, table), table
    with part.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM clusterings")).scalar_one() == 0
        assert connection.execute(text("SELECT count(*) FROM ablation_runs WHERE clustering_id IS NULL")).scalar_one()

    rest = import_archive(part, archive)
    assert rest["already"] is False
    assert rest["import_id"] == result["import_id"]
    whole = new_catalog()
    import_archive(whole, archive)
    for table in COMPARED:
        if table != "ablation_runs":  # tiny-a's run came first, without the clustering (not in its archive part)
            assert table_rows(part, table) == table_rows(whole, table), table
    with part.connect() as connection:
        assert connection.execute(text("SELECT models FROM catalog_imports")).scalar_one() == ["tiny-a", "bart"]
    assert import_part(part, archive, ["bart"])["already"] is True


def test_a_part_naming_every_model_is_the_whole_archive(new_catalog: Callable[[], Engine], source: Engine,
                                                        archive: Path) -> None:  # fmt: skip
    """``--model`` with every model of the archive: nothing left out, the joint clustering (all of whose models
    come along) included; every table as the source's."""
    engine = new_catalog()
    result = import_part(engine, archive, ["bart", "tiny-a"])
    assert result["left_out"] == {"models": [], "clusterings": [], "rows": {}}
    for table in COMPARED:
        assert table_rows(engine, table) == table_rows(source, table), table


def test_an_unknown_model_of_an_archive_is_refused(archive: Path) -> None:
    checked = importer.validate(archive)
    with pytest.raises(InvalidInput, match=r"no model 'nope'; its models: bart, tiny-a"):
        importer.select(checked, ["tiny-a", "nope"])


def test_rest_import_of_an_unknown_model_answers_422(source: Engine, archive: Path) -> None:
    with api(source) as client:
        answer = client.post("/catalog/imports", json={"archive": str(archive), "models": ["nope"]})
    assert answer.status_code == 422, answer.text
    assert "no model 'nope'; its models: bart, tiny-a" in answer.text


@pytest.mark.parametrize(
    ("indexes_after", "why"),
    [(importer.INDEXES_AFTER, r"duplicate key value violates unique constraint \"pk_importance_scores\""),
     (0, r"could not create unique index \"pk_importance_scores\": Key \(model_id, run_id, head_id\)=\(\d+, \d+, "
         r"\d+\) is duplicated\.")],
    ids=["indexes-kept", "indexes-after"],
)  # fmt: skip
def test_a_head_twice_in_one_run_is_refused_naming_the_file(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    indexes_after: int, why: str,
) -> None:  # fmt: skip
    """The per-head COPY writes rows as they are: a row twice is refused by the table's primary key, as the COPY
    inserts it or as the key is built after the rows, with the file and the key named, and the transaction writes
    nothing: every index is there as before."""
    monkeypatch.setattr(importer, "INDEXES_AFTER", indexes_after)
    engine = new_catalog()
    indexes = _indexes(engine)
    twice = tmp_path / "twice"
    shutil.copytree(archive, twice)
    base.rewrite(twice, "head_importance.parquet", lambda t: pa.concat_tables([t, t.slice(2, 1)]))
    with pytest.raises(InvalidInput, match=rf"head_importance.parquet: the catalog refused it: {why}") as refused:
        import_archive(engine, twice)
    assert "\n" not in refused.value.message
    assert counts(engine) == {**dict.fromkeys(WRITTEN, 0), "catalog_imports": 0}
    assert _indexes(engine) == indexes


# --- killed while writing ------------------------------------------------------------------------------------

CHILD = """
import sys, time
from pathlib import Path
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker
from service.catalogs import importer

url, directory, marker, at = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
if len(sys.argv) > 5:
    importer.INDEXES_AFTER = int(sys.argv[5])
archive = importer.validate(directory)
calls = 0

def progress(done, total):  # called between batches, with a COPY open: stop there, and wait to be killed
    global calls
    calls += 1
    if calls == at:
        marker.write_text(str(done))
        while True:
            time.sleep(1)

with sessionmaker(bind=create_engine(url))() as session, session.begin():
    importer.write(session, archive, "killed", progress=progress)
"""


def state(engine: Engine) -> Any:
    """The killed import's backend: its state and query (None: gone)."""
    with engine.connect() as connection:
        return connection.execute(
            text("SELECT state, query FROM pg_stat_activity WHERE application_name = 'killed-import'")
        ).first()


@contextlib.contextmanager
def killed_import(engine: Engine, script: str, archive: Path, marker: Path, reached: str,
                  *extra: str) -> Iterator[None]:  # fmt: skip
    """The import ``script`` (argv: url, archive, marker, ``extra``) run in a child until it writes ``marker``; the
    body runs while the child holds its transaction open; then the child is SIGKILLed and its backend waited out."""
    url = make_url(engine.url).update_query_dict({"application_name": "killed-import"})  # keeps a socket host
    child = subprocess.Popen(
        [sys.executable, "-c", script, url.render_as_string(hide_password=False), str(archive), str(marker), *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        wait_until(lambda: marker.exists() or child.poll() is not None, f"the import to reach {reached}")
        assert child.poll() is None, "the import ended before it was killed"
        yield
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    wait_until(lambda: state(engine) is None, "the killed import's backend to end")


@pytest.mark.parametrize("at", [1, 7], ids=["first-per-head-copy", "last-per-head-copy"])
def test_an_import_killed_while_it_writes_leaves_the_catalog_as_it_was(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path, at: int
) -> None:
    """SIGKILL while a COPY is open (the first per-head file's, head_features; the last's, head_detections),
    after the models, heads and runs are written in the transaction: nothing of it stays."""
    engine = new_catalog()
    import_part(engine, archive, ["tiny-a"])  # a catalog with something in it
    before = counts(engine)
    with killed_import(engine, CHILD, archive, tmp_path / "writing", "its COPY", str(at)):
        writing = state(engine)
        assert writing is not None
        assert writing.query.startswith("COPY ")
        with engine.connect() as connection:  # the transaction has written heads (bart's) so far
            assert connection.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE a.application_name = 'killed-import' AND l.locktype = 'relation' "
                "AND l.mode = 'RowExclusiveLock' AND l.relation = 'heads'::regclass")).scalar_one() == 1  # fmt: skip
    assert counts(engine) == before
    with engine.connect() as connection:
        assert connection.execute(text("SELECT origin FROM catalog_imports")).scalars().all() == [str(archive)]


def test_the_kill_test_s_import_writes_when_not_killed(new_catalog: Callable[[], Engine], archive: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """The child of the test above, not stopped, imports the archive: the test kills a real import."""
    engine = new_catalog()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, engine.url.render_as_string(hide_password=False), str(archive),
         str(tmp_path / "never"), "0"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    detections = pq.ParquetFile(archive / "head_detections.parquet").metadata.num_rows
    assert counts(engine)["head_detector_scores"] == detections


# --- bounded reading and the heads' COPY ----------------------------------------------------------------------


def test_the_importer_reads_a_file_a_row_group_at_a_time_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of at most ``COPY_BATCH`` rows that never span a row group, and what Arrow holds while they are
    read stays about one row group's size, not the file's (one reader over the whole file kept every row group)."""
    groups, rows = 40, 2_000
    path = tmp_path / "groups.parquet"
    random = np.random.default_rng(0)  # values that do not compress: the row groups' pages are their size
    with pq.ParquetWriter(path, pa.schema([("vector", pa.list_(pa.float64()))]), compression="zstd") as writer:
        for g in range(groups):
            values = random.random((rows, 32)) + g
            writer.write_batch(pa.record_batch([pa.array(list(values))], names=["vector"]))
    monkeypatch.setattr(importer, "COPY_BATCH", 1_500)
    group_bytes = rows * 32 * 8
    base_bytes = pa.total_allocated_bytes()
    held, sizes, firsts = 0, [], []
    for batch in importer._row_group_batches(pq.ParquetFile(path), ["vector"]):
        held = max(held, pa.total_allocated_bytes() - base_bytes)
        sizes.append(batch.num_rows)
        firsts.append(batch.column(0)[0][0].as_py())
    assert sizes == [1_500, 500] * groups
    assert [int(f) for f in firsts] == [g for g in range(groups) for _ in range(2)]
    # One reader over the file held about 50 row groups' size here (all 40, and their pages); one per row group 4.
    assert held < 10 * group_bytes, (held, group_bytes)


def _head_order(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return connection.execute(
            text(
                "SELECT m.name, h.stack, h.layer, h.head FROM heads h JOIN models m ON m.id = h.model_id ORDER BY h.id"
            )
        ).all()


@pytest.mark.parametrize("chunk", ["first-model", "one"])
def test_an_import_in_small_chunks_writes_what_one_in_large_chunks_does(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, chunk: str,
) -> None:  # fmt: skip
    """Files of many row groups read in batches smaller than a row group, and the heads sent in chunks that end
    exactly where the first model's heads do (or after every model): every table as the source's, the heads' ids
    in the same order as a default import gives them."""
    usual = new_catalog()
    import_archive(usual, archive)
    monkeypatch.setattr(export, "BATCH_ROWS", 5)
    small = tmp_path / "small"
    export_archive(source, small)
    first = pq.read_table(small / "models.parquet").column("stacks")[0].as_py()
    first_heads = sum(s["layers"] * s["heads"] for s in json.loads(first).values())
    monkeypatch.setattr(importer, "COPY_BATCH", 3)
    monkeypatch.setattr(importer, "HEAD_ROWS", first_heads if chunk == "first-model" else 1)
    copy = new_catalog()
    import_archive(copy, small)
    for table in COMPARED:
        assert table_rows(copy, table) == table_rows(source, table), table
    assert _head_order(copy) == _head_order(usual)


CHILD_HEADS = """
import sys, time
from pathlib import Path
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker
from service.catalogs import importer

url, directory, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
archive = importer.validate(directory)
importer.HEAD_ROWS = 1  # each model's heads sent as soon as they are made
head_rows, models = importer._head_rows, []

def stopping(model_id, stacks):  # the second model's heads: the first's are sent, the COPY is open
    models.append(model_id)
    if len(models) == 2:
        marker.write_text(str(model_id))
        while True:
            time.sleep(1)
    return head_rows(model_id, stacks)

importer._head_rows = stopping
with sessionmaker(bind=create_engine(url))() as session, session.begin():
    importer.write(session, archive, "killed", progress=None)
"""


def test_an_import_killed_while_it_copies_the_heads_leaves_the_catalog_as_it_was(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path
) -> None:
    """SIGKILL while the heads' COPY is open, after a chunk of them was sent: nothing of the import stays."""
    engine = new_catalog()
    before = counts(engine)
    with killed_import(engine, CHILD_HEADS, archive, tmp_path / "copying-heads", "the heads' COPY"):
        writing = state(engine)
        assert writing is not None
        assert writing.query.startswith("COPY heads")
    assert counts(engine) == before


# --- indexes built after the rows ---------------------------------------------------------------------------


def _indexes(engine: Engine) -> set[tuple[str, str, bool]]:
    """Every index of the catalog's tables: its name, its definition and whether it is valid and ready."""
    with engine.connect() as connection:
        return set(connection.execute(text(
            """SELECT i.indexname, i.indexdef, x.indisvalid AND x.indisready FROM pg_indexes i
               JOIN pg_index x ON x.indexrelid = CAST(quote_ident(i.indexname) AS regclass)
               WHERE i.schemaname = 'public'""")).all())  # fmt: skip


def _named(statements: list[str]) -> list[str]:
    """The indexes and constraints ``statements`` make, by name."""
    return sorted(re.search(r'(?:INDEX|CONSTRAINT) "?(\w+)', s).group(1) for s in statements)  # type: ignore[union-attr]


@pytest.fixture
def indexes_after(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[list[str], bool]]:
    """Every COPY of an import with its table's indexes built after its rows where the table is empty
    (:data:`importer.INDEXES_AFTER` 0); per table, the statements that made them again and whether the import
    held the table ``ACCESS EXCLUSIVE`` right after deciding."""
    seen: dict[str, tuple[list[str], bool]] = {}
    dropped = importer._dropped_indexes

    def recording(session: Any, table: str) -> list[str]:
        again = dropped(session, table)
        locked = session.execute(
            text("""SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND mode = 'AccessExclusiveLock'
                    AND relation = CAST(:table AS regclass)"""),
            {"table": table},
        ).scalar_one()
        seen[table] = (again, bool(locked))
        return again

    monkeypatch.setattr(importer, "INDEXES_AFTER", 0)
    monkeypatch.setattr(importer, "_dropped_indexes", recording)
    return seen


def test_an_import_into_an_empty_catalog_builds_the_indexes_after_the_rows(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path,
    indexes_after: dict[str, tuple[list[str], bool]],
) -> None:  # fmt: skip
    """Into empty tables each COPY writes its rows, then its table's indexes are made again: every table as the
    source's, every index there as the migrations define it, valid; the heads' primary key, which the per-head
    tables' foreign keys rest on, kept as it was."""
    copy = new_catalog()
    indexes = _indexes(copy)
    import_archive(copy, archive)
    assert _indexes(copy) == indexes
    for table in COMPARED:
        assert table_rows(copy, table) == table_rows(source, table), table
    assert set(indexes_after) == {"heads", *(how.target for how in importer.HEAD_COPIES.values())}
    assert all(locked for _, locked in indexes_after.values())
    assert _named(indexes_after["heads"][0]) == ["ix_heads_id", "uq_heads_model_id_stack_layer_head"]
    assert _named(indexes_after["head_features"][0]) == ["ix_head_features_model_id_head_id", "pk_head_features"]
    assert _named(indexes_after["head_assignments"][0]) == [
        "ix_head_assignments_cluster", "ix_head_assignments_model_id_head_id", "pk_head_assignments"]  # fmt: skip


@pytest.mark.parametrize("above", [0, 1], ids=["at-the-bound", "one-above"])
def test_the_indexes_are_built_after_from_exactly_the_bound(
    new_catalog: Callable[[], Engine], archive: Path, monkeypatch: pytest.MonkeyPatch, above: int
) -> None:
    """:data:`importer.INDEXES_AFTER` is the least number of rows whose COPY has the indexes built after it: the
    heads of the archive's models (counted by hand from their stacks) at the bound are, one row short of it are
    not."""
    stacks = [json.loads(s) for s in pq.read_table(archive / "models.parquet").column("stacks").to_pylist()]
    heads = sum(s["layers"] * s["heads"] for model in stacks for s in model.values())
    seen: list[str] = []
    dropped = importer._dropped_indexes
    monkeypatch.setattr(importer, "INDEXES_AFTER", heads + above)

    def recording(session: Any, table: str) -> list[str]:
        seen.append(table)
        return dropped(session, table)

    monkeypatch.setattr(importer, "_dropped_indexes", recording)
    engine = new_catalog()
    import_archive(engine, archive)
    assert ("heads" in seen) == (above == 0)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM heads")).scalar_one() == heads


def test_a_table_that_holds_rows_keeps_its_indexes_and_its_readers(
    new_catalog: Callable[[], Engine], archive: Path, indexes_after: dict[str, tuple[list[str], bool]]
) -> None:
    """A catalog with a model in it: importing another keeps the indexes of the tables that hold rows, and does not
    lock them against readers; a table still empty (tiny-a alone has no joint clustering's assignments) has its
    indexes built after its rows."""
    engine = new_catalog()
    import_part(engine, archive, ["tiny-a"])
    indexes = _indexes(engine)
    with engine.connect() as connection:
        holding = {t for t in indexes_after if connection.execute(text(f"SELECT EXISTS (SELECT FROM {t})")).scalar()}
    assert {"heads", "head_features"} <= holding
    assert "head_assignments" not in holding
    indexes_after.clear()
    import_part(engine, archive, ["bart"])
    for table, (again, locked) in indexes_after.items():
        assert (again == [], locked) == ((True, False) if table in holding else (False, True)), table
    assert _indexes(engine) == indexes


def test_a_table_another_session_holds_keeps_its_indexes_and_is_not_waited_for(
    new_catalog: Callable[[], Engine], archive: Path, indexes_after: dict[str, tuple[list[str], bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """An empty catalog whose ``heads`` another session is reading in a transaction (``ACCESS SHARE``): the import
    does not wait for its lock (a wait would queue every later reader behind it), keeps the heads' indexes, says
    so, and builds the other tables' after their rows."""
    engine = new_catalog()
    indexes = _indexes(engine)
    with engine.connect() as reader, reader.begin():
        assert reader.execute(text("SELECT count(*) FROM heads")).scalar_one() == 0
        with caplog.at_level(logging.INFO, logger=importer.__name__):
            import_archive(engine, archive)
    assert indexes_after["heads"] == ([], False)
    assert indexes_after["head_features"][1]
    assert _named(indexes_after["head_features"][0]) == ["ix_head_features_model_id_head_id", "pk_head_features"]
    assert "heads: in use by another session, so its indexes are kept" in caplog.text
    assert _indexes(engine) == indexes


def test_a_role_that_does_not_own_a_table_keeps_its_indexes(new_catalog: Callable[[], Engine]) -> None:
    """Only the table's owner may drop its indexes: another role (one that may write the rows) keeps them. The role
    is made in the test's transaction and rolled back with it."""
    engine = new_catalog()
    role = f"headcat_writer_{os.getpid()}"
    with sqlalchemy.orm.Session(engine) as session, session.begin():
        assert _named(importer._dropped_indexes(session, "heads")) == [
            "ix_heads_id", "uq_heads_model_id_stack_layer_head"]  # fmt: skip
        session.rollback()
    with sqlalchemy.orm.Session(engine) as session, session.begin():
        session.execute(text(f'CREATE ROLE "{role}"'))
        session.execute(text(f'GRANT SELECT, INSERT ON heads TO "{role}"'))
        session.execute(text(f'SET LOCAL ROLE "{role}"'))
        assert importer._dropped_indexes(session, "heads") == []
        session.rollback()
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM pg_roles WHERE rolname = :r"), {"r": role}).scalar() == 0


def test_an_import_killed_with_its_indexes_dropped_leaves_them(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path
) -> None:
    """SIGKILL while the first per-head COPY into an empty catalog is open, its table's indexes dropped in the
    import's transaction (and the heads' made again): nothing of it stays, every index is there as before."""
    engine = new_catalog()
    before, indexes = counts(engine), _indexes(engine)
    with killed_import(engine, CHILD, archive, tmp_path / "writing", "its COPY", "1", "0"):
        with engine.connect() as connection:
            locks = connection.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE a.application_name = 'killed-import' AND l.locktype = 'relation' "
                "AND l.mode = 'AccessExclusiveLock' AND l.relation = 'head_features'::regclass"
            )).scalar_one()  # fmt: skip
        assert locks == 1
    assert counts(engine) == before
    assert _indexes(engine) == indexes


def _named_batch(windows: list[int]) -> pa.RecordBatch:
    """head_features' vector and named columns for rows of these window counts, as the export writes them:
    ``w{i}`` is the vector's value for ``i < windows`` and null from ``windows`` on; the specials follow."""
    specials = ("self", "cls", "sep", "period", "comma")
    vectors = [[float(100 * r + j) for j in range(n + len(specials))] for r, n in enumerate(windows)]
    columns: dict[str, pa.Array] = {"vector": pa.array(vectors, pa.list_(pa.float64()))}
    rows = list(zip(vectors, windows, strict=True))
    for w in range(16):
        columns[f"w{w}"] = pa.array([v[w] if w < n else None for v, n in rows], pa.float64())
    for j, name in enumerate(specials):
        columns[name] = pa.array([v[n + j] for v, n in rows], pa.float64())
    return pa.RecordBatch.from_pydict(columns)


@pytest.mark.parametrize("windows", [[16], [8], [1], [8, 16, 15]])
def test_named_window_columns_are_checked_up_to_each_runs_own_window_count(windows: list[int]) -> None:
    """A feature run of fewer than 16 windows: ``w0 .. w{n-1}`` hold the vector's values and ``w{n}`` on are null.
    An honest row passes at every count (the bound ``w == n`` is null, not a value); a value at ``w{n}``, or a
    null below it, is refused naming the column."""
    table = next(t for t in TABLES if t.name == "head_features")
    batch = _named_batch(windows)
    counts_ = np.array(windows, dtype=np.int64)
    importer._check_named(table, 0, batch, counts_)  # an honest archive

    short = int(np.argmin(counts_))
    n = windows[short]
    if n < 16:  # a value where the run has no window n
        column = batch.column(f"w{n}").to_pylist()
        column[short] = 0.5
        bad = batch.set_column(batch.schema.get_field_index(f"w{n}"), f"w{n}", pa.array(column, pa.float64()))
        with pytest.raises(importer.ArchiveError, match=rf"column 'w{n}' does not match the vector"):
            importer._check_named(table, 0, bad, counts_)
    column = batch.column(f"w{n - 1}").to_pylist()  # its last window left out
    column[short] = None
    bad = batch.set_column(batch.schema.get_field_index(f"w{n - 1}"), f"w{n - 1}", pa.array(column, pa.float64()))
    with pytest.raises(importer.ArchiveError, match=rf"column 'w{n - 1}' does not match the vector"):
        importer._check_named(table, 0, bad, counts_)
