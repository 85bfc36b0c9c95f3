"""``headcat catalog import``: check a whole archive, then write it in one transaction with its provenance.

:func:`validate` reads every file before anything is written: the manifest (format, version),
each file's checksum and row count, its schema (every column, with its type), and its values
(no nulls where the catalog has none, a head inside its model's shape, features that sum to 1,
every reference to a model, run, clustering or cluster resolvable in the archive). Any fault
refuses the archive with one line naming the file and the row (1-based, in file order).

:func:`write` stages each file in a temporary table (COPY), then inserts from it with the
archive's natural keys resolved to this catalog's ids, all in the caller's transaction. Runs
already in the catalog (same model, same key) are left as they are, so importing the same
archive twice changes nothing; the import itself is recorded once per archive and renames.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy import CursorResult, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ingest.types import STACKS
from service import current
from service.catalogs import binary
from service.catalogs.bulk import collector_paused
from service.catalogs.export import MANIFEST, sha256_file
from service.catalogs.tables import (
    CURRENT,
    DETECTORS,
    FORMAT_VERSION,
    NUM_WINDOW_COLUMNS,
    RUN_KEYS,
    RUNS,
    SPECIALS,
    TABLES,
    Table,
    run_key,
)
from service.errors import Conflict, InvalidInput, listed

log = logging.getLogger(__name__)

SUM_TOLERANCE = 1e-3  # features of a head sum to 1 up to float error (float16/bfloat16 runs included)
# A detector score is a float32 ratio of two sums of one map's cells (the pattern's and all of them), so a
# head whose mass is all on the pattern may score a float32 rounding above 1; no more than this.
SCORE_TOLERANCE = 1e-4
COPY_BATCH = 10_000  # rows read from a file at once (validation and staging)
HEAD_MODELS = 64  # models whose heads' ids are read at once
CHECKERS = 2  # threads checking a per-head file's row groups (Parquet's decoding, Arrow and numpy release the GIL)
Progress = Callable[[int, int], None]


#: The transaction-level advisory lock every import holds (``pg_advisory_xact_lock``): "headcat" in ASCII.
IMPORT_LOCK = int.from_bytes(b"headcat", "big")


class ArchiveError(InvalidInput):
    """A damaged, hostile or incompatible archive: refused before anything is written."""

    def __init__(self, where: str, message: str, row: int | None = None) -> None:
        at = f"{where} row {row + 1}" if row is not None else where
        super().__init__(f"catalog archive: {at}: {message}", field="archive")


@dataclass
class Archive:
    directory: Path
    manifest: dict[str, Any]
    sha256: str
    rows: int
    absent: set[str] = field(default_factory=set)  # files of a later format version than the archive's
    small: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the run files, read whole
    shapes: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  # model -> stack -> (layers, heads)
    # The part written (:func:`select`): each small file's rows' numbers in the file, and what was left out.
    numbers: dict[str, list[int]] = field(default_factory=dict)
    clusterings: set[str] | None = None  # the clusterings written (None: every one)
    left_out: dict[str, Any] = field(default_factory=dict)

    @property
    def models(self) -> list[str]:
        return [row["model"] for row in self.small["models"]]


# --- validation ----------------------------------------------------------------------------------


def _manifest(directory: Path) -> tuple[dict[str, Any], str]:
    path = directory / MANIFEST
    if not directory.exists():
        raise ArchiveError(str(directory), "does not exist")
    if not directory.is_dir():
        raise ArchiveError(str(directory), "not a directory")
    if not path.is_file():
        raise ArchiveError(MANIFEST, "missing from the archive")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArchiveError(MANIFEST, f"not JSON ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != "headcat-catalog":
        raise ArchiveError(MANIFEST, "not a headcat catalog manifest (format is not 'headcat-catalog')")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArchiveError(MANIFEST, f"format_version {version!r} is not an integer")
    if version > FORMAT_VERSION:
        raise ArchiveError(MANIFEST, f"format version {version} is newer than this headcat reads "
                                     f"({FORMAT_VERSION}); upgrade headcat to import it")  # fmt: skip
    if version < 1:
        raise ArchiveError(MANIFEST, f"format version {version} is not a known version")
    if not isinstance(manifest.get("files"), dict):
        raise ArchiveError(MANIFEST, "has no 'files' table")
    return manifest, sha256_file(path)


def check_manifest(directory: Path, models: list[str] | None = None) -> None:
    """The archive's manifest is there, of a format this headcat reads, and lists ``models`` (a quick check
    before queueing)."""
    manifest, _ = _manifest(directory)
    found = manifest.get("models")
    archived: dict[str, Any] = found if isinstance(found, dict) else {}
    unknown = [m for m in models or [] if m not in archived]
    if unknown:
        raise InvalidInput(f"model: the archive has no model {unknown[0]!r}; its models: {listed(archived)}",
                           field="models")  # fmt: skip


def _open(directory: Path, manifest: dict[str, Any], table: Table) -> pq.ParquetFile | None:
    """The file, checked against the manifest and the table's columns (its checksum: :func:`_refuse_damaged`);
    None for a file that came with a later format version than the archive's and that it does not list (read as
    empty)."""
    version = manifest["format_version"]
    entry = manifest["files"].get(table.file)
    path = directory / table.file
    if entry is None and table.since > version:
        return None
    if not isinstance(entry, dict):
        raise ArchiveError(MANIFEST, f"does not list {table.file}")
    if not path.is_file():
        raise ArchiveError(table.file, "missing from the archive")
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ArchiveError(table.file, f"not a readable Parquet file ({error})") from error
    schema = file.schema_arrow
    for column in table.columns:
        index = schema.get_field_index(column.name)
        if index < 0 and column.since > version:
            continue  # the archive's format predates the column: read as null
        if index < 0:
            raise ArchiveError(table.file, f"column {column.name!r} is missing")
        if not schema.field(index).type.equals(column.type):
            raise ArchiveError(table.file, f"column {column.name!r} is {schema.field(index).type}, expected "
                                           f"{column.type}")  # fmt: skip
    if file.metadata.num_rows != entry.get("rows"):
        raise ArchiveError(table.file, f"holds {file.metadata.num_rows} rows, the manifest says {entry.get('rows')}")
    return file


def _batches(file: pq.ParquetFile | None, table: Table, groups: Iterable[int] | None = None,
             start: int = 0) -> Iterator[tuple[int, pa.RecordBatch]]:  # fmt: skip
    """``(first row, batch)`` with only the expected columns, in their order; nulls refused where not allowed.
    ``groups``: only those row groups, the first of them starting at row ``start``.

    A column the file lacks (only one that came with a later format version than the archive's, see
    :func:`_open`) is all null; a file the archive lacks (``None``) has no rows."""
    if file is None:
        return
    names = [c.name for c in table.columns]
    schema = file.schema_arrow  # made from the file's Parquet schema at each access
    present = [n for n in names if schema.get_field_index(n) >= 0]
    try:
        for batch in _row_group_batches(file, present, groups):
            if len(present) < len(names):
                batch = pa.RecordBatch.from_arrays(
                    [batch.column(c.name) if c.name in present else pa.nulls(batch.num_rows, c.type)
                     for c in table.columns], names=names,
                )  # fmt: skip
            batch = batch.select(names)
            for column in table.columns:
                array = batch.column(column.name)
                if not column.nullable and array.null_count:
                    first = pc.index(pc.is_null(array), True).as_py()
                    raise ArchiveError(table.file, f"column {column.name!r} is null", start + first)
            yield start, batch
            start += batch.num_rows
    except pa.ArrowException as error:
        raise ArchiveError(table.file, f"cannot be read ({error})", start) from error


def _row_group_batches(file: pq.ParquetFile, columns: list[str],
                       groups: Iterable[int] | None = None) -> Iterator[pa.RecordBatch]:  # fmt: skip
    """The file's rows as batches of at most :data:`COPY_BATCH` rows, read one row group at a time by a reader of
    its own: one reader over the whole file (``iter_batches`` without ``row_groups``) keeps every row group it
    decoded allocated until it is done, so its memory grew with the file (about the decoded size of the file;
    docs/usage/catalogs.md#cost)."""
    for group in range(file.metadata.num_row_groups) if groups is None else groups:
        yield from file.iter_batches(batch_size=COPY_BATCH, columns=columns, row_groups=[group], use_threads=False)


def _json(table: Table, row: int, name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ArchiveError(table.file, f"column {name!r} is not JSON ({error.msg})", row) from error


def _stacks(row: int, value: Any, table: Table | None = None) -> dict[str, tuple[int, int]]:
    table = table or TABLE["models"]
    if not isinstance(value, dict) or not value:
        raise ArchiveError(table.file, "stacks is not an object of stack -> shape", row)
    shapes = {}
    for stack, shape in value.items():
        if stack not in STACKS:
            raise ArchiveError(table.file, f"unknown stack {stack!r} (stacks: {', '.join(STACKS)})", row)
        layers, heads = (shape.get(k) if isinstance(shape, dict) else None for k in ("layers", "heads"))
        if not (isinstance(layers, int) and isinstance(heads, int) and 0 < layers <= 10_000 and 0 < heads <= 10_000):
            raise ArchiveError(table.file, f"stack {stack!r} has no positive layers and heads", row)
        shapes[stack] = (layers, heads)
    return shapes


TABLE = {t.name: t for t in TABLES}
# file -> (column, run file it names, scope column or None; nullable references may be null)
REFERENCES: dict[str, tuple[tuple[str, str, str | None], ...]] = {
    "models": (("current_clustering", "clusterings", None),
               *((CURRENT[t], t, "model") for t in CURRENT if t != "stability_runs")),
    "clusterings": ((CURRENT["stability_runs"], "stability_runs", "clustering"),),
    "head_features": (("feature_run", "feature_runs", "model"),),
    "clusters": (("clustering", "clusterings", None),),
    "head_types": (("clustering", "clusterings", None), ("feature_run", "feature_runs", "model")),
    "stability_runs": (("clustering", "clusterings", None),),
    "stability_heads": (("stability_run", "stability_runs", "clustering"),),
    "ablation_runs": (("ablation_baseline", "ablation_baselines", "model"), ("clustering", "clusterings", None)),
    "ablation_outcomes": (("ablation_run", "ablation_runs", "model"),),
    "head_importance": (("importance_run", "importance_runs", "model"),),
    "pruning_curves": (("ablation_baseline", "ablation_baselines", "model"),
                       ("importance_run", "importance_runs", "model"), ("clustering", "clusterings", None)),
    "pruning_points": (("pruning_curve", "pruning_curves", "model"),),
    "head_attribution": (("attribution_run", "attribution_runs", "model"),),
    "syntax_baselines": (("syntax_run", "syntax_runs", "model"),),
    "head_syntax": (("syntax_run", "syntax_runs", "model"),),
    "head_detections": (("detection_run", "detection_runs", "model"),),
}  # fmt: skip
# per-head file -> (column, lowest, highest): a value outside is refused (null passes where the column is nullable)
RANGES: dict[str, tuple[tuple[str, float, float], ...]] = {
    "head_types": (("margin", -1.0, 1.0),),
    "stability_heads": (("agreement", 0.0, 1.0),),
    "head_detections": tuple((name, 0.0, 1.0) for name in DETECTORS),
}


def _check_small(archive: Archive, table: Table, keys: dict[str, set[tuple[str, str]]]) -> None:
    rows = archive.small[table.name]
    json_columns = [c.name for c in table.columns if c.type == pa.string() and c.sql.endswith("::text")]
    models = set(archive.shapes)
    seen: set[tuple[Any, ...]] = set()
    for i, row in enumerate(rows):
        for name in json_columns:
            if row[name] is not None:
                _json(table, i, name, row[name])
        if "model" in row and table.name != "models" and row["model"] not in models:
            raise ArchiveError(table.file, f"model {row['model']!r} is not in models.parquet", i)
        if table.name in RUNS:
            key, scope = RUNS[table.name]
            ident = (row[scope] if scope else "", row[key])
            if ident in seen:
                raise ArchiveError(table.file, f"{key} {row[key]!r} appears twice", i)
            seen.add(ident)
        if table.name == "clusterings":
            if len(row["models"]) != len(row["feature_runs"]) or not row["models"]:
                raise ArchiveError(table.file, "models and feature_runs are not lists of the same, non-zero length", i)
            for model, run in zip(row["models"], row["feature_runs"], strict=True):
                if (model, run) not in keys["feature_runs"]:
                    raise ArchiveError(table.file, f"feature run {run!r} of model {model!r} is not in "
                                                   "feature_runs.parquet", i)  # fmt: skip
        if table.name == "clusters":
            ident = (row["clustering"], row["type"])
            if ident in seen:
                raise ArchiveError(table.file, f"type {row['type']!r} appears twice in its clustering", i)
            seen.add(ident)
        _check_references(table, i, row, keys)


def _check_references(table: Table, i: int, row: dict[str, Any], keys: dict[str, set[tuple[str, str]]]) -> None:
    for column, target, scope in REFERENCES.get(table.name, ()):
        value = row[column]
        if value is None:
            continue
        ident = (row[scope] if scope else "", value)
        if ident not in keys[target]:
            raise ArchiveError(table.file, f"{column} {value!r} is not in {target}.parquet", i)


def _each_batch(archive: Archive, table: Table, file: pq.ParquetFile | None,
                check: Callable[[int, pa.RecordBatch], None]) -> None:  # fmt: skip
    """``check`` of every ``(first row, batch)`` of a file, its row groups read and checked by :data:`CHECKERS`
    threads, each with a reader of its own; the error raised is the first row's that fails (in the file's order),
    as a check in one thread would raise it. Text columns come as dictionaries (each row group's distinct names and
    each row's index into them, as Parquet stores them): :func:`_by_key` looks up names, not rows."""
    if file is None:
        return
    metadata = file.metadata
    sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    starts = np.cumsum([0, *sizes])

    text_columns = [f.name for f in file.schema_arrow if pa.types.is_string(f.type)]

    def group(g: int) -> None:
        path = archive.directory / table.file
        with pq.ParquetFile(path, metadata=metadata, read_dictionary=text_columns) as reader:
            for start, batch in _batches(reader, table, [g], int(starts[g])):
                check(start, batch)

    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(CHECKERS, thread_name_prefix="catalog-check") as pool:
        try:
            for g in range(len(sizes)):
                pending.append(pool.submit(group, g))
                while len(pending) > 2 * CHECKERS:  # a few row groups decoded at once: memory stays bounded
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _check_heads(archive: Archive, table: Table, file: pq.ParquetFile | None, keys: dict[str, set[tuple[str, str]]],
                 windows: dict[tuple[str, str], int], types: set[tuple[str, str]],
                 detections: dict[tuple[str, str], dict[str, Any]]) -> None:  # fmt: skip
    """Each batch checked with Arrow and numpy (:func:`_each_batch`); the first row that fails is checked again
    alone (:func:`_check_head_row`), which names what is wrong with it."""
    model_index = {("", name): i for i, name in enumerate(archive.shapes)}
    shapes = np.array([[archive.shapes[n].get(s, (0, 0)) for s in STACKS] for n in archive.shapes], dtype=np.int64)
    shapes = shapes.reshape(len(model_index), len(STACKS), 2)
    known = {target: dict.fromkeys(keys[target], 0) for _, target, _ in REFERENCES.get(table.name, ())}
    clusters = dict.fromkeys(types, 0)

    def check(start: int, batch: pa.RecordBatch) -> None:
        m, s = _by_key(batch, "model", None, model_index), _by_key(batch, "stack", None, STACK_PLACES)
        layer = batch.column("layer").to_numpy(zero_copy_only=False)
        head = batch.column("head").to_numpy(zero_copy_only=False)
        layers, heads = shapes[np.maximum(m, 0), np.maximum(s, 0)].T  # a name not found: checked by m, s >= 0
        ok = (m >= 0) & (s >= 0) & (layer >= 0) & (layer < layers) & (head >= 0) & (head < heads)
        for column, target, scope in REFERENCES.get(table.name, ()):
            null = pc.is_null(batch.column(column)).to_numpy(zero_copy_only=False)
            ok &= null | (_by_key(batch, column, scope, known[target]) >= 0)
        if table.name == "head_types":
            ok &= _by_key(batch, "type", "clustering", clusters) >= 0
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            _check_head_row(archive, table, start + i, batch.slice(i, 1).to_pylist()[0], keys, types)
            raise ArchiveError(table.file, "the row does not match the archive's models and runs", start + i)
        if table.name == "head_features":
            n = _by_key(batch, "feature_run", "model", windows)
            _check_vectors(table, start, batch.column("vector"), n + len(SPECIALS), "features")
            _check_named(table, start, batch, n)
        if table.name == "head_attribution":
            for name in ("global_vector", "local_vector"):
                _check_vectors(table, start, batch.column(name), None, name)
        tolerance = SCORE_TOLERANCE if table.name == "head_detections" else 0.0
        for name, low, high in RANGES.get(table.name, ()):
            _check_range(table, start, batch.column(name), name, low, high, tolerance)
        if table.name == "head_detections":
            _check_detections(table, start, batch, detections)

    _each_batch(archive, table, file, check)


STACK_PLACES: dict[tuple[str, str], int] = {("", stack): i for i, stack in enumerate(STACKS)}  # for _by_key


def _codes(array: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[Any]]:
    """Each row's index into the column's distinct values (-1: null), and those values."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not pa.types.is_dictionary(array.type):
        array = pc.dictionary_encode(array)
    return array.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), array.dictionary.to_pylist()


def _by_key(batch: pa.RecordBatch, key: str, scope: str | None, found: Mapping[tuple[str, str], int]) -> np.ndarray:
    """Each row's value in ``found`` of its ``(scope, key)`` (no scope: ``("", key)``); -1 where ``found`` has
    none or either is null. One Python lookup per distinct pair of the batch (a row group holds a few models and
    runs), whatever its number of rows."""
    keys, key_values = _codes(batch.column(key))
    scopes, scope_values = _codes(batch.column(scope)) if scope else (np.zeros(len(keys), np.int64), [""])
    width = len(key_values) + 1
    pairs, rows = np.unique((scopes + 1) * width + keys + 1, return_inverse=True)
    values = [
        found.get((scope_values[s - 1], key_values[k - 1]), -1) if s and k else -1
        for s, k in zip(*(part.tolist() for part in np.divmod(pairs, width)), strict=True)
    ]
    return np.array(values, dtype=np.int64)[rows.reshape(-1)]


def _check_head_row(archive: Archive, table: Table, i: int, row: dict[str, Any],
                    keys: dict[str, set[tuple[str, str]]], types: set[tuple[str, str]]) -> None:  # fmt: skip
    """One row of a per-head file: its head inside its model's shape, its references resolvable."""
    model, stack, layer, head = row["model"], row["stack"], row["layer"], row["head"]
    shape = archive.shapes.get(model)
    if shape is None:
        raise ArchiveError(table.file, f"model {model!r} is not in models.parquet", i)
    if stack not in shape:
        raise ArchiveError(table.file, f"model {model!r} has no {stack!r} stack", i)
    layers, heads = shape[stack]
    if not (0 <= layer < layers and 0 <= head < heads):
        raise ArchiveError(table.file, f"{stack} layer {layer} head {head} is outside model {model!r} "
                                       f"({layers} layers x {heads} heads)", i)  # fmt: skip
    _check_references(table, i, row, keys)
    if table.name == "head_types" and (row["clustering"], row["type"]) not in types:
        raise ArchiveError(table.file, f"type {row['type']!r} is not a cluster of its clustering "
                                       "in clusters.parquet", i)  # fmt: skip


def _check_range(table: Table, start: int, array: pa.Array, name: str, low: float, high: float,
                 tolerance: float) -> None:  # fmt: skip
    """Every value of a float column finite and in ``[low, high]`` (up to ``tolerance``); null passes (nulls
    were refused before where the column has none)."""
    values = array.to_numpy(zero_copy_only=False).astype(np.float64)  # null -> NaN
    valid = ~pc.is_null(array).to_numpy(zero_copy_only=False)
    inside = (values >= low - tolerance) & (values <= high + tolerance)  # NaN and inf are not
    bad = np.flatnonzero(valid & ~inside)
    if bad.size:
        i = int(bad[0])
        raise ArchiveError(table.file, f"{name} {float(values[i])!r} is outside [{low:g}, {high:g}]", start + i)


def _check_detections(table: Table, start: int, batch: pa.RecordBatch,
                      detections: dict[tuple[str, str], dict[str, Any]]) -> None:  # fmt: skip
    """A head's roles are the detectors whose score reaches its run's threshold; its map is its run's size
    squared, of finite values in [0, 1]. Collects each run's heads per role (``roles``) for
    :func:`_check_causal_checks`."""
    models, runs = batch.column("model").to_pylist(), batch.column("detection_run").to_pylist()
    scores = {name: batch.column(name).to_pylist() for name in DETECTORS}
    roles = batch.column("roles").to_pylist()
    columns = {name: batch.column(name).to_pylist() for name in ("stack", "layer", "head")}
    maps = batch.column("example_map")
    sizes = pc.list_value_length(maps).to_numpy(zero_copy_only=False)
    for i, (model, run) in enumerate(zip(models, runs, strict=True)):
        meta = detections[(model, run)]
        thresholds = meta["thresholds"]
        expected = [name for name in DETECTORS if scores[name][i] is not None and scores[name][i] >= thresholds[name]]
        if roles[i] != expected:
            raise ArchiveError(table.file, f"roles {roles[i]} are not those its scores reach at its run's thresholds "
                                           f"({expected})", start + i)  # fmt: skip
        head = (columns["stack"][i], columns["layer"][i], columns["head"][i])
        for role in expected:
            meta["roles"].setdefault(role, set()).add(head)
        if sizes[i] != meta["example_size"] ** 2:
            raise ArchiveError(table.file, f"example_map has {sizes[i]} values, its run's maps are "
                                           f"{meta['example_size']} x {meta['example_size']}", start + i)  # fmt: skip
    values = pc.list_flatten(maps).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = np.flatnonzero(~((values >= 0.0) & (values <= 1.0 + SCORE_TOLERANCE)))
    if bad.size:
        row = int(np.searchsorted(np.cumsum(sizes), int(bad[0]), side="right"))
        value = float(values[bad[0]])
        raise ArchiveError(table.file, f"example_map holds {value!r}, not an attention weight in [0, 1]", start + row)


SHA256 = re.compile(r"^[0-9a-f]{64}$")
SERIES_FIELDS = ("architecture", "stacks")  # what a step shares with its series, as models.parquet says it


def _check_series(archive: Archive) -> None:
    """Each series once, with an architecture, stacks and a tokenizer fingerprint; each model either a step of
    one of them (series and step both set, the step once in its series) or of none; and every step sharing its
    series' architecture and stacks (SPEC 11), as an ingest checks them."""
    table = TABLE["series"]
    series: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(archive.small["series"]):
        if not 1 <= len(row["series"]) <= 200:
            raise ArchiveError(table.file, f"series {row['series']!r} is not a name (1 to 200 characters)", i)
        if row["series"] in series:
            raise ArchiveError(table.file, f"series {row['series']!r} appears twice", i)
        if not row["architecture"]:
            raise ArchiveError(table.file, "architecture is empty", i)
        if not SHA256.match(row["tokenizer_sha256"]):
            raise ArchiveError(table.file, f"tokenizer_sha256 {row['tokenizer_sha256']!r} is not a SHA-256", i)
        stacks = _json(table, i, "stacks", row["stacks"])
        _stacks(i, stacks, table)
        series[row["series"]] = {"architecture": row["architecture"], "stacks": stacks}
    steps: dict[tuple[str, int], str] = {}
    models = TABLE["models"]
    for i, row in enumerate(archive.small["models"]):
        name, step = row["series"], row["step"]
        if (name is None) != (step is None):
            raise ArchiveError(models.file, f"model {row['model']!r}: series and step are both set or both "
                                            f"null, not series {name!r} and step {step!r}", i)  # fmt: skip
        if name is None:
            continue
        if name not in series:
            raise ArchiveError(models.file, f"series {name!r} of model {row['model']!r} is not in series.parquet", i)
        if not 0 <= step <= 2**31 - 1:
            raise ArchiveError(models.file, f"step {step} of model {row['model']!r} is not 0..2147483647", i)
        if (name, step) in steps:
            raise ArchiveError(models.file, f"step {step} of series {name!r} is both {steps[name, step]!r} and "
                                            f"{row['model']!r}", i)  # fmt: skip
        steps[name, step] = row["model"]
        mine = {"architecture": row["architecture"], "stacks": _json(models, i, "stacks", row["stacks"])}
        for field_name in SERIES_FIELDS:
            if mine[field_name] != series[name][field_name]:
                raise ArchiveError(models.file, f"{field_name} of model {row['model']!r} (step {step}) is "
                                                f"{_shown(mine[field_name])}, not its series {name!r}'s "
                                                f"{_shown(series[name][field_name])}: every step of a series "
                                                "shares it", i)  # fmt: skip


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else repr(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_detection_runs(archive: Archive) -> dict[tuple[str, str], dict[str, Any]]:
    """Each detection run's config (seed, thresholds in [0, 1] for every detector), its sequences' ids (as
    many as the run says, each as long), the repeat gain (``loss_first - loss_later``) and the causal
    check's heads (inside the model's shape); returns ``{(model, run): {thresholds, example_size}}``."""
    table = TABLE["detection_runs"]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for i, row in enumerate(archive.small["detection_runs"]):
        config = json.loads(row["config"])
        thresholds = config.get("thresholds") if isinstance(config, dict) else None
        if not isinstance(thresholds, dict) or any(
            not _number(thresholds.get(name)) or not 0.0 <= thresholds[name] <= 1.0 for name in DETECTORS
        ):
            raise ArchiveError(table.file, f"config.thresholds is not a threshold in [0, 1] for each of "
                                           f"{', '.join(DETECTORS)}", i)  # fmt: skip
        seed = config.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ArchiveError(table.file, f"config.seed {seed!r} is not an integer >= 0", i)
        sequences = json.loads(row["sequences"])
        ids = sequences.get("sequences") if isinstance(sequences, dict) else None
        if (
            not isinstance(ids, list)
            or len(ids) != row["num_sequences"]
            or any(
                not isinstance(s, list)
                or len(s) != row["num_tokens"]
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in s)
                for s in ids
            )
        ):
            raise ArchiveError(table.file, f"sequences.sequences is not {row['num_sequences']} lists of "
                                           f"{row['num_tokens']} token ids", i)  # fmt: skip
        first, later, gain = row["loss_first"], row["loss_later"], row["repeat_gain"]
        if (gain is None) != (first is None or later is None) or (
            gain is not None and not math.isclose(gain, first - later, rel_tol=1e-9, abs_tol=1e-12)
        ):
            raise ArchiveError(table.file, f"repeat_gain {gain!r} is not loss_first - loss_later", i)
        if row["example_size"] < 1:
            raise ArchiveError(table.file, f"example_size {row['example_size']} is not >= 1", i)
        checks = json.loads(row["checks"])
        if not isinstance(checks, list):
            raise ArchiveError(table.file, "checks is not a list", i)
        shape = archive.shapes[row["model"]]
        for check in checks:
            if not isinstance(check, dict) or check.get("role") not in DETECTORS:
                raise ArchiveError(table.file, f"checks: {str(check)[:80]} does not name a role", i)
            for head in check.get("heads") or []:
                stack, layer, index = (head + [None, None, None])[:3] if isinstance(head, list) else (None,) * 3
                layers, heads = shape.get(stack, (0, 0)) if isinstance(stack, str) else (0, 0)
                if not (isinstance(layer, int) and isinstance(index, int) and 0 <= layer < layers
                        and 0 <= index < heads):  # fmt: skip
                    raise ArchiveError(table.file, f"checks: the {check['role']} head {head} is not a head of model "
                                                   f"{row['model']!r}", i)  # fmt: skip
        out[(row["model"], row["detection_run"])] = {"thresholds": thresholds, "example_size": row["example_size"],
                                                     "row": i, "checks": checks, "roles": {}}  # fmt: skip
    return out


def _check_causal_checks(detections: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Each causal check prunes exactly the heads that ``head_detections.parquet`` gives its role in its run."""
    table = TABLE["detection_runs"]
    for meta in detections.values():
        for check in meta["checks"]:
            stated = {tuple(head) for head in check.get("heads") or []}
            if stated != meta["roles"].get(check["role"], set()):
                message = f"checks: the {check['role']} heads are not those head_detections.parquet gives the role"
                raise ArchiveError(table.file, message, meta["row"])


def _check_vectors(table: Table, start: int, array: pa.Array, lengths: np.ndarray | None, what: str) -> None:
    """Each list sums to 1 (SPEC 1: a head's N + 5 features are a distribution) and has its run's length."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    sizes = pc.list_value_length(array).to_numpy(zero_copy_only=False)
    if lengths is not None:
        wrong = np.flatnonzero(sizes != np.asarray(lengths))
        if wrong.size:
            i = int(wrong[0])
            raise ArchiveError(table.file, f"{what} has {sizes[i]} values, its run has {lengths[i]}", start + i)
    if (empty := np.flatnonzero(sizes == 0)).size:
        raise ArchiveError(table.file, f"{what} is empty", start + int(empty[0]))
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    if values.size and not np.all(np.isfinite(values)):
        bad = int(np.searchsorted(np.cumsum(sizes), int(np.flatnonzero(~np.isfinite(values))[0]), side="right"))
        raise ArchiveError(table.file, f"{what} holds a value that is not finite", start + bad)
    offsets = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    sums = np.add.reduceat(values, offsets) if values.size else np.zeros(len(sizes))
    sums = np.where(sizes > 0, sums, 0.0)
    lowest = np.minimum.reduceat(values, offsets) if values.size else np.zeros(len(sizes))
    lowest = np.where(sizes > 0, lowest, 0.0)
    wrong = np.flatnonzero((np.abs(sums - 1.0) > SUM_TOLERANCE) | (lowest < -SUM_TOLERANCE))
    if wrong.size:
        i = int(wrong[0])
        if lowest[i] < -SUM_TOLERANCE:
            raise ArchiveError(table.file, f"{what} hold a negative value ({lowest[i]:.6g})", start + i)
        raise ArchiveError(table.file, f"{what} sum to {sums[i]:.6g}, not 1", start + i)


def _check_named(table: Table, start: int, batch: pa.RecordBatch, windows: np.ndarray) -> None:
    """The named columns (w0..w15, self, cls, sep, period, comma) are the vector's values (the vectors' lengths,
    ``windows + 5``, were checked before)."""
    vectors = batch.column("vector")
    sizes = pc.list_value_length(vectors).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.cumsum(sizes) - sizes
    values = vectors.flatten().to_numpy(zero_copy_only=False)
    for w in range(NUM_WINDOW_COLUMNS):
        named = batch.column(f"w{w}")
        present = pc.is_valid(named).to_numpy(zero_copy_only=False)
        inside = w < windows
        got = named.fill_null(0.0).to_numpy(zero_copy_only=False)
        want = values[np.where(inside, offsets + w, 0)] if values.size else np.zeros(len(sizes))
        bad = (present != inside) | (inside & (got != want))
        if bad.any():
            raise ArchiveError(
                table.file, f"column 'w{w}' does not match the vector", start + int(np.flatnonzero(bad)[0])
            )
    for j, name in enumerate(SPECIALS):
        got = batch.column(name).to_numpy(zero_copy_only=False)
        bad = got != values[offsets + windows + j]
        if bad.any():
            raise ArchiveError(
                table.file, f"column {name!r} does not match the vector", start + int(np.flatnonzero(bad)[0])
            )


def _hashes(directory: Path, manifest: dict[str, Any], pool: ThreadPoolExecutor) -> dict[str, Future[str]]:
    """Each file the manifest lists and the archive holds, its SHA-256 taken on ``pool``."""
    listed_files = [t.file for t in TABLES if isinstance(manifest["files"].get(t.file), dict)]
    return {f: pool.submit(sha256_file, directory / f) for f in listed_files if (directory / f).is_file()}


def _refuse_damaged(manifest: dict[str, Any], hashes: dict[str, Future[str]]) -> None:
    """The first file (in the archive's order) whose SHA-256 is not the manifest's: refused as damaged."""
    for name, digest in hashes.items():
        expected = manifest["files"][name].get("sha256")
        if digest.result() != expected:
            raise ArchiveError(name, f"checksum mismatch: sha256 {digest.result()}, the manifest says {expected}; "
                                     "the file is damaged or was changed")  # fmt: skip


@collector_paused()
def validate(directory: Path, renames: dict[str, str] | None = None) -> Archive:
    """Read and check the whole archive in ``directory``; raises :class:`ArchiveError` on any fault.

    The files' checksums are taken by a thread of their own while the files are read and checked (hashlib releases
    the GIL: a quarter of a second at 10^6 heads, beside the checks instead of before them). A file whose checksum
    is not the manifest's is refused as damaged, before any other fault found in any file: a damaged file is named
    as damaged, whatever its damage made a check find."""
    manifest, digest = _manifest(directory)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="catalog-hash")
    try:
        hashes = _hashes(directory, manifest, hashing)
        try:
            archive = _checked(directory, manifest, digest, renames)
        except Exception:
            _refuse_damaged(manifest, hashes)
            raise
        _refuse_damaged(manifest, hashes)
    finally:
        hashing.shutdown(cancel_futures=True)  # on an interrupt: no file hashed after it
    return archive


def _checked(directory: Path, manifest: dict[str, Any], digest: str, renames: dict[str, str] | None) -> Archive:
    files = {table.name: _open(directory, manifest, table) for table in TABLES}
    archive = Archive(directory, manifest, digest, rows=sum(f.metadata.num_rows for f in files.values() if f),
                      absent={name for name, f in files.items() if f is None})  # fmt: skip
    for table in TABLES:
        if not table.per_head:
            rows: list[dict[str, Any]] = []
            for _, batch in _batches(files[table.name], table):
                rows.extend(batch.to_pylist())
            archive.small[table.name] = rows
    for i, row in enumerate(archive.small["models"]):
        if row["model"] in archive.shapes:
            raise ArchiveError("models.parquet", f"model {row['model']!r} appears twice", i)
        archive.shapes[row["model"]] = _stacks(i, _json(TABLE["models"], i, "stacks", row["stacks"]))
    for old, new in (renames or {}).items():
        if old not in archive.shapes:
            raise InvalidInput(f"rename: the archive has no model {old!r}; its models: {listed(archive.shapes)}",
                               field="rename")  # fmt: skip
        if not new or len(new) > 200:
            raise InvalidInput(f"rename: {new!r} is not a model name (1 to 200 characters)", field="rename")
    keys = {
        name: {(row[scope] if scope else "", row[key]) for row in archive.small[name]}
        for name, (key, scope) in RUNS.items()
    }
    for table in TABLES:
        if not table.per_head:
            _check_small(archive, table, keys)
    _check_series(archive)
    windows = {(r["model"], r["feature_run"]): int(r["num_windows"]) for r in archive.small["feature_runs"]}
    for (model, run), n in windows.items():
        if not 1 <= n <= 1024:
            raise ArchiveError("feature_runs.parquet", f"num_windows {n} of run {run!r} of {model!r} is not 1..1024")
    types = {(r["clustering"], r["type"]) for r in archive.small["clusters"]}
    detections = _check_detection_runs(archive)
    for table in TABLES:
        if table.per_head:
            _check_heads(archive, table, files[table.name], keys, windows, types, detections)
    _check_causal_checks(detections)
    return archive


# Files whose rows name a clustering: dropped with it (``drop``), or their reference to it nulled (``null``).
_CLUSTERING_ROWS = {"clusterings": "drop", "clusters": "drop", "stability_runs": "drop", "ablation_runs": "null",
                    "pruning_curves": "null"}  # fmt: skip


def select(archive: Archive, models: list[str] | None) -> None:
    """Narrow a validated archive to ``models`` (every model: None or empty): their runs, and the clusterings all
    of whose models come along; a run of a kept model that used a clustering left out keeps ``clustering: null``,
    as an export of those models would say. ``archive.left_out`` says what was left out."""
    if not models:
        return
    unknown = [m for m in models if m not in archive.shapes]
    if unknown:
        raise InvalidInput(f"model: the archive has no model {unknown[0]!r}; its models: "
                           f"{listed(archive.shapes)}", field="model")  # fmt: skip
    keep = set(models)
    every = [row["clustering"] for row in archive.small["clusterings"]]
    archive.clusterings = {r["clustering"] for r in archive.small["clusterings"] if set(r["models"]) <= keep}
    series = {r["series"] for r in archive.small["models"] if r["model"] in keep}  # the kept models' series
    rows: dict[str, int] = {}
    for table in TABLES:
        if table.per_head:
            continue
        kept, numbers = [], []
        for i, row in enumerate(archive.small[table.name]):
            if "model" in row and row["model"] not in keep:
                continue
            if table.name == "series" and row["series"] not in series:
                continue
            how = _CLUSTERING_ROWS.get(table.name)
            column = "current_clustering" if table.name == "models" else "clustering"
            if column in row and row[column] is not None and row[column] not in archive.clusterings:
                if how == "drop":
                    continue
                row = {**row, column: None}
            kept.append(row)
            numbers.append(archive.numbers.get(table.name, range(len(archive.small[table.name])))[i])
        if len(kept) < len(archive.small[table.name]):
            rows[table.file] = len(archive.small[table.name]) - len(kept)
        archive.small[table.name], archive.numbers[table.name] = kept, numbers
    archive.left_out = {"models": sorted(set(archive.shapes) - keep),
                        "clusterings": [c for c in every if c not in archive.clusterings], "rows": rows}  # fmt: skip


# --- writing -------------------------------------------------------------------------------------

_PG_TYPES = {
    "string": "text", "int64": "bigint", "double": "double precision", "bool": "boolean",
    "timestamp[us, tz=UTC]": "timestamptz", "list<item: double>": "double precision[]",
    "list<item: float>": "real[]",
    "list<item: string>": "text[]", "list<item: int64>": "bigint[]", "list<item: list<item: float>>": "real[]",
}  # fmt: skip


def _stage(session: Session, archive: Archive, table: Table) -> str:
    """COPY a run file's rows (the part written, read whole by :func:`validate`) into a temporary table
    ``stg_NAME`` (dropped at commit), each with its row number in the file; returns its name. The rows go as Arrow
    columns in PostgreSQL's binary format (:func:`binary.encode`), not a Python step per row and value: 15,628
    clusters with their centroids staged in 0.26 s instead of 0.31 s (of which encoding 0.09 s)."""
    name = f"stg_{table.name}"
    columns = ", ".join(f'"{c.name}" {_PG_TYPES[str(c.type)]}' for c in table.columns)
    session.execute(text(f"CREATE TEMP TABLE {name} (row bigint, {columns}) ON COMMIT DROP"))
    raw = session.connection().connection.driver_connection
    assert raw is not None
    quoted = ", ".join(f'"{c.name}"' for c in table.columns)
    rows = archive.small[table.name]
    numbers = archive.numbers.get(table.name, range(len(rows)))
    with raw.cursor() as cursor:
        types = binary.column_types(cursor, name)
        arrays = [(pa.array(list(numbers), pa.int64()), types["row"])]
        arrays += [(pa.array([row[c.name] for row in rows], c.type), types[c.name]) for c in table.columns]
        with cursor.copy(f"COPY {name} (row, {quoted}) FROM STDIN (FORMAT binary)") as copy:
            copy.write(binary.HEADER)
            if rows:
                copy.write(binary.encode(arrays))
            copy.write(binary.TRAILER)
    session.execute(text(f"ANALYZE {name}"))
    return name


def _known_keys(session: Session, target: str, kind: str) -> None:
    """Every run of ``target`` in the catalog that the import can reach, with its key, into ``_keys``."""
    key = run_key("r", *RUN_KEYS[target])
    if target == "clusterings":
        scoped = f"SELECT '', {key}, r.id FROM clusterings r"
    elif target == "stability_runs":
        scoped = (f"SELECT ck.key, {key}, r.id FROM stability_runs r "
                  "JOIN _keys ck ON ck.kind = 'clustering' AND ck.id = r.clustering_id")  # fmt: skip
    else:
        scoped = f"SELECT m.name, {key}, r.id FROM {target} r JOIN _models m ON m.id = r.model_id"
    added = session.execute(text(f"INSERT INTO _keys (kind, model, key, id) SELECT '{kind}', * FROM ({scoped}) k "
                                 "ON CONFLICT DO NOTHING"))  # fmt: skip
    if _count(added):  # the joins of millions of staged rows need its size (unchanged: as analysed before)
        session.execute(text("ANALYZE _keys"))


def _insert_runs(session: Session, target: str, stage: str, values: dict[str, str], joins: str = "") -> int:
    """Insert the staged runs the catalog lacks (by key), then map every staged key to its id."""
    key_column, scope = RUNS[target]
    kind = key_column
    _known_keys(session, target, kind)
    scope_sql = f"s.{scope}" if scope else "''"
    model_join = "JOIN _models m ON m.name = s.model" if scope == "model" else ""
    session.execute(
        text(f"""INSERT INTO _fresh (kind, model, key) SELECT '{kind}', {scope_sql}, s.{key_column} FROM {stage} s
                 WHERE NOT EXISTS (SELECT 1 FROM _keys k WHERE k.kind = '{kind}' AND k.model = {scope_sql}
                                   AND k.key = s.{key_column})""")
    )
    inserted = _count(
        session.execute(
            text(f"""INSERT INTO {target} ({", ".join(f'"{k}"' for k in values)})
                 SELECT {", ".join(values.values())} FROM {stage} s {model_join} {joins}
                 WHERE NOT EXISTS (SELECT 1 FROM _keys k WHERE k.kind = '{kind}' AND k.model = {scope_sql}
                                   AND k.key = s.{key_column})
                 ORDER BY s.row""")
        )
    )
    _known_keys(session, target, kind)
    missing = session.execute(
        text(f"""SELECT s.row FROM {stage} s WHERE NOT EXISTS (SELECT 1 FROM _keys k WHERE k.kind = '{kind}'
                 AND k.model = {scope_sql} AND k.key = s.{key_column}) ORDER BY s.row LIMIT 1""")
    ).scalar()
    if missing is not None:
        raise ArchiveError(f"{target}.parquet", f"the {key_column} key does not match the run's columns "
                                                "(the row was changed after export)", int(missing))  # fmt: skip
    return inserted


def _refuse_clusterings_over_other_models(session: Session, stage: str) -> None:
    """A clustering already in the catalog (same key) must cover the same models as the archive's: a renamed copy
    of a model is another model, and its heads joining a clustering fitted without them would change the
    clustering's sizes, shares and stability under its feet. Checked before the archive's clusterings get their
    feature runs, so only the catalog's own clusterings have any yet."""
    row = session.execute(
        text(f"""SELECT s.row FROM {stage} s
                 JOIN _keys c ON c.kind = 'clustering' AND c.model = '' AND c.key = s.clustering
                 WHERE EXISTS (SELECT 1 FROM clustering_feature_runs x WHERE x.clustering_id = c.id)
                   AND (SELECT array_agg(DISTINCT m.id ORDER BY m.id) FROM unnest(s.models) u(model)
                        JOIN _models m ON m.name = u.model)
                       IS DISTINCT FROM
                       (SELECT array_agg(DISTINCT f.model_id ORDER BY f.model_id) FROM clustering_feature_runs x
                        JOIN feature_runs f ON f.id = x.feature_run_id WHERE x.clustering_id = c.id)
                 ORDER BY s.row LIMIT 1""")
    ).scalar()
    if row is not None:
        raise ArchiveError("clusterings.parquet", "this clustering is already in the catalog over other models "
                           "(a renamed copy of a model cannot join a clustering fitted without it); import the "
                           "archive into another catalog", int(row))  # fmt: skip


def _count(result: Any) -> int:
    """Rows an INSERT wrote."""
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


def _insert_rows(session: Session, target: str, stage: str, values: dict[str, str], joins: str) -> int:
    return _count(
        session.execute(
            text(f"""INSERT INTO {target} ({", ".join(f'"{k}"' for k in values)})
                 SELECT {", ".join(values.values())} FROM {stage} s JOIN _models m ON m.name = s.model {joins}
                 ON CONFLICT DO NOTHING""")
        )
    )


def _ref(kind: str, alias: str, key: str, scope: str = "s.model", left: bool = False) -> str:
    join = "LEFT JOIN" if left else "JOIN"
    return f"{join} _keys {alias} ON {alias}.kind = '{kind}' AND {alias}.model = {scope} AND {alias}.key = s.{key}"


HEAD_ON = "JOIN heads h ON h.model_id = m.id AND h.stack = s.stack AND h.layer = s.layer AND h.head = s.head"
PROVENANCE = {c: f"s.{c}" for c in ("device", "dtype", "seconds", "started_at", "finished_at", "created_at")}
DATA = {c: f's."{c}"' for c in ("data_kind", "data_source", "data_sha256", "data_subset", "data_size", "limit")}
CORPUS = ("JOIN corpora co ON co.kind = s.corpus_kind AND co.source = s.corpus_source "
          "AND co.sha256 IS NOT DISTINCT FROM s.corpus_sha256")  # fmt: skip


def _same(*columns: str) -> dict[str, str]:
    return {c: f's."{c}"' for c in columns}


def _models(session: Session, archive: Archive, renames: dict[str, str], import_id: int) -> list[str]:
    """Each archive model's row in ``_models``: a new model (with every head), or the same one already here."""
    session.execute(text("CREATE TEMP TABLE _models (name text PRIMARY KEY, id int, new bool, first_head bigint) "
                         "ON COMMIT DROP"))  # fmt: skip
    session.execute(text("CREATE TEMP TABLE _keys (kind text, model text, key text, id bigint, "
                         "PRIMARY KEY (kind, model, key)) ON COMMIT DROP"))  # fmt: skip
    # The runs this import writes (not in the catalog before): only their per-head rows are written.
    session.execute(text("CREATE TEMP TABLE _fresh (kind text, model text, key text) ON COMMIT DROP"))
    stage = _stage(session, archive, TABLE["models"])
    session.execute(text(f"ALTER TABLE {stage} ADD COLUMN name text"))
    session.execute(
        text(f"UPDATE {stage} SET name = coalesce(CAST(:renames AS jsonb) ->> model, model)"),
        {"renames": json.dumps(renames)},
    )
    other = session.execute(
        text(f"""SELECT s.row, s.name, s.model, s.source, s.revision, m.source AS here, m.revision AS here_revision
                 FROM {stage} s JOIN models m ON m.name = s.name
                 WHERE (m.source, m.revision) IS DISTINCT FROM (s.source, s.revision) ORDER BY s.row LIMIT 1""")
    ).first()
    if other is not None:
        raise Conflict(
            f"catalog archive: models.parquet row {other.row + 1}: a model named {other.name!r} is already in the "
            f"catalog from {other.here}@{other.here_revision or 'local'}, the archive's is from {other.source}@"
            f"{other.revision or 'local'}; import it under another name: --rename {other.model}=NEW",
            field="rename",
        )
    session.execute(
        text(
            f"INSERT INTO _models (name, id, new) SELECT s.model, m.id, false FROM {stage} s "
            "JOIN models m ON m.name = s.name"
        )
    )
    _series(session, archive, stage)
    session.execute(
        text(f"""WITH new AS (
                     INSERT INTO models (name, source, revision, architecture, task, num_layers, num_heads,
                                         num_key_value_heads, stacks, created_at, import_id, series_id, step,
                                         requested_revision)
                     SELECT s.name, s.source, s.revision, s.architecture, s.task, s.num_layers, s.num_heads,
                            s.num_key_value_heads, CAST(s.stacks AS jsonb), s.created_at, :import_id, se.id, s.step,
                            s.requested_revision
                     FROM {stage} s LEFT JOIN series se ON se.name = s.series
                     WHERE NOT EXISTS (SELECT 1 FROM models m WHERE m.name = s.name) ORDER BY s.row
                     RETURNING id, name)
                 INSERT INTO _models (name, id, new) SELECT s.model, new.id, true FROM new
                 JOIN {stage} s ON s.name = new.name"""),
        {"import_id": import_id},
    )
    _new_heads(session, stage)
    session.execute(text("ANALYZE _models"))
    return [renames.get(row["model"], row["model"]) for row in archive.small["models"]]


HEAD_ROWS = 100_000  # heads rows encoded and sent at once by :func:`_new_heads`


def _head_rows(model_id: int, stacks: dict[str, dict[str, int]]) -> Iterator[tuple[np.ndarray, ...]]:
    """``(model id, stack, layer, head)`` of every head of one model, stack by stack in :data:`STACKS` order, then
    layer by layer: the order its ids are given in."""
    for stack in STACKS:
        if stack not in stacks:
            continue
        layers, heads = int(stacks[stack]["layers"]), int(stacks[stack]["heads"])
        n = layers * heads
        yield (
            np.full(n, model_id, dtype=np.int64),
            np.full(n, STACKS.index(stack), dtype=np.int64),
            np.repeat(np.arange(layers, dtype=np.int64), heads),
            np.tile(np.arange(heads, dtype=np.int64), layers),
        )


def _new_heads(session: Session, stage: str) -> None:
    """Every head of each model this import creates, by one binary COPY into ``heads`` (about :data:`HEAD_ROWS`
    rows encoded at a time), in the archive's model order, then stack, layer, head: the ids come from the
    table's sequence in that order. The model ids are this transaction's own, so the foreign key holds by
    construction (:func:`_without_triggers`).

    Where no other session took a value of the sequence meanwhile (the COPY's ``n`` values follow the one taken
    just before it, none between), each model's heads hold consecutive ids from a first one, noted in
    ``_models.first_head``: :class:`_HeadRows` then need not read them back."""
    models = session.execute(
        text(f"""SELECT m.id, CAST(s.stacks AS jsonb) FROM _models m JOIN {stage} s ON s.model = m.name
                 WHERE m.new ORDER BY s.row""")
    ).all()
    if not models:
        return
    raw = session.connection().connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor:
        types = binary.column_types(cursor, "heads")
    columns = ("model_id", "stack", "layer", "head")
    names = pa.array(STACKS, pa.string())
    sequence = "pg_get_serial_sequence('heads', 'id')"
    before = session.execute(text(f"SELECT nextval({sequence})")).scalar_one()
    sizes = []
    rows = sum(int(s["layers"]) * int(s["heads"]) for _, stacks in models for s in stacks.values())
    with _indexes_after(session, "heads", rows), _without_triggers(session), raw.cursor() as cursor:
        with cursor.copy("COPY heads (model_id, stack, layer, head) FROM STDIN (FORMAT binary)") as copy:
            copy.write(binary.HEADER)
            held: list[tuple[np.ndarray, ...]] = []
            count = 0
            for i, (model_id, stacks) in enumerate(models):
                sizes.append(0)
                for part in _head_rows(int(model_id), stacks):
                    held.append(part)
                    count += len(part[0])
                    sizes[-1] += len(part[0])
                if count >= HEAD_ROWS or (i == len(models) - 1 and held):
                    model, stack, layer, head = (np.concatenate(c) for c in zip(*held, strict=True))
                    arrays = [pa.array(model), names.take(pa.array(stack)), pa.array(layer), pa.array(head)]
                    copy.write(binary.encode([(a, types[c]) for a, c in zip(arrays, columns, strict=True)]))
                    held, count = [], 0
            copy.write(binary.TRAILER)
    last = session.execute(text(f"SELECT currval({sequence})")).scalar_one()
    if last - before == sum(sizes):  # the values before + 1 .. last are this COPY's, in its rows' order
        firsts = before + 1 + np.cumsum(sizes) - np.array(sizes)
        session.execute(
            text("""UPDATE _models m SET first_head = f.first
                    FROM unnest(CAST(:ids AS int[]), CAST(:firsts AS bigint[])) f(id, first) WHERE m.id = f.id"""),
            {"ids": [int(m) for m, _ in models], "firsts": [int(f) for f in firsts]},
        )


def _series(session: Session, archive: Archive, models: str) -> None:
    """The archive's series: one already here (by name) must share its architecture, stacks and tokenizer; a
    new one is written. A model already here that is another step of the series (or the same step of another
    one) is refused, as is a step the catalog holds under another model; one here without a series becomes the
    archive's step. ``models`` is the staged models file, with each model's name here."""
    stage = _stage(session, archive, TABLE["series"])
    for row in session.execute(
        text(f"""SELECT s.row, s.series, s.architecture, CAST(s.stacks AS jsonb) AS stacks, s.tokenizer_sha256,
                        x.architecture AS here_architecture, x.stacks AS here_stacks,
                        x.tokenizer_sha256 AS here_tokenizer_sha256
                 FROM {stage} s JOIN series x ON x.name = s.series ORDER BY s.row""")
    ):
        for field_name in ("architecture", "stacks", "tokenizer_sha256"):
            theirs, ours = getattr(row, field_name), getattr(row, f"here_{field_name}")
            if theirs != ours:
                raise Conflict(
                    f"catalog archive: series.parquet row {row.row + 1}: series {row.series!r} is already in the "
                    f"catalog with {field_name} {_shown(ours)}, the archive's has {_shown(theirs)}: every step of "
                    "a series shares it; import it into another catalog",
                    field="series",
                )
    session.execute(
        text(f"""INSERT INTO series (name, architecture, stacks, tokenizer_sha256, created_at)
                 SELECT s.series, s.architecture, CAST(s.stacks AS jsonb), s.tokenizer_sha256, s.created_at
                 FROM {stage} s ORDER BY s.row ON CONFLICT (name) DO NOTHING""")
    )
    clash = session.execute(
        text(f"""SELECT s.row, s.name, s.series, s.step, m.name AS here, x.name AS here_series, m.step AS here_step
                 FROM {models} s JOIN series se ON se.name = s.series
                 JOIN models m ON (m.name = s.name AND m.series_id IS NOT NULL
                                   AND (m.series_id, m.step) IS DISTINCT FROM (se.id, s.step))
                               OR (m.name <> s.name AND m.series_id = se.id AND m.step = s.step)
                 JOIN series x ON x.id = m.series_id
                 ORDER BY s.row LIMIT 1""")
    ).first()
    if clash is not None:
        where = f"models.parquet row {clash.row + 1}"
        if clash.here == clash.name:
            raise Conflict(f"catalog archive: {where}: model {clash.name!r} is step {clash.here_step} of series "
                           f"{clash.here_series!r} in the catalog, the archive's is step {clash.step} of series "
                           f"{clash.series!r}; import it under another name: --rename", field="step")  # fmt: skip
        raise Conflict(f"catalog archive: {where}: step {clash.step} of series {clash.series!r} is model "
                       f"{clash.here!r} in the catalog, not the archive's {clash.name!r}", field="step")  # fmt: skip
    session.execute(
        text(f"""UPDATE models m SET series_id = se.id, step = s.step,
                        requested_revision = coalesce(m.requested_revision, s.requested_revision)
                 FROM {models} s JOIN series se ON se.name = s.series
                 WHERE m.name = s.name AND m.series_id IS NULL""")
    )


@collector_paused()
def write(
    session: Session,
    archive: Archive,
    origin: str,
    renames: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write a validated archive in the session's transaction; returns what was imported."""
    report = progress or (lambda done, total: None)
    renames = dict(renames or {})
    session.execute(text("SET LOCAL TimeZone = 'UTC'"))
    # One import at a time: a second one waits here until the first commits, then finds its archive imported
    # or its models present, instead of failing on a unique key halfway through.
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": IMPORT_LOCK})
    wanted = [renames.get(name, name) for name in archive.models]
    done = session.execute(
        text("SELECT id, models FROM catalog_imports WHERE archive_sha256 = :s AND renames = CAST(:r AS jsonb)"),
        {"s": archive.sha256, "r": json.dumps(renames)},
    ).first()
    if done is not None and set(wanted) <= set(done.models):
        log.info("Archive %s was imported already (import %d); nothing to do", archive.sha256[:12], done.id)
        return {"import_id": done.id, "archive_sha256": archive.sha256, "models": done.models, "already": True,
                "inserted": {}, "left_out": archive.left_out,
                "current_runs": {"became_current": [], "not_current": []}}  # fmt: skip
    if done is not None:  # a part of this archive was imported: the import's record grows by this part
        import_id = done.id
    else:
        import_id = session.execute(
            text("""INSERT INTO catalog_imports (archive_sha256, origin, renames, format_version, headcat_version,
                        exported_at, models, rows)
                    VALUES (:s, :origin, CAST(:r AS jsonb), :fv, :hv, CAST(:exported AS timestamptz), '{}', :rows)
                    RETURNING id"""),
            {"s": archive.sha256, "origin": origin, "r": json.dumps(renames),
             "fv": archive.manifest["format_version"], "hv": str(archive.manifest.get("headcat_version", "unknown")),
             "exported": archive.manifest.get("exported_at"), "rows": archive.rows},
        ).scalar_one()  # fmt: skip
    try:
        had = current.imported_runs(session, archive.small, renames)
        names = _models(session, archive, renames, import_id)
        inserted = _write_tables(session, archive, report)
        # Which of the runs it wrote become current: decided after the rows are in (service/current.py).
        decided = current.after_import(
            session, had, current.imported_runs(session, archive.small, renames), _served(session)
        )
    except DBAPIError as error:
        first = str(error.orig or error).strip().splitlines()[0]
        raise InvalidInput(f"catalog archive: the catalog refused it: {first}", field="archive") from error
    before = list(done.models) if done is not None else []
    recorded = before + [name for name in names if name not in before]
    session.execute(text("UPDATE catalog_imports SET models = :n WHERE id = :i"), {"n": recorded, "i": import_id})
    log.info("Imported archive %s from %s: models %s (%d in all)", archive.sha256[:12], origin, listed(names),
             len(names))  # fmt: skip
    if archive.left_out:
        log.info("Left out of the import: models %s; clusterings %s; rows %s", listed(archive.left_out["models"]),
                 listed(archive.left_out["clusterings"]) or "none", archive.left_out["rows"])  # fmt: skip
    return {"import_id": import_id, "archive_sha256": archive.sha256, "models": names, "already": False,
            "inserted": inserted, "left_out": archive.left_out,
            "current_runs": decided}  # fmt: skip


@dataclass(frozen=True)
class HeadCopy:
    """How a per-head file reaches its table: the run whose rows they are (the target's column, the file's key
    column, its scope), and the target's column for each file column; head_types also names its feature run and
    cluster."""

    target: str
    run: tuple[str, str, str | None]  # (target column, key column, scope column: model, clustering or none)
    values: dict[str, str]  # target column -> file column
    feature_run: bool = False
    cluster: bool = False


def _same_names(*columns: str) -> dict[str, str]:
    return {c: c for c in columns}


HEAD_COPIES: dict[str, HeadCopy] = {
    "head_features": HeadCopy("head_features", ("feature_run_id", "feature_run", "model"), _same_names(
        "vector", "entropy", "prev_token", "next_token", "mean_distance", "sep_to_sep", "example_map")),
    "head_types": HeadCopy("head_assignments", ("clustering_id", "clustering", None),
                           _same_names("tsne_x", "tsne_y", "margin"), feature_run=True, cluster=True),
    "stability_heads": HeadCopy("stability_heads", ("stability_run_id", "stability_run", "clustering"),
                                _same_names("stable", "agreement")),
    "head_importance": HeadCopy("importance_scores", ("run_id", "importance_run", "model"),
                                {"raw": "importance_raw", "normalized": "importance"}),
    "head_attribution": HeadCopy("head_attributions", ("attribution_run_id", "attribution_run", "model"), {
        "vector": "global_vector", **_same_names("local_vector", "entropy", "prev_token", "next_token",
        "mean_distance", "sep_to_sep", "discrepancy", "example_attention", "example_attribution")}),
    "head_syntax": HeadCopy("head_syntax_scores", ("syntax_run_id", "syntax_run", "model"),
                            _same_names("relation", "direction", "correct", "count", "accuracy")),
    "head_detections": HeadCopy("head_detector_scores", ("detection_run_id", "detection_run", "model"),
                                _same_names("induction", "duplicate_token", "previous_token", "sink", "roles",
                                            "example_map")),
}  # fmt: skip


@contextmanager
def _without_triggers(session: Session) -> Iterator[None]:
    """Writes whose foreign keys hold by construction, without the per-row checks: PostgreSQL's foreign keys are
    triggers that probe the referenced table once per row written, which costs more than the write itself (see
    docs/usage/catalogs.md). With ``session_replication_role = replica`` (a superuser's setting, as ``pg_restore
    --disable-triggers`` uses) they do not fire; every id written is one this transaction read or made, and the rows
    it references are locked against deletion (:meth:`_HeadRows.lock`). Without the privilege the triggers check."""
    if not session.execute(text("SELECT usesuper FROM pg_user WHERE usename = current_user")).scalar():
        yield
        return
    session.execute(text("SET LOCAL session_replication_role = replica"))
    yield  # on an error the transaction is rolled back, and the setting with it
    session.execute(text("SET LOCAL session_replication_role = origin"))


#: From this many rows a COPY into an empty table is made with the table's indexes built after it (measured on
#: ``head_features``, 2 indexes: 10^4 rows cost the same either way, 10^5 rows 0.78x, 10^6 rows 0.59x).
INDEXES_AFTER = 10_000


@contextmanager
def _indexes_after(session: Session, table: str, rows: int) -> Iterator[None]:
    """A COPY of ``rows`` rows into ``table`` with its indexes built after them, where the table holds no rows (an
    import into a new catalog) and ``rows`` is at least :data:`INDEXES_AFTER`: PostgreSQL builds an index over
    rows already in the table by one sort, in a third to a half of the time the COPY takes to insert them (as
    ``pg_restore`` loads a table before its indexes; docs/usage/catalogs.md#cost). Kept as they are: an index a
    foreign key rests on (the heads' primary key), every index of a table that holds rows (a rebuild would cost
    the whole table, not the archive), and all of them where this role does not own the table.

    The table is locked ``ACCESS EXCLUSIVE`` before it is found empty, so no row arrives meanwhile; the indexes are
    dropped and made again in the import's transaction, so a rolled-back or killed import leaves them as they
    were, and a reader of the table waits for the import's commit instead of finding it empty. The lock is never
    waited for (``NOWAIT``): where another session holds the table (a reader in a transaction), the indexes are
    kept, so no reader queues behind the import's request and no wait outside PostgreSQL's sight (an export's
    thread beside its transaction) can close a cycle with it. They are made again from PostgreSQL's own
    definitions (``pg_get_constraintdef``, ``pg_get_indexdef``), under their names."""
    again = _dropped_indexes(session, table) if rows >= INDEXES_AFTER else []
    yield
    for statement in again:
        session.execute(text(statement))


def _dropped_indexes(session: Session, table: str) -> list[str]:
    """Drop ``table``'s indexes as :func:`_indexes_after` says; returns the statements that make them again."""
    owned = "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = CAST(:table AS regclass)"
    if not session.execute(text(owned), {"table": table}).scalar_one():
        return []
    empty = f"SELECT NOT EXISTS (SELECT FROM {table})"
    if not session.execute(text(empty)).scalar_one():
        return []
    try:  # never waited for: a session reading the table meanwhile keeps its indexes (and is not queued behind)
        with session.begin_nested():
            session.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE NOWAIT"))
    except DBAPIError as error:
        if not isinstance(error.orig, psycopg.errors.LockNotAvailable):
            raise
        log.info("%s: in use by another session, so its indexes are kept (built as the rows arrive)", table)
        return []
    if not session.execute(text(empty)).scalar_one():  # rows committed before the lock was granted
        return []
    indexes = session.execute(
        text("""SELECT CAST(CAST(i.indexrelid AS regclass) AS text), c.conname, pg_get_constraintdef(c.oid),
                       pg_get_indexdef(i.indexrelid)
                FROM pg_index i
                LEFT JOIN pg_constraint c ON c.conindid = i.indexrelid AND c.conrelid = i.indrelid
                     AND c.contype IN ('p', 'u', 'x')
                WHERE i.indrelid = CAST(:table AS regclass)
                  AND NOT EXISTS (SELECT FROM pg_constraint f WHERE f.contype = 'f' AND f.conindid = i.indexrelid)
                ORDER BY i.indexrelid"""),
        {"table": table},
    ).all()
    again = []
    for index, constraint, definition, made in indexes:
        if constraint is None:
            session.execute(text(f"DROP INDEX {index}"))
            again.append(made)
        else:
            session.execute(text(f'ALTER TABLE {table} DROP CONSTRAINT "{constraint}"'))
            again.append(f'ALTER TABLE {table} ADD CONSTRAINT "{constraint}" {definition}')
    log.debug("%s: %d indexes built after the COPY", table, len(again))
    return again


class _HeadRows:
    """The per-head files, written to their tables by binary COPY with this catalog's ids looked up per batch
    (Arrow and numpy, no Python per row). Only the rows of runs this import writes are written: a run already
    in the catalog is complete there, and a run of a model or clustering left out (:func:`select`) is not
    written at all."""

    def __init__(self, session: Session, archive: Archive, report: Progress) -> None:
        self.session, self.archive, self.report = session, archive, report
        self.done = 0
        self.left_out: dict[str, int] = {}
        raw = session.connection().connection.driver_connection
        assert raw is not None  # a live connection's psycopg connection
        self.raw = raw
        models = session.execute(text("SELECT name, id, first_head FROM _models")).all()
        self.names = [name for name, _, _ in models]
        self.model_ids = np.array([i for _, i, _ in models], dtype=np.int64)
        self.models = {("", name): int(i) for name, i, _ in models}  # -> the catalog's id
        self.places = {("", name): place for place, name in enumerate(self.names)}  # -> its place in self.heads
        self._heads(np.array([-1 if first is None else first for _, _, first in models], dtype=np.int64))
        self.lock()

    def _heads(self, first: np.ndarray) -> None:
        """Every head of the archive's models as one dense array: ``(model, stack)``'s heads from ``base``, layer
        by layer (-1: no such head in this catalog). A model whose heads this import made with consecutive ids
        (``first``, else -1; :func:`_new_heads`) has them in that order from its first; the others' are read."""
        names = self.names
        shapes = np.array([[self.archive.shapes[n].get(s, (0, 0)) for s in STACKS] for n in names], dtype=np.int64)
        shapes = shapes.reshape(len(names), len(STACKS), 2)
        self.layers, self.width = shapes[..., 0], shapes[..., 1]
        sizes = (self.layers * self.width).reshape(-1)
        self.base = (np.cumsum(sizes) - sizes).reshape(len(names), len(STACKS))
        self.heads = np.full(int(sizes.sum()), -1, dtype=np.int64)
        if not names:
            return
        made = np.flatnonzero(first >= 0)
        counts = sizes.reshape(len(names), len(STACKS)).sum(axis=1)[made]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        self.heads[np.repeat(self.base[made, 0], counts) + within] = np.repeat(first[made], counts) + within
        # (model id, stack index, layer, head, id) of every other head as one bytea of fixed-width big-endian
        # integers, read straight into numpy, :data:`HEAD_MODELS` models at a time (what is held at once stays
        # bounded).
        row = np.dtype([("model", ">i4"), ("stack", ">i4"), ("layer", ">i4"), ("head", ">i4"), ("id", ">i8")])
        order = np.argsort(self.model_ids)
        read = self.model_ids[first < 0]
        for at in range(0, len(read), HEAD_MODELS):
            data = self.session.execute(
                text("""SELECT coalesce(string_agg(int4send(h.model_id) || int4send(array_position(
                            CAST(:stacks AS text[]), h.stack::text) - 1) || int4send(h.layer) || int4send(h.head)
                            || int8send(h.id), ''::bytea), ''::bytea)
                        FROM heads h WHERE h.model_id = ANY(:ids)"""),
                {"stacks": list(STACKS), "ids": [int(i) for i in read[at : at + HEAD_MODELS]]},
            ).scalar_one()
            rows = np.frombuffer(data, dtype=row)
            m = order[np.searchsorted(self.model_ids, rows["model"].astype(np.int64), sorter=order)]
            s, layer, head = (rows[c].astype(np.int64) for c in ("stack", "layer", "head"))
            inside = (layer < self.layers[m, s]) & (head < self.width[m, s])
            self.heads[(self.base[m, s] + layer * self.width[m, s] + head)[inside]] = rows["id"][inside]
            del data, rows

    def lock(self) -> None:
        """The catalog's rows the per-head rows reference, locked as a foreign key's check would lock them
        (``FOR KEY SHARE``): no one deletes them until this transaction ends. The heads go with their model."""
        self.session.execute(text("SELECT 1 FROM models WHERE id IN (SELECT id FROM _models) FOR KEY SHARE"))

    def _keys(self, kind: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """``(every, fresh)``: ``(scope, key) -> id`` of every run of ``kind`` the import can reference, locked, and
        of those this import made (whose rows it writes)."""
        table = {key: name for name, (key, _) in RUNS.items()}[kind]
        self.session.execute(
            text(f"SELECT 1 FROM {table} WHERE id IN (SELECT id FROM _keys WHERE kind = :kind) FOR KEY SHARE"),
            {"kind": kind},
        )
        rows = self.session.execute(
            text("""SELECT k.model, k.key, k.id, f.key IS NOT NULL FROM _keys k
                    LEFT JOIN _fresh f ON f.kind = k.kind AND f.model = k.model AND f.key = k.key
                    WHERE k.kind = :kind"""),
            {"kind": kind},
        ).all()
        every = {(scope, key): ident for scope, key, ident, _ in rows}
        return every, {(scope, key): ident for scope, key, ident, fresh in rows if fresh}

    def _clusters(self) -> dict[tuple[str, str], int]:
        """``(clustering's key, cluster's name) -> id`` of the clusters the import can reference, locked."""
        rows = self.session.execute(
            text("""SELECT k.key, c.name, c.id FROM clusters c
                    JOIN _keys k ON k.kind = 'clustering' AND k.id = c.clustering_id FOR KEY SHARE OF c""")
        ).all()
        return {(clustering, name): ident for clustering, name, ident in rows}

    def copy(self, name: str) -> int:
        """COPY the rows of ``name`` that this import writes into their table; returns how many."""
        table, how = TABLE[name], HEAD_COPIES[name]
        column, key, scope = how.run
        _, fresh = self._keys(key)
        feature_runs = self._keys("feature_run")[0] if how.feature_run else None
        clusters = self._clusters() if how.cluster else None
        with self.raw.cursor() as cursor:
            types = binary.column_types(cursor, how.target)
        targets = ["model_id", column, "head_id", *(["feature_run_id"] if how.feature_run else []),
                   *(["cluster_id"] if how.cluster else []), *how.values]  # fmt: skip
        # The names looked up come as Parquet stores them (each row group's distinct names, each row's index):
        # :func:`_by_key` looks up names, not rows.
        names = ["model", "stack", key, *([scope] if scope else []), *(["feature_run"] if how.feature_run else []),
                 *(["clustering", "type"] if how.cluster else [])]  # fmt: skip
        path = self.archive.directory / table.file
        file = None if name in self.archive.absent else pq.ParquetFile(path, read_dictionary=names)
        written = left = 0
        quoted = ", ".join(f'"{t}"' for t in targets)
        statement = f"COPY {how.target} ({quoted}) FROM STDIN (FORMAT binary)"
        rows = 0 if file is None else file.metadata.num_rows
        try:
            with _indexes_after(self.session, how.target, rows), _without_triggers(self.session):
                with self.raw.cursor() as cursor, cursor.copy(statement) as copy:
                    copy.write(binary.HEADER)
                    for start, batch in _batches(file, table):
                        model, run = _by_key(batch, "model", None, self.models), _by_key(batch, key, scope, fresh)
                        selected = model >= 0
                        keep = selected & (run >= 0)
                        left += int(self._left_out(batch, selected).sum())
                        if not keep.any():
                            continue
                        mask = pa.array(keep)
                        batch = batch.filter(mask)
                        model, run = model[keep], run[keep]
                        ids = [model, run, self._head_ids(table, start, batch, keep)]
                        if feature_runs is not None:
                            found = _by_key(batch, "feature_run", "model", feature_runs)
                            ids.append(self._found(table, start, keep, "feature_run", found))
                        if clusters is not None:
                            found = _by_key(batch, "type", "clustering", clusters)
                            ids.append(self._found(table, start, keep, "type", found))
                        arrays = [*map(pa.array, ids), *(batch.column(c) for c in how.values.values())]
                        copy.write(binary.encode([(a, types[t]) for a, t in zip(arrays, targets, strict=True)]))
                        written += batch.num_rows
                        self.done += batch.num_rows
                        self.report(self.done, self.archive.rows)
                    copy.write(binary.TRAILER)
        except (psycopg.Error, DBAPIError) as error:  # a row the catalog refuses (a head twice in one run): the
            # file, and why (from the COPY, or from an index built after it: "could not create unique index", and
            # the key it found twice)
            cause = error.orig if isinstance(error, DBAPIError) else error
            first = str(cause).strip().splitlines()[0]
            detail = getattr(getattr(cause, "diag", None), "message_detail", None)
            if isinstance(cause, psycopg.errors.UniqueViolation) and detail and detail not in first:
                first = f"{first}: {detail}"
            raise ArchiveError(table.file, f"the catalog refused it: {first}") from error
        if left:
            self.left_out[table.file] = left
        return written

    def _left_out(self, batch: pa.RecordBatch, selected: np.ndarray) -> np.ndarray:
        """The rows :func:`select` left out: of a model, or of a clustering, not written."""
        out = ~selected
        if self.archive.clusterings is not None and "clustering" in batch.schema.names:
            kept = pa.array(sorted(self.archive.clusterings), pa.string())
            out |= ~pc.is_in(batch.column("clustering"), value_set=kept).to_numpy(zero_copy_only=False)
        return out

    def _found(self, table: Table, start: int, keep: np.ndarray, what: str, ids: np.ndarray) -> np.ndarray:
        """``ids`` (of the rows kept), refused where one was not found (-1)."""
        if (ids < 0).any():
            row = start + int(np.flatnonzero(keep)[int(np.flatnonzero(ids < 0)[0])])
            raise ArchiveError(table.file, f"its {what} is not in this catalog", row)
        return ids

    def _head_ids(self, table: Table, start: int, batch: pa.RecordBatch, keep: np.ndarray) -> np.ndarray:
        m, s = _by_key(batch, "model", None, self.places), _by_key(batch, "stack", None, STACK_PLACES)
        layer = batch.column("layer").to_numpy(zero_copy_only=False)
        head = batch.column("head").to_numpy(zero_copy_only=False)
        named = (m >= 0) & (s >= 0)  # the rows kept are of this import's models, their stacks checked before
        m, s = np.maximum(m, 0), np.maximum(s, 0)
        ids = self.heads[self.base[m, s] + layer * self.width[m, s] + head]
        return self._found(table, start, keep, "head", np.where(named, ids, -1))


def _write_tables(session: Session, archive: Archive, report: Progress) -> dict[str, int]:
    stg = {t.name: _stage(session, archive, t) for t in TABLES if not t.per_head and t.name not in ("models", "series")}
    heads = _HeadRows(session, archive, report)
    session.execute(
        text(f"""INSERT INTO corpora (name, kind, source, sha256)
                 SELECT DISTINCT ON (corpus_kind, corpus_source, corpus_sha256) corpus, corpus_kind, corpus_source,
                        corpus_sha256
                 FROM (SELECT corpus, corpus_kind, corpus_source, corpus_sha256, row FROM {stg["feature_runs"]}
                       UNION ALL
                       SELECT corpus, corpus_kind, corpus_source, corpus_sha256, row FROM {stg["attribution_runs"]}) s
                 ORDER BY corpus_kind, corpus_source, corpus_sha256, row
                 ON CONFLICT ON CONSTRAINT uq_corpora_kind_source_sha256 DO NOTHING""")
    )
    n: dict[str, int] = {}
    n["feature_runs"] = _insert_runs(session, "feature_runs", stg["feature_runs"], {
        "model_id": "m.id", "corpus_id": "co.id", **_same(
            "status", "num_windows", "max_length", "samples_requested", "num_samples", "num_tokens", "example_tokens"),
        "special_tokens": "CAST(s.special_tokens AS jsonb)", "config": "CAST(s.config AS jsonb)", **PROVENANCE,
    }, CORPUS)  # fmt: skip
    n["head_features"] = heads.copy("head_features")
    n["clusterings"] = _insert_runs(session, "clusterings", stg["clusterings"], {
        **_same("algorithm", "k", "seed", "num_windows", "status", "num_heads", "seconds", "vector", "created_at",
                "finished_at"),
        "params": "CAST(s.params AS jsonb)",
    })  # fmt: skip
    _refuse_clusterings_over_other_models(session, stg["clusterings"])
    session.execute(
        text(f"""INSERT INTO clustering_feature_runs (clustering_id, feature_run_id)
                 SELECT c.id, f.id FROM {stg["clusterings"]} s
                 CROSS JOIN LATERAL unnest(s.models, s.feature_runs) AS u(model, feature_run)
                 JOIN _keys c ON c.kind = 'clustering' AND c.model = '' AND c.key = s.clustering
                 JOIN _keys f ON f.kind = 'feature_run' AND f.model = u.model AND f.key = u.feature_run
                 ON CONFLICT DO NOTHING""")
    )
    n["clusters"] = _count(
        session.execute(
            text(f"""INSERT INTO clusters (clustering_id, index, name, centroid, size, share)
                 SELECT c.id, s.index, s.type, s.centroid, s.size, s.share FROM {stg["clusters"]} s
                 JOIN _keys c ON c.kind = 'clustering' AND c.model = '' AND c.key = s.clustering
                 ON CONFLICT DO NOTHING""")
        )
    )
    n["head_types"] = heads.copy("head_types")
    _current_clusterings(session)
    n["stability_runs"] = _insert_runs(session, "stability_runs", stg["stability_runs"], {
        "clustering_id": "c.id", **_same("n_runs", "fraction", "random_state", "seeds", "score", "num_heads",
                                         "seconds", "created_at"),
    }, _ref("clustering", "c", "clustering", "''"))  # fmt: skip
    n["stability_heads"] = heads.copy("stability_heads")
    n["ablation_baselines"] = _baselines(session, stg["ablation_baselines"])
    n["ablation_runs"] = _insert_runs(session, "ablation_runs", stg["ablation_runs"], {
        "model_id": "m.id", "clustering_id": "c.id", "baseline_id": "b.id", "status": "s.status", "task": "s.task",
        **DATA, **_same("n_examples", "plan"), "types": "CAST(s.types AS jsonb)", "config": "CAST(s.config AS jsonb)",
        **PROVENANCE,
    }, f"""{_ref("ablation_baseline", "b", "ablation_baseline")}
           {_ref("clustering", "c", "clustering", "''", left=True)}""")  # fmt: skip
    n["ablation_outcomes"] = _insert_rows(session, "ablation_outcomes", stg["ablation_outcomes"], {
        "run_id": "k.id", **_same("position", "row_id", "label", "paper_ref", "operations", "types", "heads",
                                  "n_examples", "seconds"),
        **{c: f"CAST(s.{c} AS jsonb)" for c in ("selection", "spec", "type_ops", "metrics", "baseline")},
    }, _ref("ablation_run", "k", "ablation_run"))  # fmt: skip
    n["importance_runs"] = _insert_runs(session, "importance_runs", stg["importance_runs"], {
        "model_id": "m.id", **_same("status", "loss", "task", "n_examples", "seed", "mean_loss"), **DATA,
        "config": "CAST(s.config AS jsonb)", **PROVENANCE,
    })  # fmt: skip
    n["head_importance"] = heads.copy("head_importance")
    n["pruning_curves"] = _insert_runs(session, "pruning_curves", stg["pruning_curves"], {
        "model_id": "m.id", "baseline_id": "b.id", "importance_run_id": "i.id", "clustering_id": "c.id",
        **_same("status", "task", "metric", "rankings", "iterative", "steps", "max_share", "seed", "type_order",
                "n_examples"),
        "orders": "CAST(s.orders AS jsonb)", "baseline": "CAST(s.baseline AS jsonb)", **DATA,
        "config": "CAST(s.config AS jsonb)", **PROVENANCE,
    }, f"""{_ref("ablation_baseline", "b", "ablation_baseline")} {_ref("importance_run", "i", "importance_run",
           left=True)} {_ref("clustering", "c", "clustering", "''", left=True)}""")  # fmt: skip
    n["pruning_points"] = _insert_rows(session, "pruning_points", stg["pruning_points"], {
        "curve_id": "k.id", **_same("ranking", "step", "pruned", "share", "seconds"),
        "metrics": "CAST(s.metrics AS jsonb)", "heads": "CAST(s.heads AS jsonb)",
    }, _ref("pruning_curve", "k", "pruning_curve"))  # fmt: skip
    n["attribution_runs"] = _insert_runs(session, "attribution_runs", stg["attribution_runs"], {
        "model_id": "m.id", "corpus_id": "co.id", **_same(
            "status", "stack", "num_windows", "max_length", "samples_requested", "num_samples", "num_tokens",
            "queries", "probes", "seed", "triples", "passes", "layer_discrepancy", "example_tokens",
            "example_queries"),
        "config": "CAST(s.config AS jsonb)", **PROVENANCE,
    }, CORPUS)  # fmt: skip
    n["head_attribution"] = heads.copy("head_attribution")
    n["syntax_runs"] = _insert_runs(session, "syntax_runs", stg["syntax_runs"], {
        "model_id": "m.id", **_same("status", "stack", "parses", "source", "sha256", "parser", "num_sentences",
                                    "num_skipped", "num_words"),
        "config": "CAST(s.config AS jsonb)", **PROVENANCE,
    })  # fmt: skip
    n["syntax_baselines"] = _insert_rows(session, "syntax_baselines", stg["syntax_baselines"], {
        "syntax_run_id": "k.id", **_same("relation", "count", "offset", "accuracy"),
    }, _ref("syntax_run", "k", "syntax_run"))  # fmt: skip
    n["head_syntax"] = heads.copy("head_syntax")
    n["detection_runs"] = _insert_runs(session, "detection_runs", stg["detection_runs"], {
        "model_id": "m.id", **_same("status", "num_sequences", "num_tokens", "loss_first", "loss_later",
                                    "repeat_gain", "example_size"),
        **{c: f"CAST(s.{c} AS jsonb)" for c in ("config", "sequences", "checks", "example_tokens")}, **PROVENANCE,
    })  # fmt: skip
    n["head_detections"] = heads.copy("head_detections")
    if heads.left_out:
        archive.left_out["rows"].update(heads.left_out)
    return n


def _current_clusterings(session: Session) -> None:
    """A new model's current clustering is the archive's (an existing model keeps its own): one UPDATE from the
    staged models file."""
    session.execute(
        text("""UPDATE models SET current_clustering_id = c.id
                FROM stg_models s JOIN _models m ON m.name = s.model AND m.new
                JOIN _keys c ON c.kind = 'clustering' AND c.model = '' AND c.key = s.current_clustering
                WHERE models.id = m.id""")
    )


def _served(session: Session) -> set[tuple[str, int]]:
    """``{(lens, run id)}`` of the runs the archive's source served (its ``current_*`` columns) for the models and
    clusterings this import created: they serve them here too (``service/current.py``). An archive older than
    those columns names none."""
    served: set[tuple[str, int]] = set()
    for name in current.IMPORTED:
        table = current.LENSES[name].run.__tablename__
        kind, column = RUNS[table][0], CURRENT[table]
        if table == "stability_runs":  # a clustering's own: the clusterings this import wrote
            owners = ("stg_clusterings s JOIN _fresh f ON f.kind = 'clustering' AND f.model = '' "
                      "AND f.key = s.clustering")  # fmt: skip
            scope = "s.clustering"
        else:
            owners, scope = "stg_models s JOIN _models m ON m.name = s.model AND m.new", "s.model"
        ids = session.scalars(
            text(f"""SELECT k.id FROM {owners}
                     JOIN _keys k ON k.kind = '{kind}' AND k.model = {scope} AND k.key = s.{column}""")
        )
        served.update((name, int(i)) for i in ids)
    return served


def _baselines(session: Session, stage: str) -> int:
    """Baselines are unique per (model, task, data, subset, limit, max_length, dtype): one already here is reused."""
    inserted = _insert_rows(session, "ablation_baselines", stage, {
        "model_id": "m.id", **_same("task", "data_key", "data_subset", "limit", "max_length", "dtype", "n_examples",
                                    "seconds", "device", "created_at"),
        "metrics": "CAST(s.metrics AS jsonb)",
    }, "")  # fmt: skip
    session.execute(
        text(f"""INSERT INTO _keys (kind, model, key, id)
                 SELECT 'ablation_baseline', s.model, s.ablation_baseline, b.id FROM {stage} s
                 JOIN _models m ON m.name = s.model
                 JOIN ablation_baselines b ON b.model_id = m.id AND b.task = s.task AND b.data_key = s.data_key
                  AND b.data_subset IS NOT DISTINCT FROM s.data_subset AND b."limit" IS NOT DISTINCT FROM s."limit"
                  AND b.max_length = s.max_length AND b.dtype = s.dtype
                 ON CONFLICT DO NOTHING""")
    )
    return inserted


def parse_renames(values: list[str] | None) -> dict[str, str]:
    """``["old=new", ...]`` -> ``{old: new}``."""
    renames: dict[str, str] = {}
    for value in values or []:
        old, sep, new = value.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise InvalidInput(f"rename: {value!r} is not OLD=NEW", field="rename")
        renames[old.strip()] = new.strip()
    return renames
