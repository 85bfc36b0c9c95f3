"""Arrow record batches as PostgreSQL's binary ``COPY`` format, built with numpy (no Python per row).

``COPY t (columns) FROM STDIN (FORMAT binary)`` reads a header, then per row a 16-bit field count
and per field a 32-bit length (-1: null) and the value in the type's binary form, big-endian
(https://www.postgresql.org/docs/current/sql-copy.html#id-1.9.3.55.9.4). Every value here is
built as a *segment* of bytes per row, and a row is the concatenation of its segments: one numpy
scatter per segment and batch, whatever the number of rows.

The types the catalog's per-head tables hold: ``smallint``, ``integer``, ``bigint``, ``real``,
``double precision``, ``boolean``, text-like (``text``, ``varchar``, enums: the label's UTF-8
bytes), and one- or two-dimensional arrays of those (a two-dimensional array from a list of
lists of equal length); and, for the run files an import stages, ``timestamptz`` (from a
time-zone-aware Arrow timestamp).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
TRAILER = b"\xff\xff"

_FIXED = {"int2": ">i2", "int4": ">i4", "int8": ">i8", "float4": ">f4", "float8": ">f8", "bool": "u1"}
_TEXT = {"text", "varchar", "bpchar", "name"}
_POSTGRES_EPOCH_US = 946_684_800_000_000  # 2000-01-01 00:00 UTC in microseconds since 1970
# The times a datetime holds (years 1 to 9999), in microseconds since PostgreSQL's epoch: the row-by-row reading
# refuses any other (PostgreSQL's 'infinity' among them), and so does the decoding.
_TIMES_US = (-63_082_281_600_000_000, 252_455_615_999_999_999)


@dataclass(frozen=True)
class PgType:
    """A column's type as the binary format needs it: its name, and for an array its element's name and OID."""

    name: str  # pg_type.typname; for an enum, "enum"
    element: PgType | None = None
    oid: int = 0

    @property
    def is_array(self) -> bool:
        return self.element is not None


def column_types(cursor: object, table: str) -> dict[str, PgType]:
    """Each column of ``table`` with its type (a psycopg cursor, read before any COPY opens on it)."""
    cursor.execute(  # type: ignore[attr-defined]
        """SELECT a.attname, t.typname, t.typtype, t.oid, e.typname, e.typtype, e.oid
           FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_type e ON e.oid = t.typelem AND
                t.typcategory = 'A'
           WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped""",
        (table,),
    )
    out = {}
    for name, typname, typtype, oid, ename, etype, eoid in cursor.fetchall():  # type: ignore[attr-defined]
        if ename is not None:
            element = PgType("enum" if etype == "e" else ename, oid=eoid)
            out[name] = PgType("array", element, oid)
        else:
            out[name] = PgType("enum" if typtype == "e" else typname, oid=oid)
    return out


# A segment: (bytes per row, the rows' bytes one after the other).
Segment = tuple[np.ndarray, np.ndarray]


def _concat(segments: list[Segment]) -> Segment:
    """Per row, its bytes of each segment in turn."""
    sizes = np.asarray(np.sum([s for s, _ in segments], axis=0, dtype=np.int64))
    total = int(sizes.sum())
    widths = [int(s[0]) if len(s) and (s == s[0]).all() else None for s, _ in segments]
    if len(sizes) and all(w is not None for w in widths):  # every row as wide: columns of a 2-D block
        block = np.empty((len(sizes), int(sizes[0])), dtype=np.uint8)
        at = 0
        for width, (_, data) in zip(widths, segments, strict=True):
            assert width is not None
            block[:, at : at + width] = data.reshape(len(sizes), width)
            at += width
        return sizes, block.reshape(-1)
    out = np.empty(total, dtype=np.uint8)
    starts = np.cumsum(sizes) - sizes  # where each row begins in ``out``
    within = np.zeros_like(starts)  # bytes of the row written so far
    for lengths, data in segments:
        lengths = lengths.astype(np.int64, copy=False)
        if data.size:
            source = np.cumsum(lengths) - lengths  # where each row's bytes begin in ``data``
            out[np.repeat(starts + within - source, lengths) + np.arange(data.size)] = data
        within += lengths
    return sizes, out


def _fixed(values: np.ndarray) -> Segment:
    """A fixed-width value per row (already in its big-endian dtype)."""
    values = np.ascontiguousarray(values)
    return np.full(len(values), values.dtype.itemsize, dtype=np.int64), values.view(np.uint8).reshape(-1)


def _int32(values: np.ndarray) -> Segment:
    return _fixed(np.asarray(values).astype(">i4"))


def _valid(array: pa.Array) -> np.ndarray:
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    return pc.is_valid(array).to_numpy(zero_copy_only=False)


def _values(array: pa.Array, kind: PgType) -> Segment:
    """Each value's bytes without its length (null: none), and the per-row sizes."""
    valid = _valid(array)
    if kind.name in _FIXED:
        dtype = np.dtype(_FIXED[kind.name])
        if kind.name == "bool":
            numbers = array.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8)
        else:
            numbers = array.fill_null(0).to_numpy(zero_copy_only=False).astype(dtype)
        sizes, data = _fixed(numbers)
        if valid.all():
            return sizes, data
        keep = np.repeat(valid, dtype.itemsize)
        return np.where(valid, sizes, 0), data[keep]
    if kind.name == "timestamptz" and pa.types.is_timestamp(array.type) and array.type.tz is not None:
        # an int8 of microseconds since 2000-01-01 00:00 UTC, PostgreSQL's epoch (nulls stay null)
        micros = array.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        return _values(pc.subtract(micros, _POSTGRES_EPOCH_US), PgType("int8"))
    if kind.name in _TEXT or kind.name == "enum":
        strings = array.fill_null("").cast(pa.large_string())
        offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset : strings.offset + len(array) + 1]
        raw = np.frombuffer(strings.buffers()[2], dtype=np.uint8) if strings.buffers()[2] is not None else np.empty(0)
        data = raw[offsets[0] : offsets[-1]]
        return np.diff(offsets), data  # a null is "" here: no bytes
    if kind.is_array:
        return _array(array, kind, valid)
    raise TypeError(f"no binary COPY encoding for PostgreSQL type {kind.name}")


