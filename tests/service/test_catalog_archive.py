"""Catalog archives (issue 26): export as Parquet, import into another catalog, refuse damaged archives.

A source catalog holds two models (a tiny BERT, and a tiny BART with encoder, decoder and cross
stacks) with every kind of run: feature runs, a joint clustering with its stability, an
attribution run, an importance run with a pruning curve, an ablation run with its baseline, a
syntax run. It is exported, imported into empty catalogs of their own (committed databases),
and compared: every ``GET /heads`` answer and every view row, and a second export of the copy
is byte-identical to the first.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service import current, db
from service.app import create_app
from service.catalogs import importer
from service.catalogs.export import MANIFEST, export_catalog, sha256_file
from service.catalogs.tables import TABLES
from service.errors import Conflict, InvalidInput
from service.jobs.runner import run_inline
from service.orm import (
    AblationBaseline,
    AblationOutcome,
    AblationRun,
    CatalogModel,
    Head,
    HeadSyntax,
    ImportanceRun,
    ImportanceScore,
    PruningCurve,
    PruningPoint,
    SyntaxBaseline,
    SyntaxRun,
)
from tests.conftest import grant_key
from tests.induction_model import INDUCTION_HEAD, save_induction_model
from tests.service.conftest import ingest_request
from tests.service.synthetic import dirichlet, store_attribution, store_model
from tests.waiting import PATIENCE, wait_until

VIEWS = (
    "head_types",
    "current_head_types",
    "head_importance",
    "head_attribution",
    "head_syntax",
    "syntax_best_heads",
    "head_detections",
)
# Tables whose rows an import writes: their counts show that a refused archive wrote nothing.
WRITTEN = (
    "models", "heads", "corpora", "feature_runs", "head_features", "clusterings", "clusters", "head_assignments",
    "clustering_feature_runs", "stability_runs", "stability_heads", "ablation_baselines", "ablation_runs",
    "ablation_outcomes", "importance_runs", "importance_scores", "pruning_curves", "pruning_points",
    "attribution_runs", "head_attributions", "syntax_runs", "syntax_baselines", "head_syntax_scores",
    "detection_runs", "head_detector_scores", "catalog_imports",
)  # fmt: skip


# --- catalogs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def new_catalog(database_url: str) -> Iterator[Callable[[], Engine]]:
    """Makes empty, migrated, committed catalog databases; all dropped at the end of the module."""
    admin = create_engine(make_url(database_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    made: list[tuple[str, Engine]] = []

    def make() -> Engine:
        name = f"headcat_catalog_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(database_url).set(database=name).render_as_string(hide_password=False)
        db.upgrade(url)
        engine = create_engine(url)
        made.append((name, engine))
        return engine

    yield make
    for name, engine in made:
        engine.dispose()
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def _head_ids(session: Session, model: str, stack: str = "encoder") -> dict[tuple[int, int], int]:
    model_id = session.query(CatalogModel.id).filter(CatalogModel.name == model).scalar()
    rows = session.query(Head.layer, Head.head, Head.id).filter(Head.model_id == model_id, Head.stack == stack)
    return {(layer, head): head_id for layer, head, head_id in rows}


def _other_runs(session: Session, model: str, clustering_id: int, seed: int) -> None:
    """An importance run with a pruning curve, an ablation run with its baseline, and a syntax run of ``model``."""
    rng = np.random.default_rng([seed, len(model)])  # values differ between models: no ties in the orders
    model_id = session.query(CatalogModel.id).filter(CatalogModel.name == model).scalar()
    ids = _head_ids(session, model)
    now = datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=UTC) + timedelta(seconds=seed)
    data = {"data_kind": "builtin", "data_source": "builtin:drift", "data_sha256": None, "data_subset": None,
            "data_size": 10, "limit": None, "n_examples": 10}  # fmt: skip
    run = {"device": "cpu", "dtype": "float32", "seconds": 1.25, "started_at": now, "finished_at": now}
    importance = ImportanceRun(model_id=model_id, status="complete", loss="lm", task=None, seed=seed,
                               mean_loss=2.5, config={"batch_size": 4}, **data, **run)  # fmt: skip
    session.add(importance)
    baseline = AblationBaseline(model_id=model_id, task="drift", data_key="builtin:drift", data_subset=None,
                                limit=None, max_length=64, dtype="float32", n_examples=10,
                                metrics={"drift": 0.0}, seconds=0.5, device="cpu")  # fmt: skip
    session.add(baseline)
    session.flush()
    raw = rng.random(len(ids))
    session.add_all(
        ImportanceScore(
            model_id=model_id,
            run_id=importance.id,
            head_id=head_id,
            raw=float(raw[i]),
            normalized=float(raw[i] / np.linalg.norm(raw)),
        )  # fmt: skip
        for i, head_id in enumerate(ids.values())
    )
    curve = PruningCurve(model_id=model_id, baseline_id=baseline.id, importance_run_id=importance.id,
                         clustering_id=clustering_id, status="complete", task="drift", metric="drift",
                         rankings=["importance", "random"], iterative=False, steps=2, max_share=0.5, seed=0,
                         type_order=[], orders={"importance": [[0, 1]], "random": [[1, 0]]},
                         baseline={"drift": 0.0}, config={}, **data, **run)  # fmt: skip
    ablation = AblationRun(model_id=model_id, clustering_id=clustering_id, baseline_id=baseline.id,
                           status="complete", task="drift", plan="custom", types={"a": 2}, config={"x": 1},
                           **data, **run)  # fmt: skip
    syntax = SyntaxRun(model_id=model_id, status="complete", stack="encoder", parses="gold", source="/x.conllu",
                       sha256="ab" * 32, parser=None, num_sentences=3, num_skipped=0, num_words=20,
                       config={"samples": 3}, **run)  # fmt: skip
    session.add_all([curve, ablation, syntax])
    session.flush()
    for complete in (importance, syntax):  # as their jobs would make them served (service/current.py)
        current.completed(session, complete)
    session.add_all(
        PruningPoint(
            curve_id=curve.id,
            ranking=ranking,
            step=step,
            pruned=step,
            share=step / 8,
            metrics={"drift": 0.1 * step},
            heads=[[0, 1]][:step],
            seconds=0.1,
        )  # fmt: skip
        for ranking in ("importance", "random")
        for step in range(2)
    )
    session.add(AblationOutcome(run_id=ablation.id, position=0, row_id="r0", label="row", paper_ref=None,
                                operations=["mask"], selection={"mask": "type a"}, spec={"mask": [[0, 1]]},
                                types=["a"], type_ops={"a": {"mask": 1}}, heads=1, metrics={"drift": 0.2},
                                baseline={"drift": 0.0}, n_examples=10, seconds=0.2))  # fmt: skip
    session.add_all(SyntaxBaseline(syntax_run_id=syntax.id, relation=r, count=5, offset=1, accuracy=0.4)
                    for r in ("nsubj", "obj"))  # fmt: skip
    session.add_all(
        HeadSyntax(
            model_id=model_id,
            syntax_run_id=syntax.id,
            head_id=head_id,
            relation=r,
            direction=d,
            correct=int(c),
            count=5,
            accuracy=c / 5,
        )  # fmt: skip
        for head_id in ids.values()
        for r in ("nsubj", "obj")
        for d, c in (("dep2head", rng.integers(0, 6)), ("head2dep", rng.integers(0, 6)))
    )
    session.flush()


def build_catalog(engine: Engine, models: dict[str, Path], seed: int) -> None:
    """Feature runs of ``models`` (name -> directory), a joint clustering with stability, and every other run."""
    sessions = _sessions(engine)
    rng = np.random.default_rng(seed)
    with sessions() as session, session.begin():
        for name, path in models.items():
            stacks = json.loads((path / "config.json").read_text()).get("model_type") == "bart"
            shapes = {"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)} if stacks else {"encoder": (2, 4)}
            store_model(session, path, name, {s: dirichlet(rng, *shape) for s, shape in shapes.items()})
    clustering = run_inline(sessions, "clustering", {"models": sorted(models), "k": 3, "seed": seed})
    assert clustering.status == "succeeded", clustering.error
    clustering_id = int(clustering.result["clustering_id"])  # type: ignore[index]
    for stability_seed in (0, 1):  # the first run's agreements are then nulled: a run stored before 0012
        stability = run_inline(sessions, "stability",
                               {"clustering_id": clustering_id, "n_runs": 3, "seed": stability_seed})  # fmt: skip
        assert stability.status == "succeeded", stability.error
    with sessions() as session, session.begin():
        session.execute(
            text(
                "UPDATE stability_heads SET agreement = NULL WHERE stability_run_id = "
                "(SELECT min(id) FROM stability_runs WHERE clustering_id = :c)"
            ),
            {"c": clustering_id},
        )
        for name in models:
            store_attribution(session, name, dirichlet(rng, 2, 4))
            _other_runs(session, name, clustering_id, seed)
    # SPEC 10's detectors on the models themselves (bart: encoder, decoder and cross); random weights attend
    # about evenly (1/13 of a map per cell), so thresholds near that give some heads roles and others none
    thresholds = dict.fromkeys(("induction", "duplicate_token", "previous_token", "sink"), 0.08)
    for name in models:
        request = {"model": name, "sequences": 3, "length": 6, "copies": 2, "seed": seed, "device": "cpu"}
        detection = run_inline(sessions, "detection", {**request, "thresholds": thresholds})
        assert detection.status == "succeeded", detection.error


@pytest.fixture(scope="module")
def source(new_catalog: Callable[[], Engine], tiny_bert_path: Path, bart_path: Path) -> Engine:
    engine = new_catalog()
    build_catalog(engine, {"tiny-a": tiny_bert_path, "bart": bart_path}, seed=1)
    return engine


def export(engine: Engine, directory: Path, models: list[str] | None = None) -> dict[str, Any]:
    with engine.connect() as connection, connection.begin():
        return export_catalog(connection, directory, models)


def import_archive(engine: Engine, directory: Path | str, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """The CLI's path: a ``catalog_import`` job run in this process."""
    job = run_inline(_sessions(engine), "catalog_import", {"archive": str(directory), "renames": renames or {}})
    assert job.result is not None
    return job.result


