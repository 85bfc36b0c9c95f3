"""Arrow record batches as PostgreSQL's binary ``COPY`` format, built with numpy (no Python per row).

``COPY t (columns) FROM STDIN (FORMAT binary)`` reads a header, then per row a 16-bit field count
and per field a 32-bit length (-1: null) and the value in the type's binary form, big-endian
(https://www.postgresql.org/docs/current/sql-copy.html#id-1.9.3.55.9.4). Every value here is
built as a *segment* of bytes per row, and a row is the concatenation of its segments: one numpy
scatter per segment and batch, whatever the number of rows.

The types the catalog's per-head tables hold: ``smallint``, ``integer``, ``bigint``, ``real``,
``double precision``, ``boolean``, text-like (``text``, ``varchar``, enums: the label's UTF-8
bytes), and one- or two-dimensional arrays of those (a two-dimensional array from a list of
lists of equal length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
TRAILER = b"\xff\xff"

_FIXED = {"int2": ">i2", "int4": ">i4", "int8": ">i8", "float4": ">f4", "float8": ">f8", "bool": "u1"}
_TEXT = {"text", "varchar", "bpchar", "name"}


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
    sizes = np.sum([s for s, _ in segments], axis=0, dtype=np.int64)
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
        header = np.array([1, 0, kind.element.oid, width, 1], dtype=">i4").view(np.uint8)
        block = np.empty((len(array), len(header) + width * (4 + dtype.itemsize)), dtype=np.uint8)
        block[:, : len(header)] = header
        cells = block[:, len(header) :].reshape(len(array), width, 4 + dtype.itemsize)
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
