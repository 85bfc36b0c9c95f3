"""Series in the catalog archive (format 4, issue 34): a catalog holding a series of three checkpoints is
exported and imported into an empty catalog and into one that already holds two of its steps; the series
and each model's series, step, revision and requested revision come back, and the series' trajectories
are the source's. An archive whose steps disagree with their series is refused naming the field; a
format 3 archive (no series) still imports."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import sessionmaker

from service.catalogs import importer
from service.catalogs.export import MANIFEST
from service.catalogs.tables import FORMAT_VERSION
from service.errors import Conflict, InvalidInput
from service.jobs.runner import run_inline
from tests.induction_model import save_induction_series
from tests.service import test_catalog_archive as base
from tests.service.conftest import ingest_request
from tests.service.test_catalog_archive import api, as_format, export, import_archive, rewrite, view_rows

SERIES = "grow"
STEPS = {0: (0.0, 0.0), 100: (0.5, 0.0), 200: (1.0, 1.0)}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
new_catalog = base.new_catalog  # the catalog archive tests' fixture: empty, migrated, committed catalogs


def ingest_steps(engine: Engine, directory: Path, steps: list[int]) -> None:
    """Each step ingested as ``grow-step-N``, a step of series ``grow``, by the ingest job (as the CLI does)."""
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    for step in steps:
        request = ingest_request(directory / f"step-{step}", f"{SERIES}-step-{step}", samples=4, max_length=32,
                                 series=SERIES, step=step)  # fmt: skip
        job = run_inline(sessions, "ingest", request)
        assert job.status == "succeeded", job.error


def step_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return list(
            connection.execute(
                text("""SELECT m.name, s.name, m.step, m.source, m.revision, m.requested_revision FROM models m
                        LEFT JOIN series s ON s.id = m.series_id ORDER BY m.name""")
            ).tuples()
        )


def series_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return list(
            connection.execute(
                text("SELECT name, architecture, stacks, tokenizer_sha256, created_at FROM series ORDER BY name")
            ).tuples()
        )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_induction_series(tmp_path_factory.mktemp("series-archive"), STEPS)


@pytest.fixture(scope="module")
def source(new_catalog: Callable[[], Engine], checkpoints: Path) -> Engine:
    """A catalog with the three steps of ``grow``; step 200 says it came from a hub revision (as an ingest with
    ``--revision step200`` stores it)."""
    engine = new_catalog()
    ingest_steps(engine, checkpoints, list(STEPS))
    with engine.begin() as connection:
        connection.execute(text(f"UPDATE models SET requested_revision = 'step200', revision = '{COMMIT}' "
                                f"WHERE name = '{SERIES}-step-200'"))  # fmt: skip
    return engine


@pytest.fixture(scope="module")
def archive(source: Engine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("series-export") / "catalog"
    export(source, directory)
    return directory


def test_the_archive_carries_the_series_and_each_model_s_step(archive: Path) -> None:
    manifest = json.loads((archive / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 4
    assert manifest["files"]["series.parquet"]["rows"] == 1
    (row,) = pq.read_table(archive / "series.parquet").to_pylist()
    assert (row["series"], row["architecture"]) == (SERIES, "gpt2")
    assert json.loads(row["stacks"]) == {"decoder": {"layers": 2, "heads": 2, "kv_heads": 2}}
    models = {r["model"]: r for r in pq.read_table(archive / "models.parquet").to_pylist()}
    assert {name: (r["series"], r["step"], r["revision"], r["requested_revision"]) for name, r in models.items()} == {
        f"{SERIES}-step-0": (SERIES, 0, None, None),
        f"{SERIES}-step-100": (SERIES, 100, None, None),
        f"{SERIES}-step-200": (SERIES, 200, COMMIT, "step200"),
    }
    entry = manifest["models"][f"{SERIES}-step-200"]
    assert (entry["series"], entry["step"], entry["requested_revision"]) == (SERIES, 200, "step200")


def test_a_series_round_trips_into_an_empty_catalog(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path
) -> None:
    engine = new_catalog()
    import_archive(engine, archive)
    assert series_rows(engine) == series_rows(source)
    assert step_rows(engine) == step_rows(source)
    assert view_rows(engine, "head_trajectories") == view_rows(source, "head_trajectories")
    with api(source) as theirs, api(engine) as ours:
        for path in ("/series", f"/series/{SERIES}"):
            here, there = ours.get(path), theirs.get(path)
            assert here.status_code == there.status_code == 200
            strip = ("feature_run", "detection_run", "clustering")  # the catalog's own ids
            if path == "/series":
                assert here.json() == there.json()
            else:
                mine = [{k: v for k, v in i.items() if k not in strip} for i in here.json()["items"]]
                assert mine == [{k: v for k, v in i.items() if k not in strip} for i in there.json()["items"]]
                assert [i["step"] for i in mine] == list(STEPS)


def test_a_series_joins_the_steps_a_catalog_already_has(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, checkpoints: Path
) -> None:
    engine = new_catalog()
    ingest_steps(engine, checkpoints, [0, 100])  # the same checkpoints, ingested here
    (before,) = series_rows(engine)
    result = import_archive(engine, archive)
    assert sorted(result["models"]) == [f"{SERIES}-step-{s}" for s in sorted(STEPS)]
    assert series_rows(engine) == [before]  # the catalog's own series, joined, not a second one
    assert step_rows(engine) == step_rows(source)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(DISTINCT series_id) FROM models")).scalar_one() == 1
    # imported again: nothing changes
    import_archive(engine, archive)
    assert step_rows(engine) == step_rows(source)


def test_a_step_held_by_another_model_here_is_refused(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path
) -> None:
    renamed = tmp_path / "renamed"
    shutil.copytree(archive, renamed)
    engine = new_catalog()
    import_archive(engine, archive)
    before = step_rows(engine)
    with pytest.raises(Conflict, match=rf"step 0 of series '{SERIES}' is model '{SERIES}-step-0' in the catalog, "
                                       r"not the archive's 'copy'"):  # fmt: skip
        importer_write(engine, renamed, {f"{SERIES}-step-0": "copy"})
    assert step_rows(engine) == before


def importer_write(engine: Engine, directory: Path, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """The import's writing step, in one transaction (rolled back when it raises)."""
    archive = importer.validate(directory, renames)
    with sessionmaker(bind=engine)() as session, session.begin():
        return importer.write(session, archive, str(directory), renames)