def _array(array: pa.Array, kind: PgType, valid: np.ndarray) -> Segment:
    """A list (one dimension) or a list of equal-length lists (two) as a PostgreSQL array; null rows no bytes."""
    assert kind.element is not None
    outer = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if not valid.any():
        return np.zeros(len(array), dtype=np.int64), np.empty(0, dtype=np.uint8)
    flat = array.flatten()
    width = int(outer[0]) if len(outer) else 0
    fixed = _FIXED.get(kind.element.name)
    if (fixed and width and valid.all() and (outer == width).all() and flat.null_count == 0
            and not pa.types.is_list(flat.type)):  # fmt: skip
        # Every row a one-dimensional array of ``width`` values: a header, then (length, value) per value.
        dtype = np.dtype(fixed)
        values = flat.to_numpy(zero_copy_only=False).astype(dtype).view(np.uint8).reshape(len(array), width, -1)
        prefix = np.array([1, 0, kind.element.oid, width, 1], dtype=">i4").view(np.uint8)
        block = np.empty((len(array), len(prefix) + width * (4 + dtype.itemsize)), dtype=np.uint8)
        block[:, : len(prefix)] = prefix
        cells = block[:, len(prefix) :].reshape(len(array), width, 4 + dtype.itemsize)
        cells[:, :, :4] = np.array([dtype.itemsize], dtype=">i4").view(np.uint8)
        cells[:, :, 4:] = values
        return np.full(len(array), block.shape[1], dtype=np.int64), block.reshape(-1)
    dims = [outer]
    if pa.types.is_list(flat.type) or pa.types.is_large_list(flat.type):
        inner = pc.list_value_length(flat).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.cumsum(outer) - outer
        width = np.zeros_like(outer)
        filled = outer > 0
        width[filled] = inner[starts[filled]]
        if np.any(inner != np.repeat(width, outer)):
            raise ValueError("a two-dimensional array whose rows differ in length")
        dims.append(width)
        flat = flat.flatten()
    counts = np.prod(dims, axis=0) if len(dims) > 1 else outer  # elements per row
    element_sizes, element_data = _values(flat, kind.element)
    element_valid = _valid(flat)
    lengths = np.where(element_valid, element_sizes, -1)
    per_element = _concat([_int32(lengths), (element_sizes, element_data)])
    rows = np.repeat(np.arange(len(array)), counts)
    element_bytes = np.bincount(rows, weights=per_element[0], minlength=len(array)).astype(np.int64)
    has_null = np.bincount(rows, weights=(~element_valid).astype(np.float64), minlength=len(array)) > 0
    ndim = np.where(counts > 0, len(dims), 0)
    header = [_int32(ndim), _int32(has_null.astype(np.int32)), _int32(np.full(len(array), kind.element.oid))]
    for size in dims:  # each dimension's size and lower bound 1; an empty array (ndim 0) has none
        present = counts > 0
        header += [_masked(_int32(size), present), _masked(_int32(np.ones(len(array))), present)]
    sizes, data = _concat([*header, (element_bytes, per_element[1])])
    if valid.all():
        return sizes, data
    keep = np.repeat(valid, sizes)
    return np.where(valid, sizes, 0), data[keep]


