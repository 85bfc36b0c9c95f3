"""``headcat catalog export``: the catalog (or some of its models) as a directory of Parquet files
and a ``manifest.json``, streamed in record batches so that memory stays bounded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from queue import Full, Queue
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from psycopg import sql
from sqlalchemy import URL, Connection, create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from service.catalogs import binary, libpq
from service.catalogs.bulk import collector_paused
from service.catalogs.tables import (
    FORMAT_VERSION,
    NUM_WINDOW_COLUMNS,
    RUN_KEYS,
    RUNS,
    SPECIALS,
    TABLES,
    Column,
    Lookup,
    Table,
    run_key,
)
from service.errors import Conflict, NotFound, known

log = logging.getLogger(__name__)

BATCH_ROWS = 10_000  # rows per Parquet record batch: what the export holds in memory at once
MANIFEST = "manifest.json"
CHUNK = 1 << 20  # bytes of COPY data decoded at once
WRITING = 2  # row groups the Parquet writing thread may be behind
AHEAD = 4  # chunks the COPY reading thread may hold ahead of the decoding
DECODED = 2  # parts the decoding thread may hold ahead of the ordering
# Snappy, Parquet's most common codec: on head_features (floats, most of an archive) zstd saved 16 % of the bytes
# and cost 2.3x the writing time, snappy 8 % for 1.2x (docs/usage/catalogs.md#cost).
COMPRESSION = "snappy"
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


def _small(connection: Connection, table: Table, params: dict[str, Any]) -> Generator[pa.RecordBatch, None, None]:
    """A file of one row per run (or cluster, point, ...): from a binary ``COPY`` of its reference query decoded as
    the per-head files are (:class:`binary.Decoder`: numbers, names, times, arrays of numbers or names)."""
    raw = connection.connection.driver_connection
    assert raw is not None
    query = _literal(params, table.select())
    with raw.cursor() as cursor:
        kinds = binary.result_types(cursor, query)
    _refuse_undecodable(table, kinds, table.schema)
    with contextlib.closing(_decoding(raw, [_Part(query, kinds, table.schema, aggregated=False)])) as decoded:
        for batches in decoded:
            yield from batches


def _refuse_undecodable(table: Table, kinds: list[binary.PgType], schema: pa.Schema) -> None:
    """Every column of a file is read by the binary decoding; a column of a type it has none for is a mistake in
    tables.py (tests/service/test_catalog_copy.py reads every file), named here before any COPY."""
    for kind, field in zip(kinds, schema, strict=True):
        if not binary.decodable(kind, field.type):
            raise TypeError(f"{table.file}: column {field.name!r} ({kind.name}) has no binary decoding as {field.type}")


def _write(
    connection: Connection, table: Table, path: Path, params: dict[str, Any], heads: _Heads | None = None
) -> int:
    rows = 0
    batches = _copied(connection, table, params, heads) if table.per_head else _small(connection, table, params)
    # Dictionary pages for the text columns only: on floats they cost most of the writing and save nothing.
    text_columns = [c.name for c in table.columns if pa.types.is_string(c.type)]
    # closed on any error here (a full disk, say): a per-head file's COPYs and their reading thread end with it.
    # The row groups are written by a thread of their own (Arrow's writer releases the GIL), at most WRITING
    # behind, while the next rows are read and decoded here.
    with (
        contextlib.closing(batches),
        pq.ParquetWriter(path, table.schema, compression=COMPRESSION, use_dictionary=text_columns) as writer,
        ThreadPoolExecutor(1, thread_name_prefix="catalog-parquet") as pool,
    ):
        pending: deque[Future[None]] = deque()
        try:
            for group in _row_groups(batches):
                pending.append(pool.submit(writer.write_table, group, row_group_size=BATCH_ROWS))
                rows += group.num_rows
                while len(pending) > WRITING or (pending and pending[0].done()):
                    pending.popleft().result()
                if table.per_head:
                    log.debug("%s: %d rows", table.file, rows)
            while pending:
                pending.popleft().result()
        finally:
            pool.shutdown(cancel_futures=True)  # on an error: no more row groups written after it
    return rows


def _row_groups(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.Table]:
    """The batches again as tables of exactly :data:`BATCH_ROWS` rows (the last: the rest), one row group each:
    slices of the batches held, not copies of them."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        held.append(batch)
        count += batch.num_rows
        while count >= BATCH_ROWS:
            whole = pa.Table.from_batches(held)
            yield whole.slice(0, BATCH_ROWS)
            rest = whole.slice(BATCH_ROWS)
            held, count = rest.to_batches(), rest.num_rows
    if count:
        yield pa.Table.from_batches(held)