@pytest.fixture(scope="module")
def archive(source: Engine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("archive") / "catalog"
    export(source, directory)
    return directory


@pytest.fixture(scope="module")
def copy(new_catalog: Callable[[], Engine], archive: Path) -> Engine:
    engine = new_catalog()
    import_archive(engine, archive)
    return engine


@contextmanager
def api(engine: Engine) -> Iterator[TestClient]:
    key = grant_key(_sessions(engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


def view_rows(engine: Engine, view: str) -> list[tuple[Any, ...]]:
    """Every row of ``view`` without its internal ids (which differ between catalogs), sorted."""
    with engine.connect() as connection:
        columns = [c for c in connection.execute(text(f"SELECT * FROM {view} LIMIT 0")).keys() if not c.endswith("_id")]
        listed = ", ".join(f'"{c}"' for c in columns)
        return sorted(map(tuple, connection.execute(text(f"SELECT {listed} FROM {view}"))), key=repr)


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as connection:
        return {t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in WRITTEN}


def _without_ids(value: Any) -> Any:
    """An answer with the catalog's own ids (clustering, runs, heads) left out (``current_runs``: which lenses
    serve a run)."""
    if isinstance(value, dict):
        return {k: {lens: i is not None for lens, i in v.items()} if k == "current_runs" else _without_ids(v)
                for k, v in value.items() if not (k == "id" or k.endswith("_id") or k == "next")}  # fmt: skip
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


HEAD_QUERIES: list[dict[str, Any]] = [
    {"limit": 1000},
    {"model": "bart", "limit": 1000},
    {"model": "tiny-a", "stack": "encoder", "layer_ge": 1, "limit": 1000},
    {"stack": "cross", "limit": 1000},
    {"order": "importance", "limit": 1000},
    {"discrepancy_gt": 0.1, "limit": 1000},
    {"relation": "nsubj", "limit": 1000},
    {"model": "tiny-a", "importance_gt": 0.2, "limit": 1000},
    {"order": "-sink", "limit": 1000},
    {"order": "previous_token", "stack": "cross", "limit": 1000},
    {"margin_ge": 0.0, "limit": 1000},
    {"agreement_ge": 0.0, "model": "bart", "limit": 1000},
]


# --- round trip --------------------------------------------------------------------------------------


def test_round_trip_answers_every_head_query_and_view_row_alike(source: Engine, copy: Engine) -> None:
    for view in VIEWS:
        rows = view_rows(source, view)
        assert rows, view  # every view has rows: the catalog holds every kind of run
        assert view_rows(copy, view) == rows, view
    with copy.connect() as connection:  # what the views do not show: the older stability run's null agreements
        agreements = connection.execute(text(
            "SELECT r.id, count(*) FILTER (WHERE h.agreement IS NULL), count(h.agreement) FROM stability_runs r "
            "JOIN stability_heads h ON h.stability_run_id = r.id GROUP BY r.id ORDER BY r.id")).all()  # fmt: skip
    assert [(nulls, values) for _, nulls, values in agreements] == [(32, 0), (0, 32)]
    with api(source) as a, api(copy) as b:
        every = a.get("/heads", params={"limit": 1000}).json()["items"]
        types = {h["type"] for h in every}
        roles = sorted({role for h in every for role in h["roles"] or []})
        assert roles  # the detectors gave some head a role
        assert all(h["margin"] is not None and h["agreement"] is not None and h["sink"] is not None for h in every)
        queries = [*HEAD_QUERIES, *({"type": t, "limit": 1000} for t in sorted(types)),
                   *({"role": r, "limit": 1000} for r in roles)]  # fmt: skip
        for params in queries:
            want, got = a.get("/heads", params=params), b.get("/heads", params=params)
            assert want.status_code == 200, (params, want.text)
            assert want.json()["items"], params
            assert _without_ids(got.json()) == _without_ids(want.json()), params
        for name in ("tiny-a", "bart"):
            want, got = a.get(f"/models/{name}").json(), b.get(f"/models/{name}").json()
            assert want["imported"] is None
            assert got["imported"]["origin"].endswith("catalog")
            assert _without_ids({**got, "imported": None}) == _without_ids(want)


def test_a_second_export_of_the_copy_is_the_same_files(copy: Engine, archive: Path, tmp_path: Path) -> None:
    """Byte for byte: every column, run key and row order survived the import."""
    again = export(copy, tmp_path / "again")
    first = json.loads((archive / MANIFEST).read_text())
    for name, entry in first["files"].items():
        assert again["files"][name]["sha256"] == entry["sha256"], name
    assert again["models"] == first["models"]


def test_importing_the_same_archive_twice_changes_nothing(copy: Engine, archive: Path) -> None:
    before = counts(copy)
    result = import_archive(copy, archive)
    assert result["already"] is True
    assert counts(copy) == before


def test_two_imports_of_one_archive_at_once_write_it_once(new_catalog: Callable[[], Engine], archive: Path) -> None:
    """A second import that starts while the first is still writing waits for it, then finds the archive imported:
    one copy of every row and an ``already`` answer, not a unique-key error from the database."""
    import threading

    engine = new_catalog()
    checked = importer.validate(archive)
    answers: dict[str, Any] = {}

    def second() -> None:
        try:
            with _sessions(engine)() as session, session.begin():
                answers["second"] = importer.write(session, checked, "second")
        except Exception as error:  # noqa: BLE001 - the test's answer, asserted below
            answers["second"] = error

    def second_waits() -> bool:
        with engine.connect() as connection:
            return bool(connection.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )))  # fmt: skip

    with _sessions(engine)() as session, session.begin():
        answers["first"] = importer.write(session, checked, "first")
        thread = threading.Thread(target=second)
        thread.start()
        wait_until(lambda: second_waits() or not thread.is_alive(), "the second import waiting for the first")
    thread.join(PATIENCE)
    assert answers["first"]["already"] is False
    assert not isinstance(answers["second"], Exception), answers["second"]
    assert answers["second"]["already"] is True
    assert answers["second"]["import_id"] == answers["first"]["import_id"]
    once = new_catalog()
    import_archive(once, archive)
    assert counts(engine) == counts(once)


def test_runs_keep_their_configuration_and_the_manifest_lists_them(archive: Path, copy: Engine) -> None:
    manifest = json.loads((archive / MANIFEST).read_text())
    assert manifest["format_version"] == 4
    assert set(manifest["files"]) == {t.file for t in TABLES}
    tiny = manifest["models"]["tiny-a"]
    assert tiny["origin"] == "local"
    assert tiny["revision"] is None
    assert [r["config"]["num_windows"] for r in tiny["runs"]["feature_runs"]] == [16]
    assert manifest["files"]["head_features.parquet"]["rows"] == 8 + 24
    for name, entry in manifest["files"].items():
        assert pq.ParquetFile(archive / name).metadata.num_rows == entry["rows"]
        assert sha256_file(archive / name) == entry["sha256"]
    with copy.connect() as connection:
        params = connection.execute(text("SELECT params FROM clusterings")).scalar_one()
    assert params == json.loads(pq.read_table(archive / "clusterings.parquet").column("params")[0].as_py())


def test_catalogs_with_different_models_merge_into_one(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, tiny_bert_path: Path, tmp_path: Path
) -> None:
    other = new_catalog()
    build_catalog(other, {"tiny-b": tiny_bert_path}, seed=2)
    other_archive = tmp_path / "other"
    export(other, other_archive)
    merged = new_catalog()
    import_archive(merged, archive)
    import_archive(merged, other_archive)
    for view in VIEWS:
        assert view_rows(merged, view) == sorted(view_rows(source, view) + view_rows(other, view), key=repr), view
    with api(merged) as m, api(source) as a, api(other) as b:
        everything = m.get("/heads", params={"limit": 1000}).json()["items"]
        assert {h["model"] for h in everything} == {"tiny-a", "bart", "tiny-b"}
        for client, names in ((a, ["tiny-a", "bart"]), (b, ["tiny-b"])):
            for name in names:
                params: dict[str, Any] = {"model": name, "limit": 1000}
                assert _without_ids(m.get("/heads", params=params).json()["items"]) == _without_ids(
                    client.get("/heads", params=params).json()["items"]
                )
        listed = {x["name"]: x["imported"] for x in m.get("/models").json()}
        assert listed["tiny-b"]["origin"] == str(other_archive.resolve())
        assert listed["bart"]["archive_sha256"] == sha256_file(archive / MANIFEST)
    # a joint clustering across the imported models of both archives
    job = run_inline(_sessions(merged), "clustering", {"models": ["tiny-a", "bart", "tiny-b"], "k": 4, "seed": 0})
    assert job.status == "succeeded", job.error
    with merged.connect() as connection:
        clustered = connection.execute(
            text("SELECT model, count(*) FROM head_types WHERE clustering_id = :c GROUP BY model ORDER BY model"),
            {"c": job.result["clustering_id"]},  # type: ignore[index]
        ).all()
    assert clustered == [("bart", 24), ("tiny-a", 8), ("tiny-b", 8)]


def test_a_model_from_another_source_is_refused_unless_renamed(
    new_catalog: Callable[[], Engine], archive: Path, minilm_path: Path, tmp_path: Path
) -> None:
    engine = new_catalog()
    with _sessions(engine)() as session, session.begin():
        store_model(session, minilm_path, "tiny-a", {"encoder": dirichlet(np.random.default_rng(0), 6, 12)})
    before = counts(engine)
    with pytest.raises(Conflict, match=r"models.parquet row \d+: a model named 'tiny-a' is already.*--rename tiny-a="):
        import_archive(engine, archive)
    assert counts(engine) == before
    result = import_archive(engine, archive, {"tiny-a": "tiny-a-lab2"})
    assert sorted(result["models"]) == ["bart", "tiny-a-lab2"]
    with api(engine) as client:
        heads = client.get("/heads", params={"model": "tiny-a-lab2", "limit": 100}).json()["items"]
        assert len(heads) == 8
        assert all(h["type"] is not None for h in heads)
        assert client.get("/models/tiny-a-lab2").json()["imported"]["renames"] == {"tiny-a": "tiny-a-lab2"}


def test_a_renamed_copy_cannot_join_a_clustering_fitted_without_it(copy: Engine, archive: Path) -> None:
    """The archive again, into the catalog that holds it already, with a model renamed: the archive's clusterings
    are the ones there (same keys), fitted without the renamed copy, whose heads would change their sizes,
    shares and stability. Refused naming the file and row; nothing written."""
    before = counts(copy)
    with pytest.raises(InvalidInput, match=r"clusterings.parquet row \d+: this clustering is already in the catalog "
                                           r"over other models"):  # fmt: skip
        import_archive(copy, archive, {"tiny-a": "tiny-a-again"})
    assert counts(copy) == before
    with _sessions(copy)() as session:
        assert session.scalar(text("SELECT count(*) FROM models WHERE name = 'tiny-a-again'")) == 0


# --- damaged and hostile archives ------------------------------------------------------------------


def rewrite(directory: Path, name: str, change: Callable[[pa.Table], pa.Table]) -> None:
    """Change a file's table and write it back with the manifest made to agree (checksum, rows)."""
    path = directory / name
    table = change(pq.read_table(path))
    pq.write_table(table, path)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name].update(sha256=sha256_file(path), rows=table.num_rows)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def set_value(column: str, row: int, value: Any) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        values = table.column(column).to_pylist()
        values[row] = value
        index = table.schema.get_field_index(column)
        return table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))

    return change