def _masked(segment: Segment, keep: np.ndarray) -> Segment:
    """The segment with the rows not kept emptied."""
    sizes, data = segment
    return np.where(keep, sizes, 0), data[np.repeat(keep, sizes)]


def encode(columns: list[tuple[pa.Array, PgType]]) -> bytes:
    """The rows of ``columns`` (Arrow arrays of one length, each with its column's type) as binary COPY rows,
    without the header and trailer (:data:`HEADER`, :data:`TRAILER`)."""
    n = len(columns[0][0])
    segments: list[Segment] = [_fixed(np.full(n, len(columns), dtype=">i2"))]
    for array, kind in columns:
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        sizes, data = _values(array, kind)
        segments += [_int32(np.where(_valid(array), sizes, -1)), (sizes, data)]
    return _concat(segments)[1].tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Decoding: ``COPY (query) TO STDOUT (FORMAT binary)`` as Arrow arrays. Finding where each row and field begins is
# a walk from length word to length word (each field's place depends on the lengths before it), done by a compiled
# loop (numba, as ingest/kernels.py); each column's values are then gathered by position, in numpy, a block of
# rows at a time.


@numba.njit(nogil=True, cache=True)
def _i32(buf: np.ndarray, at: int) -> int:  # pragma: no cover - compiled
    value = (np.int64(buf[at]) << 24) | (np.int64(buf[at + 1]) << 16) | (np.int64(buf[at + 2]) << 8) | buf[at + 3]
    return value - (np.int64(1) << 32) if value >= (np.int64(1) << 31) else value


def warm() -> None:
    """Load the compiled loops' machinery (numba's first use in a process costs about half a second): called by a
    thread of its own while the caller waits on the server, so that the first decoding does not pay it."""
    _i32(np.zeros(4, dtype=np.uint8), 0)


@numba.njit(nogil=True, cache=True)
def _scan(buf: np.ndarray, at: int, fields: int, starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int, int]:
    """The complete rows in ``buf`` from ``at``: per row and field where its value begins and its length (-1:
    null). Returns (rows, where the rest begins, state): state 1 at the trailer, -1 at a row of another width."""
    size = len(buf)
    rows = 0
    while rows < starts.shape[0]:
        if at + 2 > size:
            return rows, at, 0
        count = (np.int64(buf[at]) << 8) | buf[at + 1]
        if count == 0xFFFF:
            return rows, at + 2, 1
        if count != fields:
            return rows, at, -1
        p = at + 2
        for f in range(fields):
            if p + 4 > size:
                return rows, at, 0
            length = _i32(buf, p)
            p += 4
            starts[rows, f] = p
            lengths[rows, f] = length
            if length > 0:
                p += length
        if p > size:
            return rows, at, 0
        rows += 1
        at = p
    return rows, at, 0


@numba.njit(nogil=True, cache=True)
def _gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """Each value's bytes (a null: none), one after the other."""
    k = 0
    for i in range(len(starts)):
        for b in range(max(lengths[i], 0)):
            out[k + b] = buf[starts[i] + b]
        k += max(lengths[i], 0)