def _models_column(column: str, row: int, value: Any) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        values = table.column(column).to_pylist()
        values[row] = value
        index = table.schema.get_field_index(column)
        return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))

    return change


def _row_of(directory: Path, model: str) -> int:
    names = pq.read_table(directory / "models.parquet").column("model")
    return int(pc.index(names, model).as_py())


BAD: dict[str, tuple[str, Any, str]] = {
    "another architecture": (
        "architecture", "llama",
        rf"architecture of model '{SERIES}-step-100' \(step 100\) is 'llama', not its "
        rf"series '{SERIES}''s 'gpt2': every step of a series shares it",
    ),
    "other stacks": (
        "stacks", json.dumps({"decoder": {"layers": 3, "heads": 2, "kv_heads": 2}}),
        r"stacks of model .* is \{\"decoder\": \{\"heads\": 2, \"kv_heads\": 2, "
        r"\"layers\": 3\}\}, not its series",
    ),
    "a step without a series": (
        "series", None,
        rf"model '{SERIES}-step-100': series and step are both set or both null, not series None and step 100",
    ),
    "an unknown series": ("series", "nope", r"series 'nope' of model .* is not in series\.parquet"),
    "a step twice": ("step", 0, rf"step 0 of series '{SERIES}' is both '{SERIES}-step-0' and '{SERIES}-step-100'"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(BAD), ids=list(BAD))
def test_steps_that_disagree_with_their_series_are_refused_naming_the_field(
    archive: Path, tmp_path: Path, damage: str
) -> None:
    column, value, message = BAD[damage]
    broken = tmp_path / "broken"
    shutil.copytree(archive, broken)
    rewrite(broken, "models.parquet", _models_column(column, _row_of(broken, f"{SERIES}-step-100"), value))
    with pytest.raises(InvalidInput, match=rf"^catalog archive: models\.parquet row 2: {message}"):
        importer.validate(broken)


def test_a_series_here_with_another_tokenizer_is_refused(
    new_catalog: Callable[[], Engine], archive: Path, checkpoints: Path, tmp_path: Path
) -> None:
    engine = new_catalog()
    ingest_steps(engine, checkpoints, [0])
    other = tmp_path / "other"
    shutil.copytree(archive, other)
    rewrite(other, "series.parquet", _models_column("tokenizer_sha256", 0, "f" * 64))
    before = step_rows(engine)
    with pytest.raises(Conflict, match=rf"series\.parquet row 1: series '{SERIES}' is already in the catalog with "
                                       r"tokenizer_sha256 '[0-9a-f]{64}', the archive's has 'f{64}'"):  # fmt: skip
        importer_write(engine, other)
    assert step_rows(engine) == before


def test_an_archive_of_format_3_imports_its_models_without_a_series(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, tmp_path: Path
) -> None:
    old = tmp_path / "old"
    shutil.copytree(archive, old)
    as_format(old, 3)  # before format 4: no series file, no series columns
    engine = new_catalog()
    import_archive(engine, old)
    assert step_rows(engine) == [(name, None, None, source_, revision, None)
                                 for name, _, _, source_, revision, _ in step_rows(source)]  # fmt: skip
    assert series_rows(engine) == []


def test_a_part_of_the_archive_brings_its_steps_series_only(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path
) -> None:
    engine = new_catalog()
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    job = run_inline(sessions, "catalog_import", {"archive": str(archive), "models": [f"{SERIES}-step-200"]})
    assert job.status == "succeeded", job.error
    assert series_rows(engine) == series_rows(source)
    assert step_rows(engine) == [row for row in step_rows(source) if row[0] == f"{SERIES}-step-200"]
    with api(engine) as client:
        answer = client.get(f"/series/{SERIES}").json()
    assert (answer["steps"], answer["first_step"], answer["last_step"]) == (1, 200, 200)


def test_a_part_naming_every_step_brings_their_series(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path
) -> None:
    """``--model`` with every step of the series: the series comes along with them, as in the whole archive."""
    engine = new_catalog()
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    job = run_inline(
        sessions, "catalog_import", {"archive": str(archive), "models": [f"{SERIES}-step-{s}" for s in STEPS]}
    )
    assert job.status == "succeeded", job.error
    assert series_rows(engine) == series_rows(source)
    assert step_rows(engine) == step_rows(source)


def _renamed_series(name: str) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        rewrite(directory, "series.parquet", _models_column("series", 0, name))
        for row in range(len(STEPS)):
            rewrite(directory, "models.parquet", _models_column("series", row, name))

    return change


def test_a_series_name_and_a_step_hold_their_bounds(archive: Path, tmp_path: Path) -> None:
    """A series named with 1 or 200 characters, and a step of 2**31 - 1, are valid; an empty name, one of 201
    characters and a step of 2**31 are refused naming the field."""
    step = _row_of(archive, f"{SERIES}-step-100")
    cases: list[tuple[Callable[[Path], None], str | None]] = [
        (_renamed_series("g"), None),
        (_renamed_series("g" * 200), None),
        (lambda d: rewrite(d, "models.parquet", _models_column("step", step, 2**31 - 1)), None),
        (_renamed_series(""), r"series\.parquet row 1: series '' is not a name \(1 to 200 characters\)$"),
        (_renamed_series("g" * 201), rf"series\.parquet row 1: series '{'g' * 201}' is not a name \(1 to 200 "
                                     r"characters\)$"),
        (lambda d: rewrite(d, "models.parquet", _models_column("step", step, 2**31)),
         rf"models\.parquet row {step + 1}: step 2147483648 of model '{SERIES}-step-100' is not 0\.\.2147483647$"),
    ]  # fmt: skip
    for i, (change, message) in enumerate(cases):
        target = tmp_path / f"case-{i}"
        shutil.copytree(archive, target)
        change(target)
        if message is None:
            importer.validate(target)
            continue
        with pytest.raises(InvalidInput, match=rf"^catalog archive: {message}"):
            importer.validate(target)
