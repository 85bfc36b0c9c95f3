"""``headcat catalog export``: the catalog (or some of its models) as a directory of Parquet files
and a ``manifest.json``, streamed in record batches so that memory stays bounded."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from queue import Full, Queue
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from sqlalchemy import Connection, text

from service.catalogs import binary
from service.catalogs.tables import (
    FORMAT_VERSION,
    NUM_WINDOW_COLUMNS,
    RUN_KEYS,
    RUNS,
    SPECIALS,
    TABLES,
    Column,
    Table,
    run_key,
)
from service.errors import Conflict, NotFound, known

log = logging.getLogger(__name__)

BATCH_ROWS = 10_000  # rows per Parquet record batch: what the export holds in memory at once
MANIFEST = "manifest.json"
CHUNK = 1 << 20  # bytes of COPY data decoded at once
AHEAD = 4  # chunks the COPY reading thread may hold ahead of the decoding
PART = 32  # models (or clusterings) per COPY of a per-head file: the server sorts a part's rows in memory
# The run files whose rows the manifest lists under each model, with their configuration columns.
RUN_FILES = {
    "feature_runs": "feature_run", "ablation_runs": "ablation_run", "importance_runs": "importance_run",
    "pruning_curves": "pruning_curve", "attribution_runs": "attribution_run", "syntax_runs": "syntax_run",
    "detection_runs": "detection_run",
}  # fmt: skip

CONFIGURATION = ("config", "corpus", "corpus_source", "data_source", "task", "loss", "source", "parses", "stack")
Progress = Callable[[int, int], None]


def headcat_version() -> str:
    try:
        return metadata.version("headcat")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout without installing
        return "unknown"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _model_ids(connection: Connection, names: list[str] | None) -> list[int]:
    rows: dict[str, int] = dict(connection.execute(text("SELECT name, id FROM models ORDER BY name")).tuples().all())
    if not names:
        return list(rows.values())
    missing = [n for n in names if n not in rows]
    if missing:
        raise NotFound(f"model: no model named {missing[0]!r}; known models: {known(rows)}", field="model")
    return [rows[n] for n in dict.fromkeys(names)]


def _clustering_ids(connection: Connection, model_ids: list[int]) -> list[int]:
    """Complete clusterings all of whose feature runs are complete runs of the exported models."""
    return list(
        connection.scalars(
            text("""SELECT c.id FROM clusterings c WHERE c.status = 'complete' AND NOT EXISTS (
                        SELECT 1 FROM clustering_feature_runs cf JOIN feature_runs f ON f.id = cf.feature_run_id
                        WHERE cf.clustering_id = c.id AND (f.status <> 'complete' OR f.model_id <> ALL(:models)))
                    ORDER BY c.id"""),
            {"models": model_ids},
        )
    )


def _batches(connection: Connection, table: Table, params: dict[str, Any]) -> Iterator[pa.RecordBatch]:
    names = [c.name for c in table.columns]
    result = connection.execution_options(stream_results=True, yield_per=BATCH_ROWS).execute(
        text(table.select()), params
    )
    for rows in result.partitions(BATCH_ROWS):
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(names)
        yield pa.RecordBatch.from_arrays(
            [pa.array(list(values), type=column.type) for values, column in zip(columns, table.columns, strict=True)],
            schema=table.schema,
        )


def _write(connection: Connection, table: Table, path: Path, params: dict[str, Any]) -> int:
    rows = 0
    batches = _copied(connection, table, params) if table.per_head else _batches(connection, table, params)
    # Dictionary pages for the text columns only: on floats they cost most of the writing and save nothing.
    text_columns = [c.name for c in table.columns if pa.types.is_string(c.type)]
    with pq.ParquetWriter(path, table.schema, compression="zstd", use_dictionary=text_columns) as writer:
        for batch in _row_groups(batches):
            writer.write_batch(batch)
            rows += batch.num_rows
            if table.per_head:
                log.debug("%s: %d rows", table.file, rows)
    return rows


def _row_groups(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The batches again as batches of exactly :data:`BATCH_ROWS` rows (the last: the rest), one row group each."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        held.append(batch)
        count += batch.num_rows
        while count >= BATCH_ROWS:
            whole = pa.Table.from_batches(held).combine_chunks()
            yield whole.slice(0, BATCH_ROWS).to_batches()[0]
            rest = whole.slice(BATCH_ROWS)
            held, count = rest.to_batches(), rest.num_rows
    if count:
        yield pa.Table.from_batches(held).combine_chunks().to_batches()[0]


class _CopyOut(io.RawIOBase):
    """A ``COPY ... TO STDOUT`` as a file that Arrow's CSV reader reads (each read: the rows that fill it)."""

    def __init__(self, copy: Any) -> None:
        self.copy = copy
        self.held = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = len(buffer)
        chunks, have = [self.held], len(self.held)
        while have < size:
            data = self.copy.read()
            if not data:
                break
            chunks.append(bytes(data))
            have += len(data)
        data = b"".join(chunks)
        buffer[: min(size, len(data))] = data[:size]
        self.held = data[size:]
        return min(size, len(data))