@numba.njit(nogil=True, cache=True)
def _shapes(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, shapes: np.ndarray) -> int:  # pragma: no cover
    """Per array: dimensions (-1: null array), then each dimension's size; returns the elements in all."""
    total = 0
    for i in range(len(starts)):
        if lengths[i] < 0:
            shapes[i, 0] = -1
            continue
        ndim = _i32(buf, starts[i])
        if ndim < 0 or ndim > 2:
            return -1
        shapes[i, 0] = ndim
        count = 1 if ndim > 0 else 0
        for d in range(ndim):
            shapes[i, 1 + d] = _i32(buf, starts[i] + 12 + 8 * d)
            count *= shapes[i, 1 + d]
        total += count
    return total


@numba.njit(nogil=True, cache=True)
def _span(starts: np.ndarray, shapes: np.ndarray, i: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """Where array ``i``'s first element begins (after its header: dimensions, flags, element type, then a size and
    lower bound per dimension) and how many it has (0: empty or null)."""
    ndim = shapes[i, 0]
    if ndim <= 0:
        return 0, 0
    count = 1
    for d in range(ndim):
        count *= shapes[i, 1 + d]
    return starts[i] + 12 + 8 * ndim, count


@numba.njit(nogil=True, cache=True)
def _elements(buf: np.ndarray, starts: np.ndarray, shapes: np.ndarray, width: int, out: np.ndarray,
              valid: np.ndarray, swap: bool) -> bool:  # fmt: skip  # pragma: no cover - compiled
    """Every element of the arrays, ``width`` bytes each in the machine's order (big-endian in the stream: reversed
    where ``swap``; a null element: zeros), and whether it is not null."""
    k = 0
    for i in range(len(starts)):
        p, count = _span(starts, shapes, i)
        for _ in range(count):
            length = _i32(buf, p)
            p += 4
            if length < 0:
                valid[k] = False
            elif length != width:
                return False
            else:
                valid[k] = True
                for b in range(width):
                    out[k * width + b] = buf[p + width - 1 - b] if swap else buf[p + b]
                p += width
            k += 1
    return True


@numba.njit(nogil=True, cache=True)
def _varying(buf: np.ndarray, starts: np.ndarray, shapes: np.ndarray, at: np.ndarray,
             lengths: np.ndarray) -> None:  # fmt: skip  # pragma: no cover - compiled
    """Where each element of the arrays begins in ``buf`` and its length (-1: null): elements of any width (text)."""
    k = 0
    for i in range(len(starts)):
        p, count = _span(starts, shapes, i)
        for _ in range(count):
            length = _i32(buf, p)
            p += 4
            at[k] = p
            lengths[k] = length
            if length > 0:
                p += length
            k += 1


@numba.njit(nogil=True, cache=True)
def _swap8(buf: np.ndarray, at: int, out: np.ndarray, to: int) -> None:  # pragma: no cover - compiled
    """8 bytes reversed, written out: the compiler moves them as one word (a loop of a width known only at run time
    moved them byte by byte, 3x slower)."""
    out[to] = buf[at + 7]
    out[to + 1] = buf[at + 6]
    out[to + 2] = buf[at + 5]
    out[to + 3] = buf[at + 4]
    out[to + 4] = buf[at + 3]
    out[to + 5] = buf[at + 2]
    out[to + 6] = buf[at + 1]
    out[to + 7] = buf[at]


@numba.njit(nogil=True, cache=True)
def _elements8(buf: np.ndarray, starts: np.ndarray, shapes: np.ndarray, out: np.ndarray,
               valid: np.ndarray) -> bool:  # fmt: skip  # pragma: no cover - compiled
    """:func:`_elements` of 8-byte elements, reversed (the stream's big-endian on a little-endian machine)."""
    k = 0
    for i in range(len(starts)):
        p, count = _span(starts, shapes, i)
        for _ in range(count):
            length = _i32(buf, p)
            p += 4
            if length < 0:
                valid[k] = False
            elif length != 8:
                return False
            else:
                valid[k] = True
                _swap8(buf, p, out, k * 8)
                p += 8
            k += 1
    return True


@numba.njit(nogil=True, cache=True)
def _numbers8(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """:func:`_numbers` of 8-byte values, reversed."""
    for i in range(len(starts)):
        if lengths[i] != 8:
            for b in range(8):
                out[i * 8 + b] = 0
        else:
            _swap8(buf, starts[i], out, i * 8)


@numba.njit(nogil=True, cache=True)
def _numbers(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int, out: np.ndarray,
             swap: bool) -> None:  # fmt: skip  # pragma: no cover - compiled
    """Each value of ``width`` bytes in the machine's order (reversed where ``swap``; a null: zeros)."""
    for i in range(len(starts)):
        at = starts[i]
        if lengths[i] != width:
            for b in range(width):
                out[i * width + b] = 0
        elif swap:
            for b in range(width):
                out[i * width + b] = buf[at + width - 1 - b]
        else:
            for b in range(width):
                out[i * width + b] = buf[at + b]


_SWAP = sys.byteorder == "little"  # the stream's numbers are big-endian


_NUMERIC = {"int2": ">i2", "int4": ">i4", "int8": ">i8", "float4": ">f4", "float8": ">f8"}


def decodable(kind: PgType, target: pa.DataType) -> bool:
    """Whether :func:`decode_column` reads a column of this PostgreSQL type as this Arrow type."""
    if pa.types.is_list(target):
        if not kind.is_array or kind.element is None:
            return False
        if _is_text(kind.element):
            return pa.types.is_string(target.value_type)
        depth = 2 if pa.types.is_list(target.value_type) else 1
        leaf = target.value_type.value_type if depth == 2 else target.value_type
        return kind.element.name in _NUMERIC and (pa.types.is_floating(leaf) or pa.types.is_integer(leaf))
    if _is_text(kind):
        return pa.types.is_string(target)
    if kind.name == "bool":
        return pa.types.is_boolean(target)
    if kind.name == "timestamptz":
        return pa.types.is_timestamp(target) and target.unit == "us"
    return kind.name in _NUMERIC and (pa.types.is_floating(target) or pa.types.is_integer(target))


def _is_text(kind: PgType) -> bool:
    return kind.name in _TEXT or kind.name == "enum"


def _strings(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, target: pa.DataType) -> pa.Array:
    """Values of any width (-1: null) as strings."""
    rows = len(starts)
    valid = lengths >= 0
    sizes = np.maximum(lengths, 0).astype(np.int64)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    _gather(buf, starts, lengths, data)
    bitmap = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.LargeStringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data), bitmap).cast(target)