def flip_byte(directory: Path) -> None:
    path = directory / "head_features.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def scale_features(directory: Path) -> None:
    def change(table: pa.Table) -> pa.Table:
        vector = [v * 0.9 for v in table.column("vector")[3].as_py()]
        for i, name in enumerate([f"w{i}" for i in range(16)] + ["self", "cls", "sep", "period", "comma"]):
            table = set_value(name, 3, vector[i])(table)
        return set_value("vector", 3, vector)(table)

    rewrite(directory, "head_features.parquet", change)


def negative_attribution(directory: Path) -> None:
    def change(table: pa.Table) -> pa.Table:
        vector = table.column("global_vector")[6].as_py()
        vector[0], vector[1] = vector[0] - 0.5, vector[1] + 0.5  # still sums to 1
        return set_value("global_vector", 6, vector)(table)

    rewrite(directory, "head_attribution.parquet", change)


def current_of_another_model(directory: Path) -> None:
    """The first model's current feature run named by the key of another model's run."""
    first = pq.read_table(directory / "models.parquet").column("model")[0].as_py()
    runs = pq.read_table(directory / "feature_runs.parquet").to_pylist()
    other = next(r["feature_run"] for r in runs if r["model"] != first)
    rewrite(directory, "models.parquet", set_value("current_feature_run", 0, other))