def _literal(params: dict[str, Any], sql: str) -> str:
    """The statement with its id-list parameters written in (COPY takes no parameters; the ids are the catalog's)."""
    for name, ids in params.items():
        sql = sql.replace(f":{name}", "CAST('{" + ",".join(str(int(i)) for i in ids) + "}' AS int[])")
    return sql


def _copied(connection: Connection, table: Table, params: dict[str, Any]) -> Iterator[pa.RecordBatch]:
    """A per-head table's rows from ``COPY (SELECT ...) TO STDOUT``: in the binary format, decoded by
    :class:`binary.Decoder` (a compiled walk over the length words, numpy per column), where every column's type
    has a decoding; otherwise as CSV, parsed by Arrow's CSV reader. No Python object per row or value either way."""
    raw = connection.connection.driver_connection
    assert raw is not None
    sent = [c for c in table.columns if c.name not in _DERIVED.get(table.name, ())]
    query = _select(table, sent)
    with raw.cursor() as cursor:
        kinds = binary.result_types(cursor, _literal(params, query))
    schema = pa.schema([pa.field(c.name, c.type, nullable=c.nullable) for c in sent])
    if table.name in _DERIVED:
        schema = schema.append(pa.field(_WINDOWS, pa.int64()))
    if all(binary.decodable(k, f.type) for k, f in zip(kinds, schema, strict=True)):
        statements = [
            f"COPY ({_literal(part, query)}) TO STDOUT (FORMAT binary)" for part in _parts(connection, table, params)
        ]
        decoder = binary.Decoder(kinds, schema)
        for data in _received(raw, statements):
            if data is None:  # a part's COPY ended
                decoder.finish()
                decoder = binary.Decoder(kinds, schema)
            elif (batch := decoder.feed(data)) is not None:
                yield _derive(batch, table) if table.name in _DERIVED else batch
        return
    yield from _copied_csv(connection, table, params)


# head_features' window (w0..w15) and special columns are values of its vector (tables.py): the query sends the
# run's number of windows once per row instead, and they are taken from the vector here, bit for bit.
_DERIVED = {"head_features": {*(f"w{i}" for i in range(NUM_WINDOW_COLUMNS)), *SPECIALS}}
_WINDOWS = "num_windows"


def _select(table: Table, columns: list[Column]) -> str:
    if table.name not in _DERIVED:
        return table.select()
    listed = ", ".join(f'{c.sql} AS "{c.name}"' for c in columns)
    return f'SELECT {listed}, r.num_windows AS "{_WINDOWS}"\n{table.source}'


def _derive(batch: pa.RecordBatch, table: Table) -> pa.RecordBatch:
    """The batch with head_features' window and special columns taken from its vector as the query would: ``w{i}``
    the vector's ``i``-th value when the run has more than ``i`` windows, a special the value after the windows;
    null where the vector has no such value."""
    vector = batch.column("vector")
    offsets = vector.offsets.to_numpy()
    values = vector.values.to_numpy(zero_copy_only=False)
    start, lengths = offsets[:-1].astype(np.int64), np.diff(offsets).astype(np.int64)
    if vector.null_count:
        lengths = np.where(pc.is_valid(vector).to_numpy(zero_copy_only=False), lengths, 0)
    windows = batch.column(_WINDOWS).to_numpy(zero_copy_only=False).astype(np.int64)
    element_valid = pc.is_valid(vector.values).to_numpy(zero_copy_only=False) if vector.values.null_count else None

    def at(index: np.ndarray, present: np.ndarray) -> pa.Array:
        present = present & (index >= 0) & (index < lengths)
        if element_valid is not None:
            present &= element_valid[np.where(present, start + index, 0)]
        got = values[np.where(present, start + index, 0)] if len(values) else np.zeros(len(index))
        return pa.array(got, type=pa.float64(), mask=None if present.all() else ~present)

    derived = {f"w{i}": at(np.full(len(windows), i), windows > i) for i in range(NUM_WINDOW_COLUMNS)}
    derived |= {name: at(windows + j, np.ones(len(windows), dtype=bool)) for j, name in enumerate(SPECIALS)}
    return pa.RecordBatch.from_arrays(
        [derived[c.name] if c.name in derived else batch.column(c.name) for c in table.columns], schema=table.schema
    )


def _chunks(copy: Any, size: int = CHUNK) -> Iterator[bytes]:
    """A COPY's data (a message per row) in chunks of about ``size`` bytes."""
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


_END = object()


