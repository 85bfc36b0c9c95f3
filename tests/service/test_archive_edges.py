"""A catalog archive at its edges: every field of the manifest removed or nulled, and every value range the
importer declares (``importer.RANGES``) at its ends and just outside.

The manifest's fields are walked, not listed: a field whose removal must refuse the archive is in
:data:`REQUIRED` with the message that names it; every other field is optional and its removal must
leave the archive importable. A new field is thus optional until a check reads it, and then this test
fails until the field's case is written down here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from service.jobs.runner import run_inline
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