def newer_format(directory: Path) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format_version": 5}))


BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte": (flip_byte, r"head_features\.parquet: checksum mismatch"),
    # The checksums are taken beside the checks: a damaged file is named as damaged even where a check of an
    # earlier file would refuse the archive first.
    "flipped byte besides a fault of an earlier file": (
        lambda d: (rewrite(d, "models.parquet", set_value("current_syntax_run", 0, "e" * 32)), flip_byte(d)),
        r"head_features\.parquet: checksum mismatch",
    ),
    "missing file": (lambda d: (d / "clusters.parquet").unlink(), r"clusters\.parquet: missing from the archive"),
    "features not summing to 1": (scale_features, r"head_features\.parquet row 4: features sum to 0\.9, not 1$"),
    "head outside the shape": (
        lambda d: rewrite(d, "head_importance.parquet", set_value("layer", 2, 7)),
        r"head_importance\.parquet row 3: encoder layer 7 head \d is outside model '[a-z-]+' \(2 layers x 4 heads\)",
    ),
    "negative attribution": (
        negative_attribution,
        r"head_attribution\.parquet row 7: global_vector hold a negative value \(-0\.4\d*\)",
    ),
    "newer format": (newer_format, r"manifest\.json: format version 5 is newer than this headcat reads \(4\)"),
    "detection score above 1": (
        lambda d: rewrite(d, "head_detections.parquet", set_value("sink", 4, 1.5)),
        r"head_detections\.parquet row 5: sink 1\.5 is outside \[0, 1\]$",
    ),
    "negative detection score": (
        lambda d: rewrite(d, "head_detections.parquet", set_value("previous_token", 9, -0.25)),
        r"head_detections\.parquet row 10: previous_token -0\.25 is outside \[0, 1\]$",
    ),
    "agreement above 1": (
        lambda d: rewrite(d, "stability_heads.parquet", set_value("agreement", 40, 1.25)),
        r"stability_heads\.parquet row 41: agreement 1\.25 is outside \[0, 1\]$",
    ),
    "margin below -1": (
        lambda d: rewrite(d, "head_types.parquet", set_value("margin", 2, -1.5)),
        r"head_types\.parquet row 3: margin -1\.5 is outside \[-1, 1\]$",
    ),
    "detection head outside the shape": (
        lambda d: rewrite(d, "head_detections.parquet", set_value("head", 1, 4)),
        r"head_detections\.parquet row 2: \w+ layer \d head 4 is outside model '[a-z-]+' \(2 layers x 4 heads\)",
    ),
    "unresolvable detection run": (
        lambda d: rewrite(d, "head_detections.parquet", set_value("detection_run", 3, "f" * 32)),
        r"head_detections\.parquet row 4: detection_run 'f{32}' is not in detection_runs\.parquet",
    ),
    "roles not those of the scores": (
        lambda d: rewrite(d, "head_detections.parquet", set_value("roles", 0, ["induction", "sink"])),
        r"head_detections\.parquet row 1: roles \['induction', 'sink'\] are not those its scores reach",
    ),
    "detection run with fewer ids": (
        lambda d: rewrite(d, "detection_runs.parquet", set_value("num_tokens", 0, 13)),
        r"detection_runs\.parquet row 1: sequences\.sequences is not 3 lists of 13 token ids",
    ),
    "column missing": (
        lambda d: rewrite(d, "head_features.parquet", lambda t: t.drop_columns(["entropy"])),
        r"head_features\.parquet: column 'entropy' is missing",
    ),
    "unresolvable run": (
        lambda d: rewrite(d, "head_syntax.parquet", set_value("syntax_run", 5, "0" * 32)),
        r"head_syntax\.parquet row 6: syntax_run '0{32}' is not in syntax_runs\.parquet",
    ),
    "unresolvable current run": (
        lambda d: rewrite(d, "models.parquet", set_value("current_syntax_run", 0, "e" * 32)),
        r"models\.parquet row 1: current_syntax_run 'e{32}' is not in syntax_runs\.parquet$",
    ),
    "current run of another model": (
        current_of_another_model,
        r"models\.parquet row 1: current_feature_run '[0-9a-f]{32}' is not in feature_runs\.parquet$",
    ),
    "unresolvable current stability run": (
        lambda d: rewrite(d, "clusterings.parquet", set_value("current_stability_run", 0, "d" * 32)),
        r"clusterings\.parquet row 1: current_stability_run 'd{32}' is not in stability_runs\.parquet$",
    ),
    "run changed after export": (
        lambda d: rewrite(d, "importance_runs.parquet", set_value("seed", 0, 99)),
        r"importance_runs\.parquet row 1: the importance_run key does not match the run's columns",
    ),
    "invalid JSON": (
        lambda d: rewrite(d, "ablation_runs.parquet", set_value("config", 1, "{not json")),
        r"ablation_runs\.parquet row 2: column 'config' is not JSON",
    ),
}