def _received(raw: Any, statements: list[str], depth: int = AHEAD, size: int = CHUNK) -> Iterator[bytes | None]:
    """The data of each ``COPY ... TO STDOUT`` in turn, in chunks (:func:`_chunks`), then None at its end; read by a
    thread of its own at most ``depth`` chunks ahead. The server's query of the next part (its sort before the first
    row) and the socket reads then overlap the decoding and the Parquet writing here (both release the GIL), and
    memory stays at ``depth`` chunks. Nothing else uses the connection meanwhile: the statements are composed first."""
    queue: Queue[Any] = Queue(depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def pump() -> None:
        try:
            for statement in statements:
                with raw.cursor() as cursor, cursor.copy(statement) as copy:
                    for data in _chunks(copy, size):
                        if not put(data):
                            return
                if not put(None):
                    return
            put(_END)
        except BaseException as error:  # handed to the reader, raised there
            put(error)

    thread = threading.Thread(target=pump, name="catalog-copy-out", daemon=True)
    thread.start()
    try:
        while (item := queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _copied_csv(connection: Connection, table: Table, params: dict[str, Any]) -> Iterator[pa.RecordBatch]:
    """A per-head table's rows from ``COPY (SELECT ...) TO STDOUT (FORMAT csv)``, parsed by Arrow's CSV reader
    (C++, a block at a time) and the arrays' text by Arrow's string kernels: no Python object per row or value."""
    text_types = {c.name: (pa.string() if pa.types.is_list(c.type) else c.type) for c in table.columns}
    options = (
        pcsv.ReadOptions(column_names=[c.name for c in table.columns], block_size=1 << 20, use_threads=False),
        pcsv.ParseOptions(newlines_in_values=True),
        pcsv.ConvertOptions(column_types=text_types, null_values=[""], strings_can_be_null=True,
                            quoted_strings_can_be_null=False, true_values=["t"], false_values=["f"]),
    )  # fmt: skip
    raw = connection.connection.driver_connection
    assert raw is not None
    for part in _parts(connection, table, params):
        statement = f"COPY ({_literal(part, table.select())}) TO STDOUT (FORMAT csv)"
        with raw.cursor() as cursor, cursor.copy(statement) as copy:
            stream = io.BufferedReader(_CopyOut(copy), 1 << 20)
            if not stream.peek(1):  # no rows (Arrow's reader refuses an empty file)
                continue
            for batch in pcsv.open_csv(stream, *options):
                yield pa.RecordBatch.from_arrays(
                    [_parsed(batch.column(c.name), c.type) for c in table.columns], schema=table.schema
                )


def _parts(connection: Connection, table: Table, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The parameters of a per-head file's query in parts of :data:`PART` models (or clusterings, for the files
    ordered by clustering first), in the file's order: the parts' rows one after the other are the file's rows
    in order, and the server sorts a part's rows in memory instead of the whole table's on disk."""
    first = table.source.rsplit("ORDER BY", 1)[1].split(",")[0].strip()  # m.name, or a clustering's created_at
    by = "models" if first == "m.name" else "clusterings"
    if by == "models":
        order = "SELECT id FROM models WHERE id = ANY(:ids) ORDER BY name"
    else:
        order = f"SELECT c.id FROM clusterings c WHERE c.id = ANY(:ids) ORDER BY c.created_at, {run_key('c')}"
    ids = list(connection.scalars(text(order), {"ids": params[by]}))
    models: dict[int, list[int]] = {}
    if by == "clusterings":  # a part of clusterings reads only its models' runs and heads
        rows = connection.execute(
            text("""SELECT DISTINCT cf.clustering_id, f.model_id FROM clustering_feature_runs cf
                    JOIN feature_runs f ON f.id = cf.feature_run_id
                    WHERE cf.clustering_id = ANY(:ids) AND f.model_id = ANY(:models)"""),
            {"ids": ids, "models": params["models"]},
        )
        for clustering, model in rows:
            models.setdefault(clustering, []).append(model)
    for start in range(0, len(ids), PART):
        part = ids[start : start + PART]
        if by == "clusterings":
            yield {**params, by: part, "models": sorted({m for c in part for m in models.get(c, [])})}
        else:
            yield {**params, by: part}


def _parsed(array: pa.Array, kind: pa.DataType) -> pa.Array:
    """A column as its type: PostgreSQL's array text (``{1,2}``, ``{{1,2},{3,4}}``, ``{}``) as a list."""
    if not pa.types.is_list(kind):
        return array
    depth = 2 if pa.types.is_list(kind.value_type) else 1
    inner = pc.utf8_slice_codeunits(array, depth, -depth)  # "{{1,2},{3,4}}" -> "1,2},{3,4"
    return _split(inner, kind, depth)


def _split(inner: pa.Array, kind: pa.DataType, depth: int) -> pa.Array:
    """Each string split into a list (``},{`` between the rows of a two-dimensional array, ``,`` between values);
    an empty string is an empty list."""
    parts = pc.split_pattern(inner, "},{" if depth == 2 else ",")
    lengths = pc.list_value_length(parts).fill_null(0).to_numpy(zero_copy_only=False)
    empty = pc.equal(inner, "").fill_null(False).to_numpy(zero_copy_only=False)
    lengths = np.where(empty, 0, lengths)
    values = parts.flatten()
    values = values.filter(pa.array(~np.repeat(empty, pc.list_value_length(parts).fill_null(0).to_numpy())))
    if depth == 2:
        values = _split(values, kind.value_type, 1)
    else:
        if pc.any(pc.match_substring(values, '"')).as_py():
            raise ValueError("a quoted array element: not a per-head array of numbers or names")
        values = values.cast(kind.value_type)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, values, type=kind, mask=pc.is_null(inner))


def _refuse_twins(path: Path, table: Table) -> None:
    """Two runs whose own columns are all the same have one key: an archive could not tell them apart."""
    key, scope = RUNS[table.name]
    columns = [key] if scope is None else [scope, key]
    seen: set[tuple[str, ...]] = set()
    for row in pq.read_table(path, columns=columns).to_pylist():
        ident = tuple(row[c] for c in columns)
        if ident in seen:
            raise Conflict(
                f"model: two {table.name} ({', '.join(ident)}) have the same columns to the microsecond, "
                "so the same key; an archive cannot tell them apart",
                field="model",
            )
        seen.add(ident)


def _runs_by_model(directory: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """model -> run file -> [the run's key, configuration and what it ran on] (run files are small)."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, key in RUN_FILES.items():
        for row in pq.read_table(directory / f"{name}.parquet").to_pylist():
            keep = {k: v for k, v in row.items() if k in CONFIGURATION}
            if "config" in keep:
                keep["config"] = json.loads(keep["config"])
            out.setdefault(row["model"], {}).setdefault(name, []).append({key: row[key], **keep})
    return out


def export_catalog(
    connection: Connection,
    directory: Path,
    models: list[str] | None = None,
    progress: Progress | None = None,
    tables: Iterable[Table] = TABLES,
) -> dict[str, Any]:
    """Write the archive of ``models`` (default: every model) into ``directory``; returns the manifest.

    Reads in one REPEATABLE READ snapshot with the session's time zone at UTC (run keys hash
    timestamps as text), so the files agree with each other while the catalog is written to.
    """
    report = progress or (lambda done, total: None)
    connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
    connection.execute(text("SET LOCAL TimeZone = 'UTC'"))
    # Every row of each cursor is read: plan for all of them, not for the first tenth (the default).
    connection.execute(text("SET LOCAL cursor_tuple_fraction = 1.0"))
    # A part's rows (PART models) sorted in memory, not in files on disk (the default 4 MB spills).
    connection.execute(text("SET LOCAL work_mem = '64MB'"))
    directory.mkdir(parents=True, exist_ok=True)
    model_ids = _model_ids(connection, models)
    params = {"models": model_ids, "clusterings": _clustering_ids(connection, model_ids)}
    files: dict[str, Any] = {}
    tables = list(tables)
    for done, table in enumerate(tables):
        report(done, len(tables))
        path = directory / table.file
        rows = _write(connection, table, path, params)
        files[table.file] = {
            "family": table.family, "description": table.description, "rows": rows, "sha256": sha256_file(path),
            "bytes": path.stat().st_size, "per_head": table.per_head,
            "columns": {c.name: str(c.type) for c in table.columns},
        }  # fmt: skip
        log.info("Exported %s: %d rows", table.file, rows)
        if table.name in RUNS:
            _refuse_twins(path, table)
    model_rows = pq.read_table(directory / "models.parquet").to_pylist()
    runs = _runs_by_model(directory)
    manifest = {
        "format": "headcat-catalog",
        "format_version": FORMAT_VERSION,
        "headcat_version": headcat_version(),
        "exported_at": datetime.now(UTC).isoformat(),
        "run_key": "md5 of the run's own columns: "
        + run_key("r", "<foreign keys>")
        + "; foreign keys left out: "
        + json.dumps(RUN_KEYS),
        "files": files,
        "models": {
            row["model"]: {
                "source": row["source"],
                "revision": row["revision"],
                "origin": "hub" if row["revision"] else "local",
                "architecture": row["architecture"],
                "stacks": json.loads(row["stacks"]),
                "current_clustering": row["current_clustering"],
                "series": row["series"],
                "step": row["step"],
                "requested_revision": row["requested_revision"],
                "runs": runs.get(row["model"], {}),
            }  # fmt: skip
            for row in model_rows
        },
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    report(len(tables), len(tables))
    return manifest
