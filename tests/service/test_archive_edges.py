"""A catalog archive at its edges: every field of the manifest removed or nulled, and every value range the
importer declares (``importer.RANGES``) at its ends and just outside.

The manifest's fields are walked, not listed: a field whose removal must refuse the archive is in
:data:`REQUIRED` with the message that names it; every other field is optional and its removal must
leave the archive importable. A new field is thus optional until a check reads it, and then this test
fails until the field's case is written down here.

The importer's other bounds follow: each check's value exactly at its bound is taken and just past it refused
naming the field (detection thresholds, token ids, map sizes, stack shapes, renames, window counts, a head's
position, a vector's lowest value), and a model already in the catalog with more heads than the archive says.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from ingest.detectors import DETECTORS
from service import db
from service.catalogs import importer
from service.catalogs.export import MANIFEST, export_catalog, sha256_file
from service.catalogs.tables import TABLES
from service.errors import InvalidInput
from service.jobs.runner import run_inline
from tests.service.synthetic import dirichlet, store_model
from tests.service.two_runs import THRESHOLDS, committed

# manifest path (files.* is every file's entry) -> the start of the refusal when it is removed or null
REQUIRED = {
    ("format",): "manifest.json: not a headcat catalog manifest",
    ("format_version",): "manifest.json: format_version None is not an integer",
    ("files",): "manifest.json: has no 'files' table",
    ("files", "*"): "manifest.json: does not list {file}",
    ("files", "*", "sha256"): "{file}: checksum mismatch",
    ("files", "*", "rows"): "{file}: holds",
}
ENTRIES = ("models.parquet", "head_types.parquet")  # the file entries whose fields are walked


@pytest.fixture(scope="module")
def archive(
    committed_database_url: str, tiny_bert_path: Path, bart_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    engine = create_engine(committed_database_url)
    committed(engine, tiny_bert_path, bart_path)
    directory = tmp_path_factory.mktemp("edges") / "catalog"
    with engine.connect() as connection, connection.begin():
        export_catalog(connection, directory)
    engine.dispose()
    return directory


def paths(manifest: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every field of the manifest to remove: top-level keys, each model's fields, each file entry, and the fields
    of the :data:`ENTRIES`."""
    out: list[tuple[str, ...]] = [(key,) for key in manifest]
    for model, fields in manifest["models"].items():
        out += [("models", model), *(("models", model, key) for key in fields)]
    out += [("files", name) for name in manifest["files"]]
    out += [("files", name, key) for name in ENTRIES for key in manifest["files"][name]]
    return out


def refusal(path: tuple[str, ...]) -> str | None:
    """The message that removing ``path`` must give (None: an optional field)."""
    pattern = tuple("*" if i == 1 and path[0] == "files" else part for i, part in enumerate(path))
    message = REQUIRED.get(pattern)
    return None if message is None else message.format(file=path[1] if len(path) > 1 else "")


def edited(source: Path, target: Path, path: tuple[str, ...], how: str) -> Path:
    shutil.copytree(source, target)
    manifest = json.loads((target / MANIFEST).read_text())
    holder = manifest
    for part in path[:-1]:
        holder = holder[part]
    if how == "removed":
        del holder[path[-1]]
    else:
        holder[path[-1]] = None
    (target / MANIFEST).write_text(json.dumps(manifest))
    return target


def test_every_field_of_the_manifest_removed_or_nulled(archive: Path, tmp_path: Path) -> None:
    manifest = json.loads((archive / MANIFEST).read_text())
    walked = paths(manifest)
    assert {("files", "models.parquet", "sha256"), ("exported_at",), ("headcat_version",)} <= set(walked)
    for path in walked:
        for how in ("removed", "nulled"):
            target = edited(archive, tmp_path / f"{'.'.join(path)}-{how}", path, how)
            message = refusal(path)
            if message is None:
                importer.validate(target)  # an optional field: the archive stays valid
                continue
            with pytest.raises(importer.ArchiveError) as refused:
                importer.validate(target)
            assert str(refused.value).startswith(f"catalog archive: {message}"), (path, how, str(refused.value))