def _mask(valid: np.ndarray) -> np.ndarray | None:
    return None if valid.all() else ~valid


def decode_column(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, kind: PgType,
                  target: pa.DataType) -> pa.Array:  # fmt: skip
    """One column of decoded rows (each value's start in ``buf`` and length, -1: null) as an Arrow array."""
    valid = lengths >= 0
    rows = len(starts)
    if _is_text(kind):
        return _strings(buf, starts, lengths, target)
    if not kind.is_array:
        dtype = np.dtype(_NUMERIC.get(kind.name, "i8" if kind.name == "timestamptz" else "u1"))
        if np.any(lengths[valid] != dtype.itemsize):
            raise ValueError(f"a {kind.name} value of another width than {dtype.itemsize} bytes")
        raw = np.empty(rows * dtype.itemsize, dtype=np.uint8)
        if _SWAP and dtype.itemsize == 8:
            _numbers8(buf, starts, lengths, raw)
        else:
            _numbers(buf, starts, lengths, dtype.itemsize, raw, _SWAP)
        values = raw.view(dtype.newbyteorder("="))
        if kind.name == "bool":
            values = values.astype(bool)
        if kind.name == "timestamptz":  # microseconds since PostgreSQL's epoch
            if np.any(valid & ((values < _TIMES_US[0]) | (values > _TIMES_US[1]))):
                raise ValueError("a timestamp outside the years 1 to 9999 (or infinite)")
            return pa.array(values + _POSTGRES_EPOCH_US, mask=_mask(valid)).cast(target)
        return pa.array(values, mask=_mask(valid)).cast(target)
    assert kind.element is not None
    shapes = np.zeros((rows, 3), dtype=np.int64)
    total = _shapes(buf, starts, lengths, shapes)
    if total < 0:
        raise ValueError("an array of more than two dimensions")
    depth = 2 if pa.types.is_list(target.value_type) else 1
    ndim = shapes[:, 0]
    if np.any((ndim > 0) & (ndim != depth)):
        raise ValueError(f"an array of {int(ndim[(ndim > 0) & (ndim != depth)][0])} dimensions, expected {depth}")
    present = ndim > 0
    offsets = pa.array(np.concatenate([[0], np.cumsum(np.where(present, shapes[:, 1], 0))]).astype(np.int32))
    mask = _mask(valid)
    if _is_text(kind.element):
        at, sizes = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
        _varying(buf, starts, shapes, at, sizes)
        texts = _strings(buf, at, sizes, target.value_type)
        return pa.ListArray.from_arrays(offsets, texts, type=target, mask=None if mask is None else pa.array(mask))
    dtype = np.dtype(_NUMERIC[kind.element.name])
    raw = np.zeros(total * dtype.itemsize, dtype=np.uint8)
    element_valid = np.ones(total, dtype=bool)
    if _SWAP and dtype.itemsize == 8:
        whole = _elements8(buf, starts, shapes, raw, element_valid)
    else:
        whole = _elements(buf, starts, shapes, dtype.itemsize, raw, element_valid, _SWAP)
    if not whole:
        raise ValueError(f"an array element of another width than {dtype.itemsize} bytes")
    leaf = target.value_type.value_type if depth == 2 else target.value_type
    values = pa.array(raw.view(dtype.newbyteorder("=")), mask=_mask(element_valid)).cast(leaf)
    if depth == 2:
        inner = np.repeat(np.where(present, shapes[:, 2], 0), np.where(present, shapes[:, 1], 0))
        values = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(inner)]).astype(np.int32)), values)
    return pa.ListArray.from_arrays(offsets, values, type=target, mask=None if mask is None else pa.array(mask))