@pytest.mark.parametrize("damage", list(BAD), ids=list(BAD))
def test_a_damaged_archive_is_refused_and_nothing_is_written(
    damage: str, damage_target: Engine, archive: Path, tmp_path: Path
) -> None:
    engine = damage_target
    broken = tmp_path / "broken"
    shutil.copytree(archive, broken)
    change, message = BAD[damage]
    change(broken)
    before = counts(engine)
    with pytest.raises(InvalidInput, match=message) as raised:
        import_archive(engine, broken)
    assert "\n" not in raised.value.message
    assert counts(engine) == before
    with engine.connect() as connection:
        job = connection.execute(text("SELECT status, error FROM jobs ORDER BY id DESC LIMIT 1")).one()
    assert job.status == "failed"
    assert job.error == raised.value.message


def test_a_causal_lm_s_detection_run_and_its_causal_check_round_trip(
    new_catalog: Callable[[], Engine], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The hand-set induction model (a causal LM): its repeat gain, its causal check (the induction head
    pruned) and its maps are the source's after the import; a check naming a head the model lacks (a layer or a
    head index one past its last) is refused."""
    source, copy = new_catalog(), new_catalog()
    path = save_induction_model(tmp_path_factory.mktemp("induction-model"))
    sessions = _sessions(source)
    ingest = run_inline(sessions, "ingest", ingest_request(path, "induct", samples=8, max_length=32))
    assert ingest.status == "succeeded", ingest.error
    request = {"model": "induct", "sequences": 4, "length": 8, "copies": 2, "seed": 3, "device": "cpu",
               "corpus_samples": 4}  # fmt: skip
    detection = run_inline(sessions, "detection", request)
    assert detection.status == "succeeded", detection.error
    export(source, tmp_path / "induct")
    import_archive(copy, tmp_path / "induct")
    assert view_rows(copy, "head_detections") == view_rows(source, "head_detections")
    with api(source) as a, api(copy) as b:
        want = a.get("/models/induct/detections").json()
        (check,) = want["runs"][0]["checks"]
        assert check["heads"] == [["decoder", *INDUCTION_HEAD]]
        assert want["runs"][0]["repeat_gain"] > 1.0
        assert _without_ids(b.get("/models/induct/detections").json()) == _without_ids(want)
        example: dict[str, Any] = {"stack": "decoder", "layer": 1, "head": 0}
        assert _without_ids(b.get("/models/induct/detections/example", params=example).json()) == _without_ids(
            a.get("/models/induct/detections/example", params=example).json()
        )
        heads: dict[str, Any] = {"model": "induct", "role": "induction", "limit": 100}
        assert [h["layer"] for h in a.get("/heads", params=heads).json()["items"]] == [INDUCTION_HEAD[0]]
        assert _without_ids(b.get("/heads", params=heads).json()) == _without_ids(a.get("/heads", params=heads).json())

    def checked(head: list[Any]) -> Callable[[pa.Table], pa.Table]:
        def change(table: pa.Table) -> pa.Table:
            checks = json.loads(table.column("checks")[0].as_py())
            checks[0]["heads"] = [head]
            return set_value("checks", 0, json.dumps(checks))(table)

        return change

    target = new_catalog()
    before = counts(target)
    for case, (head, message) in enumerate((
        (["decoder", 2, 0], r"checks: the induction head \['decoder', 2, 0\] is not a head of model 'induct'$"),
        (["decoder", 0, 2], r"checks: the induction head \['decoder', 0, 2\] is not a head of model 'induct'$"),
        (["decoder", 0, 1], r"checks: the induction heads are not those head_detections\.parquet gives the role"),
    )):  # fmt: skip
        damaged = tmp_path / f"damaged-{case}"
        shutil.copytree(tmp_path / "induct", damaged)
        rewrite(damaged, "detection_runs.parquet", checked(head))
        with pytest.raises(InvalidInput, match=rf"detection_runs\.parquet row 1: {message}"):
            import_archive(target, damaged)
        assert counts(target) == before


def as_format(directory: Path, version: int) -> None:
    """The archive as headcat wrote it in format ``version``: the files and columns of later formats removed, the
    manifest's checksums and format number made to match."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for table in TABLES:
        if table.since > version:
            (directory / table.file).unlink()
            del manifest["files"][table.file]
            continue
        later = [c.name for c in table.columns if c.since > version]
        if later:
            pq.write_table(pq.read_table(directory / table.file).drop_columns(later), directory / table.file)
            manifest["files"][table.file]["sha256"] = sha256_file(directory / table.file)
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format_version": version}))