def _literal(params: dict[str, Any], sql: str) -> str:
    """The statement with its id-list parameters written in (COPY takes no parameters; the ids are the catalog's)."""
    for name, ids in params.items():
        sql = sql.replace(f":{name}", "CAST('{" + ",".join(str(int(i)) for i in ids) + "}' AS int[])")
    return sql


# head_features' window (w0..w15) and special columns are values of its vector (tables.py): they are taken from the
# vector here, bit for bit, with the run's number of windows from its lookup, instead of computed and sent per row.
_DERIVED = {"head_features": {*(f"w{i}" for i in range(NUM_WINDOW_COLUMNS)), *SPECIALS}}
_WINDOWS = "num_windows"


class _Found:
    """A lookup's rows (tables.Lookup), in its query's order: each id's place is its rank in the file's order."""

    def __init__(self, connection: Connection, lookup: Lookup, table: Table, params: dict[str, Any]) -> None:
        result = connection.execute(text(lookup.sql), params).tuples().all()
        self.lookup = lookup
        self.ids = np.array([r[0] for r in result], dtype=np.int64)
        self.models: list[list[int]] = [list(r[1] or ()) for r in result]
        names = table.schema.names
        self.values = {
            name: pa.array([r[2 + i] for r in result], table.schema.field(name).type if name in names else pa.int64())
            for i, name in enumerate(lookup.columns)
        }
        self._sorted = np.argsort(self.ids, kind="stable")
        self._ordered = self.ids[self._sorted]

    def places(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row in the lookup; an id it lacks is a bug in the file's queries, never a row dropped."""
        ordered = self._ordered
        at = np.minimum(np.searchsorted(ordered, ids), max(len(ordered) - 1, 0))
        if len(ids) and (not len(ordered) or not np.array_equal(ordered[at], ids)):
            raise RuntimeError(f"a per-head row names {self.lookup.id} that its lookup lacks")
        return self._sorted[at] if len(ordered) else np.zeros(0, dtype=np.int64)


class _Heads:
    """The exported models' heads as ranges of ids: where a stack's heads hold the ids ``first + layer * heads +
    head`` (a full grid, in order: how ingest and import make them), a head's id alone gives its stack, layer and
    head, and its place in the files' order (stack, then id). Every head is checked by the query that reads them
    (one pass over the heads per export); a model with any other stack is read through the join instead."""

    SQL = """WITH s AS (
    SELECT model_id, stack, min(id) AS first, count(*) AS n, max(layer) + 1 AS layers, max(head) + 1 AS heads
    FROM heads WHERE model_id = ANY(:models) GROUP BY model_id, stack)
SELECT s.model_id, s.stack, s.first, s.layers::bigint * s.heads, s.heads,
       s.n = s.layers::bigint * s.heads AND NOT EXISTS (
           SELECT 1 FROM heads h WHERE h.model_id = s.model_id AND h.stack = s.stack
                                   AND h.id <> s.first + h.layer::bigint * s.heads + h.head)
FROM s ORDER BY s.model_id, s.stack"""

    def __init__(self, connection: Connection, models: list[int]) -> None:
        rows = connection.execute(text(self.SQL), {"models": models}).tuples().all()
        self.irregular = {model for model, *_, grid in rows if not grid}
        # a stack's rank among its model's stacks: its place in the server's order of their names (the query's)
        ranks: list[int] = []
        previous = None
        for row in rows:  # ordered by model, then stack
            ranks.append(ranks[-1] + 1 if row[0] == previous else 0)
            previous = row[0]
        kept = sorted((r[2], rank, r) for r, rank in zip(rows, ranks, strict=True) if r[0] not in self.irregular)
        self.first = np.array([r[2] for _, _, r in kept], dtype=np.int64)
        self.count = np.array([r[3] for _, _, r in kept], dtype=np.int64)
        self.heads = np.array([r[4] for _, _, r in kept], dtype=np.int64)
        self.stack = pa.array([r[1] for _, _, r in kept], pa.string())
        self.rank = np.array([rank for _, rank, _ in kept], dtype=np.int64)

    def regular(self, models: list[int]) -> bool:
        return not self.irregular.intersection(models)

    def place(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, pa.Array]]:
        """Each head's rank of its stack (the order's key before its id) and its stack, layer and head columns."""
        at = np.searchsorted(self.first, ids, side="right") - 1
        if len(ids) and ((at < 0).any() or (ids >= self.first[at] + self.count[at]).any()):
            raise RuntimeError("a per-head row names a head outside its model's stacks")
        within = ids - self.first[at]
        columns = {"stack": self.stack.take(at), "layer": pa.array(within // self.heads[at]),
                   "head": pa.array(within % self.heads[at])}  # fmt: skip
        return self.rank[at], columns


def _heads_in_snapshot(url: URL, snapshot: str, models: list[int]) -> _Heads | None:
    """The heads check (:class:`_Heads`, about half a second of the server's at 10^6 heads) on a connection of its
    own, outside the application's pool (an export never waits for, nor takes, a pooled connection), in the
    export's snapshot (``pg_export_snapshot``: it sees the heads the files are read from). Run beside the export,
    the server checks the heads while the export's connection answers the small files. None where no second
    connection can be opened (the server's ``max_connections``, say): the export checks them on its own."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        try:
            other = engine.connect()
        except OperationalError as error:
            first = str(error.orig or error).strip().splitlines()[0]
            log.info("The heads are checked on the export's own connection: no second one (%s)", first)
            return None
        with other, other.begin():
            other.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            driver = other.connection.driver_connection
            assert driver is not None
            # a utility statement takes no bound parameter: the id is quoted by the driver
            driver.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            return _Heads(other, models)
    finally:
        engine.dispose()


# Heads whose records make one value of an aggregated per-head COPY: a quarter of the COPY messages 16 heads took
# (about 0.2 s less at 10^6 heads), and with a 32 x 32 example map each still about half a megabyte a value.
GROUP = 64


@dataclass(frozen=True)
class _Form:
    """One way the server sends a per-head file's rows: ``query`` one row per head; ``aggregated`` the same rows as
    records (``record_send``) concatenated into one value per :data:`GROUP` heads of a run, so a part arrives in a
    few COPY messages instead of one per row (None: no such form). The aggregated form is sent only where a COPY is
    read a message at a time by psycopg: read by :func:`libpq.copy_out`'s compiled loop, the rows cost the server
    less as they are (docs/usage/catalogs.md#cost)."""

    query: str
    columns: list[Column]
    aggregated: str | None


def _rows_queries(table: Table) -> dict[bool, _Form]:
    """The per-head rows as the server sends them, for the models ``:models`` and the runs (or clusterings)
    ``:scope``: the lookups' ids, then the columns the file takes from the row (not those attached from a lookup
    or derived from the vector). Where the models' heads are regular (:class:`_Heads`, the key True) each row's
    head id, not joined, and also aggregated; otherwise the head's stack, layer and head, joined and sorted by head
    on the server."""
    rows = table.rows
    assert rows is not None
    attached = {name for lookup in rows.lookups for name in lookup.columns}
    sent = [c for c in table.columns if c.name not in attached and c.name not in _DERIVED.get(table.name, ())]
    ids = [Column(f"_{i}", pa.int64(), lookup.id) for i, lookup in enumerate(rows.lookups)]
    scope = rows.lookups[0].id
    where = f"WHERE x.model_id = ANY(:models) AND {scope} = ANY(:scope)"
    out = {}
    for regular in (True, False):
        columns = ids + ([Column("_head", pa.int64(), "x.head_id")] if regular else [])
        columns += [c for c in sent if not (regular and c.sql.startswith("h."))]
        listed = ", ".join(f'{c.sql} AS "{c.name}"' for c in columns)
        aggregated = None
        if regular:
            order = f"\nORDER BY {rows.then}" if rows.then else ""
            query = f"SELECT {listed}\nFROM {rows.table} x\n{where}{order}"
            within = f" ORDER BY {rows.then}" if rows.then else ""  # a head's rows stay in one record, in order
            record = f"record_send(ROW({', '.join(c.sql for c in columns)}))"
            aggregated = f"""SELECT string_agg({record}, ''::bytea{within})
FROM {rows.table} x
{where}
GROUP BY {scope}, x.head_id / {GROUP}"""
        else:
            then = f", {rows.then}" if rows.then else ""
            query = f"""SELECT {listed}
FROM {rows.table} x JOIN heads h ON h.model_id = x.model_id AND h.id = x.head_id AND h.model_id = ANY(:models)
{where}
ORDER BY h.model_id, h.stack, h.layer, h.head{then}"""
        out[regular] = _Form(query, columns, aggregated)
    return out


def _parts(found: _Found) -> Iterator[dict[str, list[int]]]:
    """The first lookup's ids (runs, or clusterings) in the file's order, :data:`PART` at a time, with the models
    whose heads they hold: the parts' rows one after the other are the file's rows in order."""
    for start in range(0, len(found.ids), PART):
        models = sorted({m for held in found.models[start : start + PART] for m in held})
        yield {"models": models, "scope": found.ids[start : start + PART].tolist()}


def _copied(
    connection: Connection, table: Table, params: dict[str, Any], heads: _Heads | None = None
) -> Generator[pa.RecordBatch, None, None]:
    """A per-head file's rows (tables.Rows), a part at a time, from ``COPY (SELECT ...) TO STDOUT (FORMAT binary)``:
    as records aggregated per :data:`GROUP` heads (:class:`binary.Records`) where the part's heads are regular and
    the COPY is read by psycopg (not :func:`libpq.available`), else a row per head (:class:`binary.Decoder`), both
    a compiled walk over the length words and numpy per column: no Python object per row or value. Each part's rows
    then take their heads' and lookups' columns and the file's order (:func:`_finished`)."""
    rows = table.rows
    assert rows is not None
    heads = heads or _Heads(connection, params["models"])
    found = [_Found(connection, lookup, table, params) for lookup in rows.lookups]
    raw = connection.connection.driver_connection
    assert raw is not None
    forms = {}
    for regular, form in _rows_queries(table).items():
        fields = [pa.field(c.name, c.type, nullable=c.nullable or c.name.startswith("_")) for c in form.columns]
        with raw.cursor() as cursor:
            kinds = binary.result_types(cursor, _literal({"models": [], "scope": []}, form.query))
        forms[regular] = form, kinds, pa.schema(fields)
    for _, kinds, schema in forms.values():
        _refuse_undecodable(table, kinds, schema)
    parts = []
    # Records aggregated on the server only where the COPY is read a message at a time (libpq.copy_out).
    by_message = not libpq.available()
    for scope in _parts(found[0]):
        form, kinds, schema = forms[heads.regular(scope["models"])]
        aggregated = form.aggregated if by_message else None
        parts.append(_Part(_literal(scope, aggregated or form.query), kinds, schema, aggregated is not None))
    hashed = _grouped_by_hashing(raw) if parts and all(p.aggregated for p in parts) else contextlib.nullcontext()
    with hashed:  # set before the reading thread's first COPY, restored after its last
        read = _decoded(raw, parts)
        with contextlib.closing(read):  # on an error here, or a reader that stops early: no COPY left running
            for batches, part in zip(read, parts, strict=True):
                yield from _finished(pa.Table.from_batches(batches, schema=part.schema), found, table, heads)


@contextlib.contextmanager
def _grouped_by_hashing(raw: Any) -> Iterator[None]:
    """A per-head file's aggregated parts grouped on the server by hashing, not by sorting (``enable_sort`` off for
    their COPYs alone): the client puts every part's rows in the file's order anyway (:func:`_finished`; a head's rows
    of a ``Rows.then`` table are ordered inside their record), so a sort on the server was that work done twice,
    about a sixth of a part's time (docs/usage/catalogs.md#cost). The setting is restored after, where the
    transaction can still run a statement."""
    with raw.cursor() as cursor:
        before = cursor.execute("SELECT current_setting('enable_sort')").fetchone()[0]
        cursor.execute("SELECT set_config('enable_sort', 'off', true)")
    try:
        yield
    finally:
        if raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            with raw.cursor() as cursor:
                cursor.execute("SELECT set_config('enable_sort', %s, true)", (before,))


@dataclass(frozen=True)
class _Part:
    """A part's statement, its columns' types, its rows' schema, and whether its rows come as records."""

    query: str
    kinds: list[binary.PgType]
    schema: pa.Schema
    aggregated: bool

    def decoder(self) -> binary.Decoder | binary.Records:
        return (binary.Records if self.aggregated else binary.Decoder)(self.kinds, self.schema)


def _decoded(raw: Any, parts: list[_Part]) -> Generator[list[pa.RecordBatch], None, None]:
    """Each part's rows, decoded from its binary COPY by a thread of its own (:func:`_beside`: the compiled walks,
    numpy and Arrow release the GIL) while the caller orders the part before and the next parts are read. Closed
    early (the reader failed, or stopped), it stops the decoding and reading threads before it returns: the
    connection is free again."""
    return _beside(_decoding(raw, parts), DECODED, "catalog-decode")


def _decoding(raw: Any, parts: list[_Part]) -> Generator[list[pa.RecordBatch], None, None]:
    statements = [f"COPY ({part.query}) TO STDOUT (FORMAT binary)" for part in parts]
    at, batches = 0, []
    decoder = parts[0].decoder() if parts else None
    with contextlib.closing(_received(raw, statements)) as received:
        for data in received:
            assert decoder is not None
            if data is None:  # a part's COPY ended
                if (last := decoder.finish()) is not None:
                    batches.append(last)
                yield batches
                at, batches = at + 1, []
                decoder = parts[at].decoder() if at < len(parts) else None
            elif (batch := decoder.feed(data)) is not None:
                batches.append(batch)


def _finished(rows: pa.Table, found: list[_Found], table: Table, heads: _Heads) -> Iterator[pa.RecordBatch]:
    """A part's rows in the file's order, with the columns its heads and lookups give: a stable sort by the ordered
    lookups' ranks (the first the most significant), then by head (its stack's rank and id) where the rows name
    their heads by id; the server's order (by head, then by ``Rows.then``) is kept within that."""
    if not rows.num_rows:
        return
    places = [f.places(rows.column(f"_{i}").to_numpy()) for i, f in enumerate(found)]
    keys = [place for place, f in zip(places, found, strict=True) if f.lookup.ordered]
    columns: dict[str, pa.Array] = {}
    if "_head" in rows.column_names:
        ids = rows.column("_head").to_numpy()
        rank, columns = heads.place(ids)
        keys += [rank, ids]
    order = np.lexsort(keys[::-1])  # numpy's lexsort is stable; its last key is the most significant
    sorted_ = bool((order[1:] > order[:-1]).all())

    def ordered(array: pa.Array) -> pa.Array:
        return array if sorted_ else array.take(order)

    columns = {name: ordered(array) for name, array in columns.items()}
    columns |= {name: ordered(rows.column(name).combine_chunks()) for name in rows.column_names}
    for place, f in zip(places, found, strict=True):
        columns |= {name: values.take(place if sorted_ else place[order]) for name, values in f.values.items()}
    if table.name in _DERIVED:
        columns |= _derived(columns["vector"], columns[_WINDOWS])
    yield pa.RecordBatch.from_arrays([columns[c.name] for c in table.columns], schema=table.schema)  # _row_groups cuts


def _derived(vector: pa.ListArray, num_windows: pa.Array) -> dict[str, pa.Array]:
    """head_features' window and special columns taken from its vector as :meth:`Table.select` computes them:
    ``w{i}`` the vector's ``i``-th value when the run has more than ``i`` windows, a special the value after the
    windows; null where the vector has no such value."""
    offsets = vector.offsets.to_numpy()
    values = vector.values.to_numpy(zero_copy_only=False)
    start, lengths = offsets[:-1].astype(np.int64), np.diff(offsets).astype(np.int64)
    if vector.null_count:
        lengths = np.where(pc.is_valid(vector).to_numpy(zero_copy_only=False), lengths, 0)
    windows = num_windows.to_numpy(zero_copy_only=False).astype(np.int64)
    if len(windows) and not vector.null_count and not vector.values.null_count and (lengths == lengths[0]).all() \
            and (windows == windows[0]).all():  # fmt: skip
        # every vector as long, every run with as many windows (a part of one shape): columns of one matrix
        width, count = int(lengths[0]), int(windows[0])
        matrix = values[start[0] : start[0] + len(windows) * width].reshape(len(windows), width)

        def column(index: int, present: bool) -> pa.Array:
            if present and 0 <= index < width:
                return pa.array(np.ascontiguousarray(matrix[:, index]), type=pa.float64())
            return pa.nulls(len(windows), pa.float64())

        derived = {f"w{i}": column(i, count > i) for i in range(NUM_WINDOW_COLUMNS)}
        return derived | {name: column(count + j, True) for j, name in enumerate(SPECIALS)}
    element_valid = pc.is_valid(vector.values).to_numpy(zero_copy_only=False) if vector.values.null_count else None

    def at(index: np.ndarray, present: np.ndarray) -> pa.Array:
        present = present & (index >= 0) & (index < lengths)
        if element_valid is not None:
            present &= element_valid[np.where(present, start + index, 0)]
        got = values[np.where(present, start + index, 0)] if len(values) else np.zeros(len(index))
        return pa.array(got, type=pa.float64(), mask=None if present.all() else ~present)

    derived = {f"w{i}": at(np.full(len(windows), i), windows > i) for i in range(NUM_WINDOW_COLUMNS)}
    return derived | {name: at(windows + j, np.ones(len(windows), dtype=bool)) for j, name in enumerate(SPECIALS)}


_END = object()


def _beside(items: Iterator[Any], depth: int, name: str) -> Generator[Any, None, None]:
    """``items``, made by a thread of its own at most ``depth`` ahead of the caller. An error there is raised
    here; closed early, it stops the thread (which closes ``items``) before it returns."""
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

    def run() -> None:
        try:
            with contextlib.closing(items):  # type: ignore[type-var]
                for item in items:
                    if not put(item):
                        return
            put(_END)
        except BaseException as error:  # handed to the caller, raised there
            put(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while (item := queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _warm() -> None:
    """numba's machinery and the COPY loop compiled beside the export's first queries (each once a process)."""
    binary.warm()
    libpq.warm()


def _received(
    raw: Any, statements: list[str], depth: int = AHEAD, size: int = CHUNK
) -> Generator[bytes | None, None, None]:
    """The data of each ``COPY ... TO STDOUT`` in turn, in chunks (:func:`libpq.copy_out`), then None at its end;
    read by a thread of its own (:func:`_beside`) at most ``depth`` chunks ahead. The server's query of the next
    part (its sort before the first row) and the socket reads then overlap the decoding and the Parquet writing
    here (both release the GIL), and memory stays at ``depth`` chunks. Nothing else uses the connection meanwhile:
    the statements are composed first. Closed early, the COPY being read is cancelled and its rest drained
    (psycopg's ``Copy`` ended by an exception), so the connection is free again."""

    def read() -> Iterator[bytes | None]:
        for statement in statements:
            yield from libpq.copy_out(raw, statement, size)
            yield None

    return _beside(read(), depth, "catalog-copy-out")


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


@collector_paused()
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
    # Threads beside the export load numba's machinery, check the heads on a connection of their own in the
    # export's snapshot while this one answers the small files, and hash each file while the next is written
    # (hashlib releases the GIL).
    with ThreadPoolExecutor(2, thread_name_prefix="catalog-beside") as beside:
        warmed = beside.submit(_warm)
        snapshot = connection.execute(text("SELECT pg_export_snapshot()")).scalar_one()
        checked = beside.submit(_heads_in_snapshot, connection.engine.url, snapshot, model_ids)
        heads: _Heads | None = None
        digests: dict[str, Future[str]] = {}
        for done, table in enumerate(tables):
            report(done, len(tables))
            path = directory / table.file
            if table.per_head and heads is None:
                heads = checked.result() or _Heads(connection, model_ids)
            rows = _write(connection, table, path, params, heads)
            digests[table.file] = beside.submit(sha256_file, path)
            files[table.file] = {
                "family": table.family, "description": table.description, "rows": rows, "sha256": "",
                "bytes": path.stat().st_size, "per_head": table.per_head,
                "columns": {c.name: str(c.type) for c in table.columns},
            }  # fmt: skip
            log.info("Exported %s: %d rows", table.file, rows)
            if table.name in RUNS:
                _refuse_twins(path, table)
        warmed.result()
        for name, digest in digests.items():
            files[name]["sha256"] = digest.result()
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