@pytest.fixture
def empty_catalog(committed_database_url: str) -> Iterator[Engine]:
    admin = create_engine(make_url(committed_database_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    name = f"headcat_edges_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(committed_database_url).set(database=name).render_as_string(hide_password=False)
    try:
        db.upgrade(url)
        engine = create_engine(url)
        yield engine
        engine.dispose()
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_an_archive_without_its_optional_fields_imports_and_records_them_unknown(
    archive: Path, tmp_path: Path, empty_catalog: Engine
) -> None:
    """Every optional field removed at once: the import writes the catalog and records what it lacked."""
    target = tmp_path / "bare"
    shutil.copytree(archive, target)
    manifest = json.loads((target / MANIFEST).read_text())
    bare = {key: manifest[key] for key in ("format", "format_version")}
    bare["files"] = {name: {k: v for k, v in entry.items() if k in ("sha256", "rows")}
                     for name, entry in manifest["files"].items()}  # fmt: skip
    (target / MANIFEST).write_text(json.dumps(bare))
    job = run_inline(sessionmaker(bind=empty_catalog, expire_on_commit=False), "catalog_import",
                     {"archive": str(target), "renames": {}})  # fmt: skip
    assert job.status == "succeeded", job.error
    with empty_catalog.connect() as connection:
        record = connection.execute(text("SELECT headcat_version, exported_at, models FROM catalog_imports")).one()
        heads = connection.execute(text("SELECT count(*) FROM heads")).scalar_one()
    assert (record.headcat_version, record.exported_at, sorted(record.models)) == ("unknown", None, sorted(
        manifest["models"]))  # fmt: skip
    assert heads == 8 + 24 + 8


# --- value ranges --------------------------------------------------------------------------------


def rewrite(directory: Path, name: str, column: str, value: float) -> None:
    """Row 0 of ``column`` set to ``value`` (a detection's roles kept to what its scores reach), the manifest
    made to agree."""
    path = directory / name
    table = pq.read_table(path)
    columns = {c: table.column(c).to_pylist() for c in table.column_names}
    columns[column][0] = value
    if column in DETECTORS:
        columns["roles"][0] = [
            d for d in DETECTORS if columns[d][0] is not None and columns[d][0] >= THRESHOLDS[d]
        ]  # fmt: skip
    table = pa.table({c: pa.array(v, table.schema.field(c).type) for c, v in columns.items()}, schema=table.schema)
    pq.write_table(table, path)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name].update(sha256=sha256_file(path), rows=table.num_rows)
    (directory / MANIFEST).write_text(json.dumps(manifest))


CASES = [(file, column, low, high) for file, ranges in importer.RANGES.items() for column, low, high in ranges]


@pytest.mark.parametrize(("file", "column", "low", "high"), CASES, ids=[f"{f}.{c}" for f, c, *_ in CASES])
def test_a_declared_range_holds_its_ends_and_refuses_just_outside(
    archive: Path, tmp_path: Path, file: str, column: str, low: float, high: float
) -> None:
    tolerance = importer.SCORE_TOLERANCE if file == "head_detections" else 0.0
    name = f"{file}.parquet"
    ends = (low - tolerance, low, high, high + tolerance)
    outside = (math.nextafter(low - tolerance, -math.inf), math.nextafter(high + tolerance, math.inf), math.nan)
    for i, value in enumerate((*ends, *outside)):
        target = tmp_path / f"{column}-{i}"
        shutil.copytree(archive, target)
        rewrite(target, name, column, value)
        if value in ends:
            importer.validate(target)
            continue
        with pytest.raises(importer.ArchiveError, match=rf"^catalog archive: {name} row 1: {column} \S+ is outside"):
            importer.validate(target)


# --- the bounds of the importer's other checks ----------------------------------------------------------------


def rewrite_rows(directory: Path, name: str, change: Any, row_group_size: int | None = None) -> None:
    """``name``'s rows (dicts, in file order) replaced by ``change(rows)``, the schema kept and the manifest made
    to agree (checksum, rows); in row groups of ``row_group_size`` rows where given."""
    path = directory / name
    table = pq.read_table(path)
    table = pa.Table.from_pylist(change(table.to_pylist()), schema=table.schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name].update(sha256=sha256_file(path), rows=table.num_rows)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def row_set(index: int, **values: Any) -> Any:
    """A ``rewrite_rows`` change: row ``index`` given these values (a callable value maps the row to its value)."""

    def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows[index] = {**rows[index], **{k: v(rows[index]) if callable(v) else v for k, v in values.items()}}
        return rows

    return change


def first(directory: Path, name: str, **where: Any) -> int:
    """The index of the first row of ``name`` with these values."""
    rows = pq.read_table(directory / name).to_pylist()
    return next(i for i, row in enumerate(rows) if all(row[k] == v for k, v in where.items()))


@pytest.fixture
def copy_of(archive: Path, tmp_path: Path) -> Any:
    """A fresh copy of the archive for each case, changed by ``rewrite_rows(copy, name, change)``."""
    made = iter(range(1000))

    def make(name: str, change: Any) -> Path:
        target = tmp_path / f"case-{next(made)}"
        shutil.copytree(archive, target)
        rewrite_rows(target, name, change)
        return target

    return make


def refused(directory: Path, message: str, renames: dict[str, str] | None = None) -> None:
    with pytest.raises(importer.ArchiveError) as raised:
        importer.validate(directory, renames)
    assert str(raised.value).startswith(f"catalog archive: {message}"), str(raised.value)


def detection_run(directory: Path, thresholds: dict[str, float] | None = None, size: int | None = None) -> None:
    """tiny's first detection run given these thresholds (its heads' roles made what their scores reach), or maps
    of ``size`` x ``size`` (each head's map that many values)."""
    name = "detection_runs.parquet"
    run = pq.read_table(directory / name).to_pylist()[first(directory, name, model="tiny")]
    if thresholds is not None:
        config = json.loads(run["config"])
        config["thresholds"] = thresholds
        run = {**run, "config": json.dumps(config)}
    if size is not None:
        run = {**run, "example_size": size}
    rewrite_rows(directory, name, lambda rows: [run if r["model"] == "tiny" and r["detection_run"] == run[
        "detection_run"] else r for r in rows])  # fmt: skip

    def head(row: dict[str, Any]) -> dict[str, Any]:
        if (row["model"], row["detection_run"]) != ("tiny", run["detection_run"]):
            return row
        if thresholds is not None:
            row = {**row, "roles": [d for d in DETECTORS if row[d] is not None and row[d] >= thresholds[d]]}
        if size is not None:
            row = {**row, "example_map": [0.5] * (size * size)}
        return row

    rewrite_rows(directory, "head_detections.parquet", lambda rows: [head(r) for r in rows])


def heads_run(directory: Path) -> str:
    """The key of tiny's first detection run (the one :func:`detection_run` changes)."""
    name = "detection_runs.parquet"
    return str(pq.read_table(directory / name).column("detection_run")[first(directory, name, model="tiny")])


def test_a_detection_run_s_thresholds_token_ids_and_map_size_hold_their_bounds(archive: Path, tmp_path: Path) -> None:
    """Thresholds of exactly 0 (every scored head has the role) and 1 (none has), a token id 0 and maps of 1 x 1
    are a valid run's; just outside is refused, naming the field."""
    name = "detection_runs.parquet"
    row = first(archive, name, model="tiny")
    made = iter(range(1000))

    def case() -> Path:
        target = tmp_path / f"case-{next(made)}"
        shutil.copytree(archive, target)
        return target

    for value in (0.0, 1.0):
        target = case()
        detection_run(target, thresholds=dict.fromkeys(DETECTORS, value))
        heads = pq.read_table(target / "head_detections.parquet").to_pylist()
        roles = [h["roles"] for h in heads if h["model"] == "tiny" and h["detection_run"] == heads_run(target)]
        assert all(r == list(DETECTORS) for r in roles) if value == 0.0 else not any(roles)
        importer.validate(target)
    for value in (math.nextafter(0.0, -1.0), math.nextafter(1.0, 2.0)):
        for detector in DETECTORS:
            target = case()
            detection_run(target, thresholds={d: value if d == detector else 0.5 for d in DETECTORS})
            refused(target, f"{name} row {row + 1}: config.thresholds is not a threshold in [0, 1]")

    target = case()
    detection_run(target, size=1)
    importer.validate(target)
    target = case()
    detection_run(target, size=0)
    refused(target, f"{name} row {row + 1}: example_size 0 is not >= 1")

    def token(value: int) -> Any:
        def sequences(run: dict[str, Any]) -> str:
            parsed = json.loads(run["sequences"])
            parsed["sequences"][1][2] = value
            return json.dumps(parsed)

        return row_set(row, sequences=sequences)

    for value in (0, -1):
        target = case()
        rewrite_rows(target, name, token(value))
        if value == 0:
            importer.validate(target)
        else:
            refused(target, f"{name} row {row + 1}: sequences.sequences is not 2 lists of 6 token ids")


def test_a_stack_s_layers_and_heads_hold_their_bounds(archive: Path, copy_of: Any) -> None:
    """A stack of 10,000 layers and 10,000 heads is a model's (its heads stay inside); 0 or 10,001 layers or heads
    is refused naming the stack."""
    name = "models.parquet"
    tiny = first(archive, name, model="tiny")

    def encoder(layers: int, heads: int) -> Any:
        def stacks(row: dict[str, Any]) -> str:
            parsed = json.loads(row["stacks"])
            parsed["encoder"] = {**parsed["encoder"], "layers": layers, "heads": heads}
            return json.dumps(parsed)

        return row_set(tiny, stacks=stacks)

    importer.validate(copy_of(name, encoder(10_000, 10_000)))
    for layers, heads in ((0, 4), (2, 0), (10_001, 4), (2, 10_001)):
        refused(copy_of(name, encoder(layers, heads)),
                f"{name} row {tiny + 1}: stack 'encoder' has no positive layers and heads")  # fmt: skip


def test_a_rename_to_a_name_of_200_characters_is_taken_and_one_longer_refused(archive: Path) -> None:
    checked = importer.validate(archive, {"tiny": "t" * 200})
    assert "tiny" in checked.shapes
    for new in ("t" * 201, ""):
        with pytest.raises(InvalidInput, match=rf"^rename: '{new}' is not a model name \(1 to 200 characters\)$"):
            importer.validate(archive, {"tiny": new})


def test_a_feature_run_s_window_count_holds_its_bounds(archive: Path, copy_of: Any) -> None:
    """Runs of 1 and of 1024 windows (their vectors 1 + 5 and 1024 + 5 long, the named columns null beyond) are
    valid; 0 and 1025 are refused naming the run."""
    name = "feature_runs.parquet"
    row = first(archive, name, model="tiny")
    run = pq.read_table(archive / name).to_pylist()[row]
    ours = ("tiny", run["feature_run"])
    for windows, values in ((1, [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]), (1024, [0.5] + [0.5 / 1028] * 1028)):
        target = copy_of(name, row_set(row, num_windows=windows))
        change = vector_of(values)
        rewrite_rows(target, "head_features.parquet", lambda rows, change=change: [
            change(r) if (r["model"], r["feature_run"]) == ours else r for r in rows])  # fmt: skip
        importer.validate(target)
    for windows in (0, 1025):
        refused(copy_of(name, row_set(row, num_windows=windows)),
                f"{name}: num_windows {windows} of run {run['feature_run']!r} of 'tiny' is not 1..1024")  # fmt: skip


def test_a_head_at_the_edge_of_its_model_and_a_bad_row_at_head_0_are_named(archive: Path, copy_of: Any) -> None:
    """A head one layer past the model's last is refused as outside the model; a row at layer 0 head 0 whose
    run is unknown is refused for its run, not its head."""
    name = "head_importance.parquet"
    last = first(archive, name, model="tiny", layer=1, head=1)
    refused(copy_of(name, row_set(last, layer=2)),
            f"{name} row {last + 1}: encoder layer 2 head 1 is outside model 'tiny' (2 layers x 4 heads)")  # fmt: skip
    origin = first(archive, name, model="tiny", layer=0, head=0)
    refused(copy_of(name, row_set(origin, importance_run="0" * 32)),
            f"{name} row {origin + 1}: importance_run '{'0' * 32}' is not in importance_runs.parquet")  # fmt: skip


def test_a_head_type_not_of_its_clustering_is_named(archive: Path, copy_of: Any) -> None:
    name = "head_types.parquet"
    refused(copy_of(name, row_set(3, type="nope")),
            f"{name} row 4: type 'nope' is not a cluster of its clustering in clusters.parquet")  # fmt: skip


def test_a_run_of_a_model_the_archive_lacks_is_named(archive: Path, copy_of: Any) -> None:
    name = "importance_runs.parquet"
    row = first(archive, name, model="tiny")
    refused(copy_of(name, row_set(row, model="nope")), f"{name} row {row + 1}: model 'nope' is not in models.parquet")


def vector_of(values: list[float]) -> Any:
    """A head_features change: the row's vector (and its named columns ``w*`` and specials) set to ``values``."""

    def change(row: dict[str, Any]) -> dict[str, Any]:
        windows = len(values) - 5
        named = {f"w{w}": values[w] if w < windows else None for w in range(16)}
        specials = dict(zip(("self", "cls", "sep", "period", "comma"), values[windows:], strict=True))
        return {**row, "vector": values, **named, **specials}

    return change


def test_a_feature_vector_may_dip_to_minus_the_tolerance_and_no_further(archive: Path, copy_of: Any) -> None:
    """A value of exactly ``-SUM_TOLERANCE`` (float error) in a vector that sums to 1 is taken; below it the
    vector is refused for its negative value; at it, a vector that sums to 0.9 is refused for its sum."""
    name = "head_features.parquet"
    size = len(pq.read_table(archive / name).column("vector")[5].as_py())
    tolerance = importer.SUM_TOLERANCE

    def vector(low: float, total: float) -> list[float]:
        return [low] + [(total - low) / (size - 1)] * (size - 1)

    def at(values: list[float]) -> Any:
        def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            rows[5] = vector_of(values)(rows[5])
            return rows

        return change

    importer.validate(copy_of(name, at(vector(-tolerance, 1.0))))
    refused(copy_of(name, at(vector(math.nextafter(-tolerance, -1.0), 1.0))),
            f"{name} row 6: features hold a negative value (-0.001)")  # fmt: skip
    refused(copy_of(name, at(vector(-tolerance, 0.9))), f"{name} row 6: features sum to 0.9, not 1")


def test_a_later_column_in_an_older_archive_is_still_checked_wherever_it_stands(archive: Path, tmp_path: Path) -> None:
    """A format 3 archive whose models.parquet carries format 4's ``series`` column anyway, as its first column:
    read (all null: no series) when of its type, refused naming it when not."""
    from tests.service.test_catalog_archive import as_format

    for kind, message in (
        (pa.string(), None),
        (pa.int64(), "models.parquet: column 'series' is int64, expected string"),
    ):
        target = tmp_path / str(kind)
        shutil.copytree(archive, target)
        as_format(target, 3)
        path = target / "models.parquet"
        table = pq.read_table(path)
        pq.write_table(table.add_column(0, pa.field("series", kind), pa.nulls(table.num_rows, kind)), path)
        manifest = json.loads((target / MANIFEST).read_text())
        manifest["files"]["models.parquet"]["sha256"] = sha256_file(path)
        (target / MANIFEST).write_text(json.dumps(manifest))
        assert pq.read_schema(path).names[0] == "series"
        if message is None:
            importer.validate(target)
        else:
            refused(target, message)


def test_a_model_here_with_more_heads_than_the_archive_gives_it_takes_each_row_at_its_own_head(
    archive: Path, tmp_path: Path, empty_catalog: Engine, tiny_bert_path: Path
) -> None:
    """The catalog holds ``tiny`` (2 layers x 4 heads); the archive's ``tiny``, of the same checkpoint, says 1 layer
    x 3 heads and has rows for those only. Its part imports, each row at the catalog's head of the same layer and
    head; the catalog's heads past the archive's shape (layer 1, head 3) are left alone."""
    with sessionmaker(bind=empty_catalog)() as session, session.begin():
        store_model(session, tiny_bert_path, "tiny", {"encoder": dirichlet(np.random.default_rng(0), 2, 4)})
    target = tmp_path / "smaller"
    shutil.copytree(archive, target)

    def smaller(row: dict[str, Any]) -> dict[str, Any]:
        stacks = json.loads(row["stacks"])
        stacks["encoder"] = {**stacks["encoder"], "layers": 1, "heads": 3}
        return {**row, "stacks": json.dumps(stacks)} if row["model"] == "tiny" else row

    rewrite_rows(target, "models.parquet", lambda rows: [smaller(r) for r in rows])
    for table in TABLES:
        if table.per_head:
            rewrite_rows(target, table.file, lambda rows: [
                r for r in rows if r["model"] != "tiny" or (r["layer"] < 1 and r["head"] < 3)])  # fmt: skip
    job = run_inline(sessionmaker(bind=empty_catalog, expire_on_commit=False), "catalog_import",
                     {"archive": str(target), "renames": {}, "models": ["tiny"]})  # fmt: skip
    assert job.status == "succeeded", job.error
    with empty_catalog.connect() as connection:
        heads = connection.execute(text("SELECT count(*) FROM heads")).scalar_one()
        stored = connection.execute(
            text("""SELECT h.layer, h.head, s.raw, s.normalized FROM importance_scores s
                    JOIN heads h ON h.id = s.head_id JOIN models m ON m.id = h.model_id WHERE m.name = 'tiny'""")
        ).all()
    assert heads == 8  # the catalog's own
    rows = [r for r in pq.read_table(target / "head_importance.parquet").to_pylist() if r["model"] == "tiny"]
    assert len(rows) == 2 * 3  # two runs, three heads each
    assert sorted(map(tuple, stored)) == sorted((r["layer"], r["head"], r["importance_raw"], r["importance"])
                                                for r in rows)  # fmt: skip


def test_a_file_in_many_row_groups_is_checked_whole_and_the_first_bad_row_is_named(
    archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-head file's row groups are checked by several threads (``importer.CHECKERS``). A file of two-row
    groups validates whole, and with two bad rows the one named is the file's first, even when the thread
    checking its group finishes last: here that group waits until a later group's rows have been read."""
    name, run = "head_importance.parquet", "importance_run"
    rows = pq.read_table(archive / name).num_rows
    assert rows >= 10
    whole = tmp_path / "whole"
    shutil.copytree(archive, whole)
    rewrite_rows(whole, name, lambda r: r, row_group_size=2)
    assert pq.ParquetFile(whole / name).metadata.num_row_groups == (rows + 1) // 2
    importer.validate(whole)

    broken = tmp_path / "broken"
    shutil.copytree(whole, broken)
    early, late = 1, 6  # in groups 0 and 3
    rewrite_rows(broken, name, lambda r: row_set(late, **{run: "1" * 32})(row_set(early, **{run: "0" * 32})(r)),
                 row_group_size=2)  # fmt: skip
    real = importer._batches
    later_read = threading.Event()

    def batches(file: Any, table: Any, groups: Any = None, start: int = 0) -> Any:
        if table.file == name and groups == [0]:
            assert later_read.wait(timeout=300), "group 3 was never read"
        for item in real(file, table, groups, start):
            if table.file == name and groups == [3]:
                later_read.set()  # before its check, which raises
            yield item

    monkeypatch.setattr(importer, "_batches", batches)
    refused(broken, f"{name} row {early + 1}: {run} '{'0' * 32}' is not in importance_runs.parquet")
    assert later_read.is_set()


@pytest.mark.parametrize("interleaved", [False, True], ids=["alone", "another session takes ids meanwhile"])
def test_every_per_head_row_lands_at_its_own_head_of_the_heads_the_import_makes(
    archive: Path, empty_catalog: Engine, monkeypatch: pytest.MonkeyPatch, interleaved: bool
) -> None:
    """An import makes every head of a new model by one COPY. When no other session took a value of the heads'
    sequence meanwhile, it knows their ids without reading them back (``importer._new_heads``); when one did (here:
    one value before each model's heads), it reads them back. Either way each per-head row is stored at the head
    of its model, stack, layer and head (every stack of the encoder-decoder included)."""
    known: list[int] = []
    real_heads = importer._HeadRows._heads

    def spy(self: Any, first_head: np.ndarray) -> None:
        known.append(int((first_head >= 0).sum()))
        real_heads(self, first_head)

    monkeypatch.setattr(importer._HeadRows, "_heads", spy)
    other = create_engine(empty_catalog.url, isolation_level="AUTOCOMMIT")
    if interleaved:
        real_rows = importer._head_rows

        def head_rows(model_id: int, stacks: Any) -> Any:
            with other.connect() as connection:
                connection.execute(text("SELECT nextval(pg_get_serial_sequence('heads', 'id'))"))
            yield from real_rows(model_id, stacks)

        monkeypatch.setattr(importer, "_head_rows", head_rows)
    try:
        job = run_inline(sessionmaker(bind=empty_catalog, expire_on_commit=False), "catalog_import",
                         {"archive": str(archive), "renames": {}})  # fmt: skip
    finally:
        other.dispose()
    assert job.status == "succeeded", job.error
    models = pq.read_table(archive / "models.parquet").num_rows
    assert known == [0 if interleaved else models]
    with empty_catalog.connect() as connection:
        stored = connection.execute(
            text("""SELECT m.name, h.stack, h.layer, h.head, f.entropy FROM head_features f
                    JOIN heads h ON h.model_id = f.model_id AND h.id = f.head_id JOIN models m ON m.id = h.model_id""")
        ).all()
        detected = connection.execute(
            text("""SELECT m.name, h.stack, h.layer, h.head, d.sink FROM head_detector_scores d
                    JOIN heads h ON h.model_id = d.model_id AND h.id = d.head_id JOIN models m ON m.id = h.model_id""")
        ).all()
    features = pq.read_table(archive / "head_features.parquet").to_pylist()
    assert {r["stack"] for r in features} == {"encoder", "decoder", "cross"}
    assert sorted(map(tuple, stored)) == sorted(
        (r["model"], r["stack"], r["layer"], r["head"], r["entropy"]) for r in features)  # fmt: skip
    detections = pq.read_table(archive / "head_detections.parquet").to_pylist()
    assert detections
    assert sorted(map(tuple, detected)) == sorted(
        (r["model"], r["stack"], r["layer"], r["head"], r["sink"]) for r in detections)  # fmt: skip


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_rows_are_looked_up_by_their_scope_and_key(dictionary: bool) -> None:
    """``importer._by_key``: a row's ``(scope, key)`` pair, not either alone; a null on either side, or a pair
    not there, is -1; plain text columns as dictionary ones (as the validation reads them)."""
    models = ["a", "b", "a", None, "b", "a", "c"]
    runs = ["r1", "r1", "r2", "r1", None, "r1", "r1"]
    columns = [pa.array(models, pa.string()), pa.array(runs, pa.string())]
    if dictionary:
        columns = [c.dictionary_encode() for c in columns]
    batch = pa.RecordBatch.from_arrays(columns, names=["model", "run"])
    found = {("a", "r1"): 10, ("b", "r1"): 11, ("b", "r2"): 12, ("c", "r2"): 13}
    assert importer._by_key(batch, "run", "model", found).tolist() == [10, 11, -1, -1, -1, 10, -1]
    assert importer._by_key(batch, "model", None, {("", "b"): 7}).tolist() == [-1, 7, -1, -1, 7, -1, -1]