def as_format_1(directory: Path) -> None:
    """The archive as headcat wrote it before format 2: no margin, agreement or detection files (nor the later
    formats' columns)."""
    assert {"margin", "agreement", "current_feature_run"} <= {c.name for t in TABLES for c in t.columns if c.since > 1}
    as_format(directory, 1)


def test_an_archive_of_format_1_still_imports(
    new_catalog: Callable[[], Engine], source: Engine, archive: Path, tmp_path: Path
) -> None:
    old = tmp_path / "old"
    shutil.copytree(archive, old)
    as_format_1(old)
    engine = new_catalog()
    result = import_archive(engine, old)
    assert sorted(result["models"]) == ["bart", "tiny-a"]

    def count(e: Engine, where: str) -> int:
        with e.connect() as connection:
            return int(connection.execute(text(f"SELECT count(*) FROM {where}")).scalar_one())

    assert count(engine, "head_assignments WHERE margin IS NOT NULL") == 0
    assert count(engine, "stability_heads WHERE agreement IS NOT NULL") == 0
    assert count(engine, "detection_runs") == 0
    assert count(source, "head_assignments WHERE margin IS NOT NULL") == 32
    strip = {"margin", "agreement"}  # the rest of head_types is the source's
    for view in ("head_types", "head_importance", "head_syntax"):

        def rows(e: Engine, view: str = view) -> list[dict[str, Any]]:
            with e.connect() as connection:
                result = connection.execute(text(f"SELECT * FROM {view}")).mappings().all()
            return sorted(({k: v for k, v in r.items() if not k.endswith("_id") and k not in strip} for r in result),
                          key=repr)  # fmt: skip

        assert rows(engine) == rows(source), view
    # a format 1 archive lacking a column that format 1 had is still refused
    rewrite(old, "head_types.parquet", lambda t: t.drop_columns(["tsne_x"]))
    with pytest.raises(InvalidInput, match=r"head_types\.parquet: column 'tsne_x' is missing"):
        importer.validate(old)