def result_types(cursor: object, query: str) -> list[PgType]:
    """Each result column of ``query`` with its type (read with ``LIMIT 0``, before any COPY opens)."""
    # the query is the export's, composed from tables.py's identifiers and integer ids (export._literal): no value
    # of a request or an archive is part of it
    cursor.execute(sql.SQL("SELECT * FROM ({}) q LIMIT 0").format(sql.SQL(query)))  # type: ignore[attr-defined]
    oids = [d.type_code for d in cursor.description]  # type: ignore[attr-defined]
    cursor.execute(  # type: ignore[attr-defined]
        """SELECT t.oid, t.typname, t.typtype, e.typname, e.typtype, e.oid FROM pg_type t
           LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A' WHERE t.oid = ANY(%s)""",
        (oids,),
    )
    found = {}
    for oid, typname, typtype, ename, etype, eoid in cursor.fetchall():  # type: ignore[attr-defined]
        if ename is not None:
            found[oid] = PgType("array", PgType("enum" if etype == "e" else ename, oid=eoid), oid)
        else:
            found[oid] = PgType("enum" if typtype == "e" else typname, oid=oid)
    return [found[oid] for oid in oids]


def _batch(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, kinds: list[PgType],
           schema: pa.Schema) -> pa.RecordBatch:  # fmt: skip
    """Rows whose fields begin at ``starts`` in ``buf`` (``lengths`` bytes, -1: null), one row per line."""
    columns = [
        decode_column(buf, starts[:, f], lengths[:, f], kind, schema.field(f).type) for f, kind in enumerate(kinds)
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class Decoder:
    """Binary COPY data, fed in chunks, as Arrow record batches of the complete rows so far."""

    def __init__(self, kinds: list[PgType], schema: pa.Schema) -> None:
        self.kinds, self.schema = kinds, schema
        self.rest = b""
        self.header = False
        self.ended = False

    def feed(self, data: bytes) -> pa.RecordBatch | None:
        """The rows completed by ``data`` (None: none yet)."""
        buf = np.frombuffer(self.rest + data if self.rest else data, dtype=np.uint8)
        at = 0
        if not self.header:
            if len(buf) < len(HEADER):
                self.rest = buf.tobytes()
                return None
            if buf[: len(HEADER) - 4].tobytes() != HEADER[:-4]:
                raise ValueError("not a binary COPY stream")
            at = len(HEADER) + int(_i32(buf, len(HEADER) - 4))  # the header extension's length
            self.header = True
        fields = len(self.kinds)
        capacity = (len(buf) - at) // (2 + 4 * fields) + 1  # one more than rows fit: the trailer is read too
        starts = np.empty((capacity, fields), dtype=np.int64)
        lengths = np.empty((capacity, fields), dtype=np.int64)
        rows, at, state = _scan(buf, at, fields, starts, lengths)
        if state < 0:
            raise ValueError(f"a row of another number of fields than {fields}")
        self.ended = state == 1
        self.rest = buf[at:].tobytes()
        if not rows:
            return None
        return _batch(buf, starts[:rows], lengths[:rows], self.kinds, self.schema)

    def finish(self) -> None:
        """Refuses a stream that ended before its trailer (or with bytes after it)."""
        if not self.ended or self.rest:
            raise ValueError("the binary COPY stream ended early")


@numba.njit(nogil=True, cache=True)
def _records(buf: np.ndarray, at: np.ndarray, sizes: np.ndarray, fields: int, starts: np.ndarray,
             lengths: np.ndarray) -> int:  # fmt: skip  # pragma: no cover - compiled
    """The records (``record_send``: a 32-bit field count, then per field its type's OID, a 32-bit length, -1:
    null, and the value) one after the other in each of the values at ``at`` (``sizes`` bytes): per record and
    field where its value begins and its length. Returns the records, or -1 where a value is not such records."""
    rows = 0
    for v in range(len(at)):
        p, end = at[v], at[v] + sizes[v]
        while p < end:
            if rows >= starts.shape[0] or p + 4 > end or _i32(buf, p) != fields:
                return -1
            p += 4
            for f in range(fields):
                if p + 8 > end:
                    return -1
                length = _i32(buf, p + 4)
                p += 8
                starts[rows, f] = p
                lengths[rows, f] = length
                if length > 0:
                    p += length
            if p > end:
                return -1
            rows += 1
    return rows


class Records:
    """Binary COPY data whose rows each hold one ``bytea`` of records (``string_agg(record_send(ROW(...)), '')``),
    fed in chunks: the records as one record batch at the end (a part of a per-head file: a few rows' bytes,
    without a COPY message per record)."""

    def __init__(self, kinds: list[PgType], schema: pa.Schema) -> None:
        self.kinds, self.schema = kinds, schema
        self.chunks: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.chunks.append(data)

    def finish(self) -> pa.RecordBatch | None:
        """The records, decoded as :class:`Decoder` decodes rows; refuses a stream that is not whole."""
        buf = np.frombuffer(b"".join(self.chunks), dtype=np.uint8)
        if len(buf) < len(HEADER) or buf[: len(HEADER) - 4].tobytes() != HEADER[:-4]:
            raise ValueError("not a binary COPY stream")
        at = len(HEADER) + int(_i32(buf, len(HEADER) - 4))
        capacity = (len(buf) - at) // 6 + 1  # a row is at least 6 bytes; one more so that the trailer is read
        values, sizes = np.empty((capacity, 1), dtype=np.int64), np.empty((capacity, 1), dtype=np.int64)
        count, at, state = _scan(buf, at, 1, values, sizes)
        if state != 1 or at != len(buf):
            raise ValueError("the binary COPY stream ended early")
        if (sizes[:count, 0] < 0).any():
            raise ValueError("a null where records were expected")
        fields = len(self.kinds)
        capacity = max(int(sizes[:count, 0].sum()) // (4 + 8 * fields), 1)
        starts = np.empty((capacity, fields), dtype=np.int64)
        lengths = np.empty((capacity, fields), dtype=np.int64)
        rows = _records(buf, values[:count, 0], sizes[:count, 0], fields, starts, lengths)
        if rows < 0:
            raise ValueError(f"a value that is not records of {fields} fields")
        if not rows:
            return None
        return _batch(buf, starts[:rows], lengths[:rows], self.kinds, self.schema)
