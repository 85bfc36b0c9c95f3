"""The latest of several runs: every read serves the second of two complete runs (never the first, never
a later failed one), on a catalog where every model has two runs of every kind (``tests/service/two_runs.py``).

The reads: ``GET /heads``, the SQL views, the exports, the web page's data endpoints, the per-model
REST reads of each kind, and a copy of the catalog made through its archive.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from ingest.detectors import DETECTORS
from service import db
from service.app import create_app
from service.catalogs.export import export_catalog
from service.heads import query
from service.jobs.runner import run_inline
from tests.conftest import grant_key
from tests.service import two_runs
from tests.service.two_runs import RELATION, SHAPES, Catalog, Key

engine, catalog, api = two_runs.engine, two_runs.catalog, two_runs.api  # the catalog's module fixtures

FACTS = ("feature_run_id", "importance", "importance_raw", "importance_run_id", "discrepancy", "margin",
         "agreement", *DETECTORS, "roles")  # fmt: skip


def served_heads(client: TestClient, **params: Any) -> dict[Key, dict[str, Any]]:
    page = client.get("/heads", params={"limit": 1000, **params})
    assert page.status_code == 200, page.text
    return {(h["model"], h["stack"], h["layer"], h["head"]): h for h in page.json()["items"]}


def expected(catalog: Catalog, key: Key, fact: str) -> Any:
    values = catalog.values[key]
    if fact == "clustering_id":
        return catalog.clusterings[1] if key[0] != "plain" else None
    if fact == "type":
        return catalog.types.get(key)
    return values[fact]


def test_the_catalog_has_two_complete_runs_of_every_kind_and_a_failed_third(catalog: Catalog, engine: Engine) -> None:
    with engine.connect() as connection:
        for table, kind in (("feature_runs", "feature"), ("importance_runs", "importance"),
                            ("attribution_runs", "attribution"), ("syntax_runs", "syntax"),
                            ("detection_runs", "detection")):  # fmt: skip
            for model in SHAPES:
                statuses = connection.execute(
                    text(f"SELECT r.id, r.status FROM {table} r JOIN models m ON m.id = r.model_id "
                         "WHERE m.name = :m ORDER BY r.id"), {"m": model}).all()  # fmt: skip
                assert [tuple(r) for r in statuses] == list(
                    zip(catalog.runs[model][kind], ("complete", "complete", "failed"), strict=True)
                )
        assert connection.execute(text("SELECT count(*) FROM stability_runs")).scalar_one() == 4


def test_get_heads_serves_the_second_run_of_every_kind(api: TestClient, catalog: Catalog) -> None:
    assert not_second(api, catalog) == []


def not_second(api: TestClient, catalog: Catalog) -> list[tuple[Key, str]]:
    """The (head, fact) pairs ``GET /heads`` serves from another run than the second."""
    served = served_heads(api, relation=RELATION)
    assert sorted(served) == catalog.heads()
    wrong = []
    for key, head in served.items():
        for fact in (*FACTS, "clustering_id", "type", "syntax_accuracy"):
            if head[fact] != expected(catalog, key, fact):
                wrong.append((key, fact))
        if catalog.values[key]["discrepancy"] is not None:
            if list(head["global_features"].values()) != pytest.approx(catalog.values[key]["global_vector"]):
                wrong.append((key, "global_features"))
    return wrong


def selection_mutants() -> list[tuple[int, str, str]]:
    """Each run selection of ``query.SOURCES`` changed to pick another run: the first (min, ASC), or, where the
    run is chosen among the model's runs (max), any run whatever its status. (source index, what was changed,
    the mutated join)"""
    out = []
    for i, source in enumerate(query.SOURCES):
        for before, after in (("max(", "min("), (" DESC", " ASC")):
            if before in source.join:
                out.append((i, before, source.join.replace(before, after)))
        if "max(" not in source.join:
            continue  # the run is the one of the head's own latest row: a run that did not complete has none
        for status in re.findall(r"AND \w+\.status = 'complete'", source.join):
            out.append((i, status, source.join.replace(status, "")))
    return out


@pytest.mark.parametrize(("index", "changed", "join"), selection_mutants(), ids=lambda v: str(v)[:40])
def test_a_read_that_picks_another_run_is_caught(
    api: TestClient, catalog: Catalog, monkeypatch: pytest.MonkeyPatch, index: int, changed: str, join: str
) -> None:
    """The catalog is strong enough: a source of ``GET /heads`` that takes the first run, or a failed one, fails
    the test above."""
    mutated = list(query.SOURCES)
    mutated[index] = dataclasses.replace(mutated[index], join=join)
    monkeypatch.setattr(query, "SOURCES", tuple(mutated))
    assert not_second(api, catalog), f"source {index} with {changed!r} changed still serves the second runs"


def test_a_model_named_alone_is_served_the_same(api: TestClient, catalog: Catalog) -> None:
    """The one-model path (model=, total counted) reads the same runs."""
    for model in SHAPES:
        served = served_heads(api, model=model, relation=RELATION)
        assert sorted(served) == catalog.heads(model)
        for key, head in served.items():
            for fact in (*FACTS, "syntax_accuracy", "type"):
                assert head[fact] == expected(catalog, key, fact), (key, fact)


def rows(engine: Engine, sql: str) -> list[dict[str, Any]]:
    with engine.connect() as connection:
        return [dict(r._mapping) for r in connection.execute(text(sql))]


def test_the_views_serve_the_second_run_of_every_kind(engine: Engine, catalog: Catalog) -> None:
    def key(row: dict[str, Any]) -> Key:
        return (row["model"], row["stack"], row["layer"], row["head"])

    current = rows(engine, "SELECT * FROM current_head_types")
    assert sorted(map(key, current)) == [k for k in catalog.heads() if k[0] != "plain"]
    for row in current:
        assert row["clustering_id"] == catalog.clusterings[1]
        for fact in ("feature_run_id", "type", "margin", "agreement"):
            assert row[fact] == expected(catalog, key(row), fact), (key(row), fact)
    importance = rows(engine, "SELECT * FROM head_importance")
    assert sorted(map(key, importance)) == catalog.heads()
    for row in importance:
        assert (row["importance"], row["importance_run_id"]) == (
            catalog.values[key(row)]["importance"], catalog.runs[row["model"]]["importance"][1])  # fmt: skip
    attribution = rows(engine, "SELECT * FROM head_attribution")
    assert sorted(map(key, attribution)) == [k for k in catalog.heads() if k[1] == "encoder"]
    for row in attribution:
        assert row["attribution_run_id"] == catalog.runs[row["model"]]["attribution"][1]
        assert row["discrepancy"] == catalog.values[key(row)]["discrepancy"]
    for row in rows(engine, "SELECT * FROM head_syntax WHERE direction = 'dep2head'"):
        assert row["syntax_run_id"] == catalog.runs[row["model"]]["syntax"][1]
        assert row["accuracy"] == catalog.values[key(row)]["syntax_accuracy"]
        assert row["baseline"] == 0.5  # the second run's baseline
    best = rows(engine, "SELECT * FROM syntax_best_heads")
    assert sorted(r["model"] for r in best) == sorted(SHAPES)
    for row in best:
        assert row["syntax_run_id"] == catalog.runs[row["model"]]["syntax"][1]
        top = max(v["syntax_accuracy"] for k, v in catalog.values.items() if k[0] == row["model"] and k[1] == "encoder")
        assert row["accuracy"] == top
    detections = rows(engine, "SELECT * FROM head_detections")
    assert sorted(map(key, detections)) == catalog.heads()
    for row in detections:
        assert row["detection_run_id"] == catalog.runs[row["model"]]["detection"][1]
        for fact in (*DETECTORS, "roles"):
            assert row[fact] == catalog.values[key(row)][fact], (key(row), fact)


def stacked(client: TestClient, model: str, **params: Any) -> dict[str, Any]:
    """An export's JSON form keyed by stack (a single-stack model's form under its stack)."""
    answer = client.get(f"/models/{model}/export", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json() if len(SHAPES[model]) > 1 else {"encoder": answer.json()}


def reference(catalog: Catalog, model: str, fact: str) -> dict[str, list[list[Any]]]:
    out: dict[str, list[list[Any]]] = {}
    for stack in SHAPES[model]:
        out[stack] = [[catalog.values[model, stack, layer, head][fact] for head in range(4)] for layer in range(2)]
    return out


@pytest.mark.parametrize("score", ["importance", "margin", "agreement", *DETECTORS])
def test_exports_score_by_the_second_run(api: TestClient, catalog: Catalog, score: str) -> None:
    for model in SHAPES:
        if model == "plain" and score in ("margin", "agreement"):
            continue  # no clustering: a 422 (tested with the exports)
        assert stacked(api, model, format="scores", score=score) == reference(catalog, model, score), model


def test_exports_select_by_the_second_run(api: TestClient, catalog: Catalog) -> None:
    for model in SHAPES:
        for role in DETECTORS:
            pairs = api.get(f"/models/{model}/export", params={"format": "pairs", "role": role}).json()
            want = [[*k[1:]] if len(SHAPES[model]) > 1 else [*k[2:]]
                    for k in catalog.heads(model) if role in catalog.values[k]["roles"]]  # fmt: skip
            assert sorted(pairs) == sorted(want), (model, role)
        answer = api.get(f"/models/{model}/export", params={"format": "csv"})
        table = list(csv.DictReader(io.StringIO(answer.text)))
        assert {int(r["feature_run_id"]) for r in table} == {catalog.runs[model]["feature"][1]}
        assert {r["type"] for r in table} == ({"c", "d"} if model != "plain" else {""})
        if model != "plain":
            selected = api.get(f"/models/{model}/export", params={"format": "pairs", "min_agreement": 0.0}).json()
            assert len(selected) == sum(catalog.values[k]["agreement"] is not None for k in catalog.heads(model))


def test_the_page_data_serves_the_second_run(api: TestClient, catalog: Catalog) -> None:
    current = catalog.clusterings[1]
    for key in catalog.heads():
        model, stack, layer, head = key
        detail = api.get(f"/models/{model}/heads/{layer}/{head}", params={"stack": stack}).json()
        assert detail["feature_run_id"] == catalog.runs[model]["feature"][1], key
        assert detail["type"] == catalog.types.get(key)
        if model == "plain":
            assert (detail["clustering_id"], detail["stability_run_id"]) == (None, None)
            continue
        assert detail["clustering_id"] == current
        assert (detail["stability_run_id"], detail["stable"]) == (catalog.stability[current][1],
                                                                  catalog.values[key]["stable"])  # fmt: skip
        assert [h["current"] for h in detail["history"]] == [h["clustering_id"] == current for h in detail["history"]]
    for model in SHAPES:
        examples = api.get(f"/models/{model}/type-examples").json()
        if model == "plain":
            assert examples["clustering_id"] is None
            continue
        assert (examples["clustering_id"], examples["feature_run_id"]) == (current, catalog.runs[model]["feature"][1])
        assert set(examples["types"]) == {"c", "d"}


def test_the_per_model_reads_serve_the_second_run(api: TestClient, catalog: Catalog) -> None:
    for model in SHAPES:
        runs = catalog.runs[model]
        detail = api.get(f"/models/{model}").json()
        assert detail["clustering"] == (None if model == "plain" else detail["clustering"])
        if model != "plain":
            assert detail["clustering"]["id"] == catalog.clusterings[1]
        detections = api.get(f"/models/{model}/detections").json()
        assert [r["id"] for r in detections["runs"]] == runs["detection"][1::-1]
        for head in detections["heads"]:
            key = (model, head["stack"], head["layer"], head["head"])
            assert {f: head[f] for f in (*DETECTORS, "roles")} == {
                f: catalog.values[key][f] for f in (*DETECTORS, "roles")
            }
        example = api.get(f"/models/{model}/detections/example", params={"stack": "encoder", "layer": 0, "head": 0})
        assert (example.json()["detection_run_id"], example.json()["map"]) == (runs["detection"][1], [[0.5, 0.5]] * 2)
        syntax = api.get(f"/models/{model}/syntax").json()
        assert syntax["run"]["id"] == runs["syntax"][1]
        assert syntax["matrix"][RELATION] == reference(catalog, model, "syntax_accuracy")["encoder"]
        maps = api.get(f"/models/{model}/attribution-maps", params={"layer": 1, "head": 2}).json()
        assert (maps["run_id"], maps["attribution"]) == (runs["attribution"][1], [[0.5, 0.5]])
        assert maps["discrepancy"] == catalog.values[model, "encoder", 1, 2]["discrepancy"]


@contextmanager
def imported(engine: Engine, directory: Path, models: list[str] | None = None) -> Iterator[tuple[Engine, Any]]:
    """The archive in ``directory`` imported into an empty catalog of its own (``models``: only those):
    (its engine, the import's result); the catalog is dropped afterwards."""
    from sqlalchemy.orm import sessionmaker

    admin = create_engine(engine.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    name = f"headcat_copy_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(engine.url).set(database=name).render_as_string(hide_password=False)
    try:
        db.upgrade(url)
        copy = create_engine(url)
        job = run_inline(sessionmaker(bind=copy, expire_on_commit=False), "catalog_import",
                         {"archive": str(directory), "renames": {}, "models": models or []})  # fmt: skip
        assert job.status == "succeeded", job.error
        yield copy, job.result
        copy.dispose()
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def archive_copy(engine: Engine, catalog: Catalog, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The catalog exported as an archive and imported into an empty catalog of its own."""
    directory = tmp_path_factory.mktemp("two-runs") / "catalog"
    with engine.connect() as connection, connection.begin():
        export_catalog(connection, directory)
    with imported(engine, directory) as (copy, _):
        yield copy


def test_a_copy_made_through_the_archive_serves_the_second_run(archive_copy: Engine, catalog: Catalog) -> None:
    from sqlalchemy.orm import sessionmaker

    key = grant_key(sessionmaker(bind=archive_copy))
    with TestClient(create_app(archive_copy), headers={"Authorization": f"Bearer {key}"}) as client:
        served = served_heads(client, relation=RELATION)
    assert sorted(served) == catalog.heads()
    for head_key, head in served.items():
        for fact in ("importance", "importance_raw", "discrepancy", "margin", "agreement", *DETECTORS, "roles",
                     "syntax_accuracy", "type"):  # fmt: skip
            assert head[fact] == expected(catalog, head_key, fact), (head_key, fact)
    with archive_copy.connect() as connection:
        heads = connection.execute(text("SELECT count(*) FROM current_head_types")).scalar_one()
    assert heads == len([k for k in catalog.heads() if k[0] != "plain"])


OVERLAPPING = ("importance_runs", "attribution_runs", "syntax_runs", "detection_runs")


@pytest.fixture(scope="module")
def overlapping_copy(
    engine: Engine, catalog: Catalog, archive_copy: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """The archive of the catalog as it is when ``tiny``'s second runs started before its first ones and finished
    after them (two workers at once), imported into a catalog of its own; the source is restored afterwards."""
    swap = [
        f"UPDATE {table} SET started_at = started_at - interval '90 minutes', finished_at = finished_at + "
        f"interval '3 hours' WHERE id = :id AND model_id = (SELECT id FROM models WHERE name = 'tiny')"
        for table in OVERLAPPING
    ]
    kinds = {table: catalog.runs["tiny"][table.removesuffix("_runs")][1] for table in OVERLAPPING}
    directory = tmp_path_factory.mktemp("overlapping") / "catalog"
    with engine.begin() as connection:
        for table, sql in zip(OVERLAPPING, swap, strict=True):
            connection.execute(text(sql), {"id": kinds[table]})
    try:
        with engine.connect() as connection, connection.begin():
            export_catalog(connection, directory, ["tiny"])
    finally:
        with engine.begin() as connection:
            for table, sql in zip(OVERLAPPING, swap, strict=True):
                undo = sql.replace("started_at - ", "started_at + ").replace("finished_at + ", "finished_at - ")
                connection.execute(text(undo), {"id": kinds[table]})
    with imported(engine, directory) as (copy, _):
        yield copy


def test_a_copy_serves_the_second_run_also_when_runs_overlapped(overlapping_copy: Engine, catalog: Catalog) -> None:
    from sqlalchemy.orm import sessionmaker

    key = grant_key(sessionmaker(bind=overlapping_copy))
    with TestClient(create_app(overlapping_copy), headers={"Authorization": f"Bearer {key}"}) as client:
        served = served_heads(client, relation=RELATION)
    assert sorted(served) == catalog.heads("tiny")
    for head_key, head in served.items():
        for fact in ("importance", "discrepancy", *DETECTORS, "roles", "syntax_accuracy"):
            assert head[fact] == expected(catalog, head_key, fact), (head_key, fact)


# lens -> the kind of Catalog.runs whose first run the user chooses for ``tiny`` (and the current clustering's
# first stability run)
CHOSEN = {"features": "feature", "importance": "importance", "attribution": "attribution", "syntax": "syntax",
          "detections": "detection"}  # fmt: skip
SERVED = ("importance", "importance_raw", "discrepancy", "margin", "agreement", *DETECTORS, "roles",
          "syntax_accuracy", "type")  # fmt: skip


def current_keys(engine: Engine, model: str) -> dict[str, str]:
    """lens -> the key (as the archive names runs) of the run ``model`` serves; stability: its current
    clustering's."""
    from service.catalogs.tables import RUN_KEYS, run_key

    keys = {}
    with engine.connect() as connection:
        connection.execute(text("SET TimeZone = 'UTC'"))  # keys hash timestamps as text, as the export does
        for lens, table in (*((lens, f"{kind}_runs") for lens, kind in CHOSEN.items()),
                            ("stability", "stability_runs")):  # fmt: skip
            held = ("JOIN clusterings c ON c.current_stability_run_id = r.id JOIN models m "
                    "ON m.current_clustering_id = c.id" if lens == "stability"
                    else f"JOIN models m ON m.current_{table.removesuffix('s')}_id = r.id")  # fmt: skip
            keys[lens] = connection.execute(
                text(f"SELECT {run_key('r', *RUN_KEYS[table])} FROM {table} r {held} WHERE m.name = :m"), {"m": model}
            ).scalar_one()
    return keys


@pytest.fixture(scope="module", params=[None, ["tiny", "bart"]], ids=["whole", "part"])
def chosen_copy(
    request: pytest.FixtureRequest, engine: Engine, catalog: Catalog, api: TestClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Any, dict[Key, dict[str, Any]], dict[str, str]]]:  # fmt: skip
    """The archive of the catalog as it is when the user has chosen ``tiny``'s first run of every lens (and the
    first stability run of its clustering), imported whole or in part (``models``: ``tiny`` and ``bart``, the
    clustering's models) into a catalog of its own: (its engine, the import's result, the heads the source served
    for ``tiny``, the keys of the runs it served). The source serves its second runs again afterwards."""
    from sqlalchemy import select
    from sqlalchemy.orm import sessionmaker

    from service import current
    from service.orm import CatalogModel

    def choose(index: int) -> None:
        with sessionmaker(bind=engine)() as session, session.begin():
            tiny = session.scalars(select(CatalogModel).where(CatalogModel.name == "tiny")).one()
            for lens, kind in CHOSEN.items():
                current.choose(session, tiny, lens, catalog.runs["tiny"][kind][index])
            current.choose(session, tiny, "stability", catalog.stability[catalog.clusterings[1]][index])

    directory = tmp_path_factory.mktemp("chosen") / "catalog"
    choose(0)
    try:
        served = served_heads(api, model="tiny", relation=RELATION)
        keys = current_keys(engine, "tiny")
        with engine.connect() as connection, connection.begin():
            export_catalog(connection, directory)
    finally:
        choose(1)
    assert not_second(api, catalog) == []
    with imported(engine, directory, request.param) as (copy, result):
        yield copy, result, served, keys


def test_a_copy_serves_the_older_runs_the_user_chose(chosen_copy: Any, catalog: Catalog, engine: Engine) -> None:
    """Whole or in part, a copy serves what its source served when it was exported: the runs the user chose, not
    the newest ones, and the import's report says so."""
    from sqlalchemy.orm import sessionmaker

    copy, result, source, keys = chosen_copy
    now = current_keys(engine, "tiny")
    assert [lens for lens in keys if keys[lens] == now[lens]] == []  # the choice changed what the source served ...
    assert sorted(k for k in source if any(source[k][f] != expected(catalog, k, f) for f in SERVED)) == catalog.heads(
        "tiny")  # ... on every head  # fmt: skip
    assert current_keys(copy, "tiny") == keys
    key = grant_key(sessionmaker(bind=copy))
    with TestClient(create_app(copy), headers={"Authorization": f"Bearer {key}"}) as client:
        served = served_heads(client, model="tiny", relation=RELATION)
    assert sorted(served) == catalog.heads("tiny")
    for head_key, head in served.items():
        for fact in SERVED:
            assert head[fact] == source[head_key][fact], (head_key, fact)
    became = [e for e in result["current_runs"]["became_current"] if e.get("model") == "tiny"]
    assert sorted(e["lens"] for e in became) == sorted(CHOSEN)
    assert {e["by"] for e in result["current_runs"]["became_current"]} == {"source"}
    with copy.connect() as connection:
        tiny = connection.execute(text("SELECT * FROM models WHERE name = 'tiny'")).mappings().one()
        stability = connection.execute(
            text("SELECT current_stability_run_id FROM clusterings WHERE id = :c"), {"c": tiny["current_clustering_id"]}
        ).scalar_one()
    for entry in became:
        assert entry["run_id"] == tiny[f"current_{CHOSEN[entry['lens']]}_run_id"], entry
    stable = [e["run_id"] for e in result["current_runs"]["became_current"]
              if e["lens"] == "stability" and e["clustering_id"] == tiny["current_clustering_id"]]  # fmt: skip
    assert stable == [stability]