@pytest.fixture(scope="module")
def damage_target(new_catalog: Callable[[], Engine]) -> Engine:
    """One catalog for all the damaged archives (nothing is ever written to it).

    A fixture of the module's scope, not a module-level cache: a cache outlives the test session that filled
    it, and ``new_catalog`` drops the database at the end of that session, so a second session in the same
    process (mutmut's stats run, then its clean run, then its forked mutant runs) found the name of a
    dropped database."""
    return new_catalog()


def test_an_archive_with_a_renamed_model_not_in_it_is_refused(archive: Path) -> None:
    with pytest.raises(InvalidInput, match="rename: the archive has no model 'nope'"):
        importer.validate(archive, {"nope": "x"})


# --- REST, CLI and the hub ----------------------------------------------------------------------------


def test_rest_export_streams_the_archive_as_a_tar(source: Engine, tmp_path: Path) -> None:
    import io
    import tarfile

    with api(source) as client:
        answer = client.get("/catalog/export", params={"model": "bart"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(answer.content)) as tar:
            tar.extractall(tmp_path, filter="data")
        unknown = client.get("/catalog/export", params={"model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["field"] == "model"
    checked = importer.validate(tmp_path / "catalog")
    assert checked.models == ["bart"]
    assert {row["model"] for row in checked.small["feature_runs"]} == {"bart"}
    assert checked.small["clusterings"] == []  # the joint clustering spans tiny-a, which is not exported


def test_rest_import_is_a_cpu_job_that_checks_the_archive_first(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path
) -> None:
    from service.jobs.runner import execute

    engine = new_catalog()
    with api(engine) as client:
        answer = client.post("/catalog/imports", json={"archive": str(archive)})
        assert answer.status_code == 202, answer.text
        job = client.get(f"/jobs/{answer.json()['job_id']}").json()
        assert (job["kind"], job["queue"], job["status"]) == ("catalog_import", "cpu", "queued")
        assert execute(_sessions(engine), job["id"]) == "succeeded"
        assert sorted(m["name"] for m in client.get("/models").json()) == ["bart", "tiny-a"]
        broken = tmp_path / "broken"
        shutil.copytree(archive, broken)
        newer_format(broken)
        refused = client.post("/catalog/imports", json={"archive": str(broken)})
        assert refused.status_code == 422
        assert refused.json()["detail"].startswith("catalog archive: manifest.json: format version 5 is newer")
        outside = client.post("/catalog/imports", json={"archive": "/etc"})
        assert outside.status_code == 422
        assert outside.json()["field"] == "archive"


def test_cli_exports_and_imports(source: Engine, new_catalog: Callable[[], Engine], tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    target = new_catalog()

    def headcat(engine: Engine, *args: str) -> subprocess.CompletedProcess[str]:
        url = engine.url.render_as_string(hide_password=False)
        env = {**os.environ, "DATABASE_URL": url, "COLUMNS": "200", "PYTHONPATH": str(root)}
        return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=PATIENCE)  # fmt: skip

    exported = headcat(source, "catalog", "export", "--model", "tiny-a", "-o", str(tmp_path / "a"))
    assert exported.returncode == 0, exported.stderr
    imported = headcat(target, "catalog", "import", str(tmp_path / "a"), "--rename", "tiny-a=lab2-tiny")
    assert imported.returncode == 0, imported.stderr
    # tiny-a alone: the source's joint clustering spans bart, so it is not exported; the rest is
    assert view_rows(target, "current_head_types") == []
    assert view_rows(target, "head_importance") == [
        ("lab2-tiny", *row[1:]) for row in view_rows(source, "head_importance") if row[0] == "tiny-a"
    ]
    with target.connect() as connection:
        assert connection.execute(text("SELECT name FROM models")).scalars().all() == ["lab2-tiny"]
    (tmp_path / "a" / "head_features.parquet").write_bytes(b"PAR1 not parquet")
    refused = headcat(target, "catalog", "import", str(tmp_path / "a"), "--rename", "tiny-a=other")
    assert refused.returncode == 2
    assert "head_features.parquet: checksum mismatch" in " ".join(refused.stderr.split())
    assert refused.stderr.count("checksum mismatch") == 1, refused.stderr  # said once: no WARNING line besides


def test_cli_imports_the_tar_the_rest_export_sends_and_refuses_what_is_not_an_archive_first(
    source: Engine, new_catalog: Callable[[], Engine], tmp_path: Path
) -> None:
    """`curl .../catalog/export?model=tiny-a -o cat.tar; headcat catalog import cat.tar`; a missing path or a file
    that is no archive is one line and exit 2 before any job row."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    target = new_catalog()
    with api(source) as client:
        answer = client.get("/catalog/export", params={"model": "tiny-a"})
        assert answer.status_code == 200, answer.text
    (tmp_path / "cat.tar").write_bytes(answer.content)
    (tmp_path / "notes.txt").write_text("not an archive\n")
    url = target.url.render_as_string(hide_password=False)
    env = {**os.environ, "DATABASE_URL": url, "PYTHONPATH": str(root)}

    def headcat(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service.cli", "catalog", "import", *args], cwd=root, env=env,
                              capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip

    def jobs() -> int:
        with target.connect() as connection:
            return int(connection.execute(text("SELECT count(*) FROM jobs")).scalar_one())

    missing = headcat(str(tmp_path / "missing.tar"))
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip() == f"error: catalog archive: {tmp_path / 'missing.tar'}: does not exist"
    other = headcat(str(tmp_path / "notes.txt"))
    assert other.returncode == 2, other.stderr
    assert "is neither an archive directory nor a tar archive" in other.stderr
    assert jobs() == 0
    imported = headcat(str(tmp_path / "cat.tar"))
    assert imported.returncode == 0, imported.stderr
    with target.connect() as connection:
        assert connection.execute(text("SELECT name FROM models")).scalars().all() == ["tiny-a"]
    assert view_rows(target, "head_importance") == [
        row for row in view_rows(source, "head_importance") if row[0] == "tiny-a"
    ]


def test_a_rest_import_source_is_never_answered_with_corpus_names(tmp_path: Path) -> None:
    from service.settings import Settings
    from service.sources import data_file

    with pytest.raises(InvalidInput) as refused:
        data_file("builtin:wiki", Settings(data_roots=[]), "archive", corpus=False)
    assert "builtin" not in refused.value.message.split(";", 1)[1]
    assert refused.value.message.endswith("use hub:OWNER/NAME[@REVISION]")
    with pytest.raises(InvalidInput, match="outside the data directories"):
        data_file("builtin:wiki", Settings(data_roots=[tmp_path / "roots"]), "archive", corpus=False)
    assert data_file("builtin:wiki", Settings(data_roots=[]), "corpus") == "builtin:wiki"  # a corpus still is one


def test_hub_archives_are_loaded_through_snapshot_download(
    new_catalog: Callable[[], Engine], archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hub:OWNER/NAME@REVISION``: the data set's snapshot, here a local copy in a hub-cache-like directory."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "datasets--lab--heads" / "snapshots" / commit
    shutil.copytree(archive, snapshot)
    calls: list[dict[str, Any]] = []

    def snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    engine = new_catalog()
    result = import_archive(engine, "hub:lab/heads@main")
    assert calls == [{"repo_id": "lab/heads", "repo_type": "dataset", "revision": "main"}]
    assert sorted(result["models"]) == ["bart", "tiny-a"]
    with api(engine) as client:
        assert client.get("/models/bart").json()["imported"]["origin"] == f"hub:lab/heads@{commit}"


# --- the documentation's queries, without headcat ----------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "usage" / "catalogs.md"


def documented(language: str, marker: str) -> str:
    """The ```LANGUAGE block of the docs that holds ``marker``; for ``sql``, the DuckDB query (the triple-quoted
    string) of the ```python block that holds it."""
    import re

    fence = "python" if language == "sql" else language
    for block in re.findall(rf"```{fence}\n(.*?)```", DOCS.read_text(), flags=re.DOTALL):
        if marker in block:
            if language == "sql":
                query = re.search(r'"""(.*?)"""', block, flags=re.DOTALL)
                assert query, f"no triple-quoted query in the block with {marker!r} in {DOCS}"
                return query.group(1)
            return block
    raise AssertionError(f"no ```{fence} block with {marker!r} in {DOCS}")


def test_the_documented_queries_run_on_an_archive(source: Engine, archive: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    pytest.importorskip("pandas")
    here = str(archive)

    sep = documented("sql", "# the current type of every head and its attention to [SEP]")
    got = duckdb.sql(sep.replace("'catalog/", f"'{here}/")).fetchall()
    with source.connect() as connection:
        want = connection.execute(
            text(
                "SELECT model, stack, layer, head, type, sep, entropy FROM current_head_types WHERE sep > 0.05 "
                "ORDER BY sep DESC, model, stack, layer, head"
            )  # fmt: skip
        ).all()
        counts_want = connection.execute(
            text("SELECT model, type, count(*) FROM current_head_types GROUP BY model, type ORDER BY model, type")
        ).all()
        top_want = connection.execute(
            text("SELECT model, stack, layer, head FROM head_importance ORDER BY importance DESC LIMIT 10")
        ).all()
    assert len(want) > 3
    assert got == [tuple(r) for r in want]

    by_type = documented("sql", "# heads of each type in each model's current clustering")
    assert duckdb.sql(by_type.replace("'catalog/", f"'{here}/")).fetchall() == [tuple(r) for r in counts_want]

    namespace: dict[str, Any] = {}
    exec(documented("python", "pd.read_parquet").replace('"catalog/', f'"{here}/'), namespace)
    top = namespace["top"]
    assert list(top.itertuples(index=False, name=None)) == [
        (*r, *row[4:]) for r, row in zip(top_want, top.itertuples(index=False, name=None), strict=True)
    ]
