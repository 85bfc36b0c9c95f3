"""Which run each lens serves (``service/current.py``): for every lens, a model with two complete runs whose
current one is NOT the highest id (the user chose the older), and every read serves that one: ``GET /heads``,
the lens endpoints, the SQL views, exports, the page's data. Choosing over REST and the CLI, the refusals (the
key: tests/service/test_security.py), and the import rule (an imported run is current only when newer by
``created_at``, ties by id)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.types import ROLES
from service import current
from service.orm import (
    CatalogModel,
    DetectionRun,
    Head,
    HeadDetection,
    HeadSyntax,
    ImportanceRun,
    ImportanceScore,
    StabilityHead,
    StabilityRun,
    SyntaxBaseline,
    SyntaxRun,
)
from tests.service.conftest import TINY
from tests.service.synthetic import dirichlet, store_attribution, store_model
from tests.service.test_catalog_archive import as_format
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = 0.25, 0.75  # each run's per-head value: a read says which run it served


def _heads(session: Session, model_id: int) -> list[int]:
    return list(session.scalars(select(Head.id).where(Head.model_id == model_id).order_by(Head.id)))


def _times(created: datetime | None) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {"device": "cpu", "dtype": "float32", "seconds": 0.1, "started_at": now, "finished_at": now,
            **({"created_at": created} if created is not None else {})}  # fmt: skip


def add_run(session: Session, lens: str, model_id: int, value: float, *, clustering_id: int | None = None,
            created: datetime | None = None, complete: bool = True) -> int:  # fmt: skip
    """A run of ``lens`` whose every head reads ``value``; current when complete, as its job would make it."""
    heads = _heads(session, model_id)
    status = "complete" if complete else "running"
    run: Any
    if lens == "importance":
        run = ImportanceRun(model_id=model_id, status=status, loss="lm", data_kind="builtin",
                            data_source="builtin:wiki", data_size=4, n_examples=4, seed=0, mean_loss=1.0, config={},
                            **_times(created))  # fmt: skip
        rows: list[Any] = [ImportanceScore(model_id=model_id, head_id=h, raw=value, normalized=value) for h in heads]
        key = "run_id"
    elif lens == "detections":
        run = DetectionRun(model_id=model_id, status=status, config={"thresholds": dict.fromkeys(ROLES, 0.5)},
                           sequences={}, num_sequences=1,
                           num_tokens=4, checks=[], example_tokens={"tokens": ["a", "b"]}, example_size=2,
                           **_times(created))  # fmt: skip
        rows = [HeadDetection(model_id=model_id, head_id=h, induction=value, duplicate_token=value,
                              previous_token=value, sink=value, roles=[], example_map=[value] * 4)
                for h in heads]  # fmt: skip
        key = "detection_run_id"
    elif lens == "syntax":
        run = SyntaxRun(model_id=model_id, status=status, stack="encoder", parses="gold", source="/x.conllu",
                        num_sentences=1, num_skipped=0, num_words=3, config={}, **_times(created))  # fmt: skip
        rows = [HeadSyntax(model_id=model_id, head_id=h, relation="nsubj", direction="dep2head", correct=1, count=2,
                           accuracy=value) for h in heads]  # fmt: skip
        key = "syntax_run_id"
    elif lens == "stability":
        assert clustering_id is not None
        run = StabilityRun(clustering_id=clustering_id, n_runs=2, fraction=0.8, random_state=0, seeds=[1, 2],
                           score=value, num_heads=len(heads), seconds=0.1,
                           **({"created_at": created} if created else {}))  # fmt: skip
        rows = [StabilityHead(model_id=model_id, head_id=h, stable=True, agreement=value) for h in heads]
        key = "stability_run_id"
    elif lens == "attribution":
        layers = session.get_one(CatalogModel, model_id).num_layers
        run_id = store_attribution(session, TINY, dirichlet(np.random.default_rng(0), layers, len(heads) // layers))
        session.execute(text("UPDATE head_attributions SET discrepancy = :v WHERE attribution_run_id = :r"),
                        {"v": value, "r": run_id})  # fmt: skip
        if created is not None:
            session.execute(
                text("UPDATE attribution_runs SET created_at = :c WHERE id = :r"), {"c": created, "r": run_id}
            )
        return run_id
    else:
        raise AssertionError(lens)
    session.add(run)
    session.flush()
    for row in rows:
        setattr(row, key, run.id)
    session.add_all(rows)
    if lens == "syntax":
        session.add(SyntaxBaseline(syntax_run_id=run.id, relation="nsubj", count=2, offset=1, accuracy=0.5))
    session.flush()
    if complete:
        current.completed(session, run)
    return int(run.id)


LENSES = ("importance", "detections", "syntax", "stability", "attribution")
# lens -> (GET /heads parameters, the item's key whose value says which run was served)
HEADS_KEY = {
    "importance": ({}, "importance"),
    "detections": ({}, "induction"),
    "syntax": ({"relation": "nsubj"}, "syntax_accuracy"),
    "stability": ({}, "agreement"),
    "attribution": ({}, "discrepancy"),
}
# lens -> (view, column) holding the per-head value
VIEWS = {
    "importance": ("head_importance", "importance"),
    "detections": ("head_detections", "induction"),
    "syntax": ("head_syntax", "accuracy"),
    "stability": ("current_head_types", "agreement"),
    "attribution": ("head_attribution", "discrepancy"),
}


@pytest.fixture
def older_current(
    session: Session, client: TestClient, tiny_clustered: int, request: pytest.FixtureRequest
) -> tuple[str, int, int]:
    """``tiny`` with two runs of the lens, the older made current over REST: (lens, older id, newer id)."""
    lens = request.param
    model = session.scalars(select(CatalogModel).where(CatalogModel.name == TINY)).one()
    older = add_run(session, lens, model.id, OLD, clustering_id=tiny_clustered)
    newer = add_run(session, lens, model.id, NEW, clustering_id=tiny_clustered)
    session.commit()
    assert newer > older
    assert client.get(f"/models/{TINY}/current").json()[lens] == newer  # the latest to complete serves
    answer = client.put(f"/models/{TINY}/current/{lens}", json={"run_id": older})
    assert answer.status_code == 200, answer.text
    assert answer.json()[lens] == older
    return lens, older, newer


@pytest.mark.parametrize("older_current", LENSES, indirect=True)
def test_every_read_serves_the_chosen_older_run(
    older_current: tuple[str, int, int], client: TestClient, session: Session
) -> None:
    lens, older, _ = older_current
    params, key = HEADS_KEY[lens]
    items = client.get("/heads", params={"model": TINY, **params}).json()["items"]
    assert len(items) == 8
    assert {item[key] for item in items} == {OLD}
    view, column = VIEWS[lens]
    values = session.execute(text(f"SELECT {column} FROM {view} WHERE model = :m"), {"m": TINY}).scalars().all()
    assert sorted(set(values)) == [OLD]
    assert len(values) == 8
    assert client.get(f"/models/{TINY}").json()["current_runs"][lens] == older
    if lens == "detections":
        body = client.get(f"/models/{TINY}/detections").json()
        assert body["current_run_id"] == older
        assert {h["induction"] for h in body["heads"]} == {OLD}
        example = client.get(f"/models/{TINY}/detections/example", params={"stack": "encoder", "layer": 0, "head": 0})
        assert example.json()["detection_run_id"] == older
    if lens == "attribution":
        maps = client.get(f"/models/{TINY}/attribution-maps", params={"layer": 0, "head": 0}).json()
        assert maps["run_id"] == older
        assert maps["discrepancy"] == OLD
    if lens == "importance":
        assert {item["importance_run_id"] for item in items} == {older}
        assert client.get("/heads", params={"model": TINY, "importance_run": _newer(older_current)}).json()[
            "items"][0]["importance"] == NEW  # an explicit run is still served  # fmt: skip
    if lens == "stability":
        clustering = client.get(f"/models/{TINY}").json()["current_clustering_id"]
        assert client.get(f"/clusterings/{clustering}").json()["current_stability_run_id"] == older
        head = client.get(f"/models/{TINY}/heads/0/0").json()
        assert head["stability_run_id"] == older
        for least, selected in ((0.2, 8), (0.5, 0)):  # the older run's agreement is 0.25, the newer's 0.75
            exported = client.get(f"/models/{TINY}/export", params={"format": "pairs", "min_agreement": least})
            assert len(exported.json()) == selected, exported.text


def _newer(chosen: tuple[str, int, int]) -> int:
    return chosen[2]


def test_a_run_that_completes_becomes_current_again(session: Session, client: TestClient, tiny_clustered: int) -> None:
    model = session.scalars(select(CatalogModel).where(CatalogModel.name == TINY)).one()
    older = add_run(session, "syntax", model.id, OLD)
    client.put(f"/models/{TINY}/current/syntax", json={"run_id": older})
    latest = add_run(session, "syntax", model.id, NEW)
    session.commit()
    assert client.get(f"/models/{TINY}/current").json()["syntax"] == latest


def test_the_features_of_an_unclustered_model_and_what_a_clustering_reads(
    session: Session, client: TestClient, tiny_bert_path: Path
) -> None:
    rng = np.random.default_rng(1)
    first = store_model(session, tiny_bert_path, "plain", {"encoder": dirichlet(rng, 2, 4)})
    second = store_model(session, tiny_bert_path, "plain", {"encoder": dirichlet(rng, 2, 4)}, add_run=True)
    session.commit()
    assert second > first
    assert {i["feature_run_id"] for i in client.get("/heads", params={"model": "plain"}).json()["items"]} == {second}
    assert client.put("/models/plain/current/features", json={"run_id": first}).status_code == 200
    items = client.get("/heads", params={"model": "plain"}).json()["items"]
    assert len(items) == 8
    assert {i["feature_run_id"] for i in items} == {first}
    from service.clusterings.schemas import ClusteringCreate
    from service.clusterings.service import resolve_runs

    session.expire_all()
    assert [r.id for r in resolve_runs(session, ClusteringCreate(models=["plain"]))] == [first]


def test_an_earlier_clustering_made_current_again(sessions: sessionmaker[Session], client: TestClient,
                                                  tiny_clustered: int) -> None:  # fmt: skip
    from service.jobs.runner import run_inline

    job = run_inline(sessions, "clustering", {"models": [TINY], "k": 3, "seed": 1})
    assert job.status == "succeeded"
    assert job.result is not None
    second = job.result["clustering_id"]
    assert client.get(f"/models/{TINY}").json()["current_clustering_id"] == second
    answer = client.put(f"/clusterings/{tiny_clustered}/current")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": tiny_clustered, "current_for": [TINY]}
    items = client.get("/heads", params={"model": TINY}).json()["items"]
    assert {i["clustering_id"] for i in items} == {tiny_clustered}
    with sessions() as session:
        count = session.execute(text("SELECT count(*) FROM clusterings")).scalar_one()
    assert count == 2  # nothing new was fitted
    assert client.put(f"/models/{TINY}/current/clustering", json={"run_id": second}).json()["clustering"] == second


@pytest.mark.parametrize(
    ("lens", "body", "status", "message"),
    [
        ("nope", {"run_id": 1}, 422, "lens: Input should be 'features'"),
        ("syntax", {"run_id": 999999}, 404, "run_id: no syntax run with id 999999"),
        ("syntax", {"run": 1}, 422, "run"),
        ("syntax", "other", 409, "is of 'other', not of 'tiny'"),
        ("syntax", "running", 409, "is running, not complete"),
        ("clustering", "other-clustering", 409, "does not cover 'tiny'"),
        ("stability", "other-stability", 409, "which does not cover 'tiny'"),
    ],
)
def test_choosing_is_refused_naming_what_is_wrong(
    sessions: sessionmaker[Session], session: Session, client: TestClient, tiny_clustered: int,
    tiny_bert_path: Path, lens: str, body: Any, status: int, message: str,
) -> None:  # fmt: skip
    from service.jobs.runner import run_inline

    if isinstance(body, str):
        rng = np.random.default_rng(2)
        store_model(session, tiny_bert_path, "other", {"encoder": dirichlet(rng, 2, 4)})
        other = session.scalars(select(CatalogModel).where(CatalogModel.name == "other")).one()
        tiny = session.scalars(select(CatalogModel).where(CatalogModel.name == TINY)).one()
        session.commit()
        if body == "other":
            run_id = add_run(session, "syntax", other.id, OLD)
        elif body == "running":
            run_id = add_run(session, "syntax", tiny.id, OLD, complete=False)
        else:
            job = run_inline(sessions, "clustering", {"models": ["other"], "k": 2})
            assert job.result is not None, job.error
            run_id = job.result["clustering_id"]
            if body == "other-stability":
                run_id = add_run(session, "stability", other.id, OLD, clustering_id=run_id)
        session.commit()
        body = {"run_id": run_id}
    before = client.get(f"/models/{TINY}/current").json()
    answer = client.put(f"/models/{TINY}/current/{lens}", json=body)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["detail"]
    assert client.get(f"/models/{TINY}/current").json() == before


# --- the import rule -----------------------------------------------------------------------------------


@pytest.fixture
def committed(committed_database_url: str) -> Any:
    """An engine on a committed catalog (an export reads in a snapshot of its own); shared by the module."""
    engine = create_engine(committed_database_url)
    yield engine
    engine.dispose()


def _model(session: Session, path: Path, name: str) -> CatalogModel:
    store_model(session, path, name, {"encoder": dirichlet(np.random.default_rng(4), 2, 4)})
    return session.scalars(select(CatalogModel).where(CatalogModel.name == name)).one()


def _export(engine: Any, directory: Path, name: str) -> Path:
    from service.catalogs.export import export_catalog

    with engine.connect() as connection, connection.begin():
        export_catalog(connection, directory, [name])
    return directory


@pytest.mark.parametrize(("offset", "becomes"), [(-1, False), (0, True), (1, True)])
def test_an_imported_run_is_current_only_when_newer_ties_by_id(
    committed: Any, tiny_bert_path: Path, tmp_path: Path, offset: int, becomes: bool
) -> None:
    """The archive's syntax run was created ``offset`` hours from the catalog's current one (0: the same instant,
    and the imported run's id is higher, so it wins)."""
    from service.catalogs import importer

    name = f"tie{offset + 1}"
    at = datetime(2026, 11, 1, tzinfo=UTC)
    with Session(committed) as session:
        model_id = _model(session, tiny_bert_path, name).id
        archived = add_run(session, "syntax", model_id, NEW, created=at + timedelta(hours=offset))
        session.commit()
    directory = _export(committed, tmp_path / "catalog", name)
    with Session(committed) as session:
        session.execute(text("DELETE FROM syntax_runs WHERE id = :r"), {"r": archived})
        here = add_run(session, "syntax", model_id, OLD, created=at)
        session.commit()
        result = importer.write(session, importer.validate(directory), "test")
        session.commit()
        imported = session.scalars(
            select(SyntaxRun.id).where(SyntaxRun.model_id == model_id, SyntaxRun.id != here)
        ).one()
        assert imported > here
        served = session.get_one(CatalogModel, model_id).current_syntax_run_id
        value = session.execute(
            text("SELECT DISTINCT accuracy FROM head_syntax WHERE model = :m"), {"m": name}
        ).scalar()
    decided = result["current_runs"]
    syntax = [e for e in decided["became_current"] + decided["not_current"] if e["lens"] == "syntax"]
    assert [e["run_id"] for e in syntax] == [imported]
    if becomes:
        assert served == imported
        assert syntax[0] in decided["became_current"]
        assert syntax[0]["replaced"] == here
    else:
        assert served == here
        assert syntax[0] in decided["not_current"]
        assert syntax[0]["current_run_id"] == here
    assert value == (NEW if becomes else OLD)


@pytest.mark.parametrize("version", [3, 2])
def test_a_new_model_serves_the_run_its_source_served(
    committed: Any, tiny_bert_path: Path, tmp_path: Path, version: int
) -> None:
    """Into a catalog without the model, the run its source catalog served (the later to complete, though older
    by created_at) serves; from an archive older than the columns that say which, the newest by created_at."""
    from service.catalogs import importer

    at = datetime(2026, 11, 1, tzinfo=UTC)
    name, copy_name = f"fresh{version}", f"copy{version}"
    with Session(committed) as session:
        model_id = _model(session, tiny_bert_path, name).id
        newest = add_run(session, "importance", model_id, NEW, created=at + timedelta(days=1))
        chosen = add_run(session, "importance", model_id, OLD, created=at)  # the higher id, but older: completed last
        session.commit()
        assert session.get_one(CatalogModel, model_id).current_importance_run_id == chosen
    directory = _export(committed, tmp_path / "catalog", name)
    if version == 2:
        as_format(directory, 2)  # before format 3: no columns naming the runs its catalog served
    with Session(committed) as session:
        renames = {name: copy_name}
        result = importer.write(session, importer.validate(directory, renames), "test", renames)
        session.commit()
        copy = session.scalars(select(CatalogModel).where(CatalogModel.name == copy_name)).one()
        served = session.get_one(ImportanceRun, copy.current_importance_run_id)
        values = session.execute(text("SELECT DISTINCT importance FROM head_importance WHERE model = :m"),
                                 {"m": copy_name}).scalars()  # fmt: skip
        assert list(values) == [OLD if version == 3 else NEW]
        other = session.scalars(
            select(ImportanceRun.id).where(ImportanceRun.model_id == copy.id, ImportanceRun.id != served.id)
        ).one()
    assert served.created_at == (at if version == 3 else at + timedelta(days=1))
    by = "source" if version == 3 else "newest"
    became = [e for e in result["current_runs"]["became_current"] if e["lens"] == "importance"]
    assert became == [{"lens": "importance", "model": copy_name, "run_id": served.id, "by": by,
                       "created_at": served.created_at.isoformat(), "replaced": None}]  # fmt: skip
    not_current = [e for e in result["current_runs"]["not_current"] if e["lens"] == "importance"]
    assert [(e["run_id"], e["current_run_id"], e["by"]) for e in not_current] == [(other, served.id, by)]
    assert {newest, chosen} != {served.id, other}  # the copy's runs are its own rows


def test_a_model_already_here_keeps_the_newest_rule(committed: Any, tiny_bert_path: Path, tmp_path: Path) -> None:
    """The archive's choice is its source's: a model already in the catalog takes an imported run only when it is
    newer than the one it serves, whatever the archive's source served."""
    from service.catalogs import importer

    at = datetime(2026, 11, 1, tzinfo=UTC)
    with Session(committed) as session:
        model_id = _model(session, tiny_bert_path, "kept").id
        newer = add_run(session, "syntax", model_id, NEW, created=at + timedelta(days=1))
        older = add_run(session, "syntax", model_id, OLD, created=at)
        session.commit()
    directory = _export(committed, tmp_path / "catalog", "kept")  # the source serves the older: it completed last
    with Session(committed) as session:
        session.execute(text("DELETE FROM syntax_runs WHERE id IN (:a, :b)"), {"a": newer, "b": older})
        here = add_run(session, "syntax", model_id, 0.5, created=at + timedelta(hours=1))
        session.commit()
        result = importer.write(session, importer.validate(directory), "test")
        session.commit()
        served = session.get_one(CatalogModel, model_id).current_syntax_run_id
        imported = dict(session.execute(
            select(SyntaxRun.created_at, SyntaxRun.id).where(SyntaxRun.model_id == model_id, SyntaxRun.id != here)
        ).tuples().all())  # fmt: skip
    assert served == imported[at + timedelta(days=1)]
    decided = result["current_runs"]
    assert [(e["run_id"], e["replaced"], e["by"]) for e in decided["became_current"]] == [(served, here, "newest")]
    assert [(e["run_id"], e["current_run_id"], e["by"]) for e in decided["not_current"]] == [
        (imported[at], served, "newest")]  # fmt: skip


def test_the_import_says_by_which_rule_each_run_is_current_or_not(caplog: pytest.LogCaptureFixture) -> None:
    from service.cli.catalogs import _say_current

    entry = {"lens": "syntax", "model": "m", "created_at": "2026-11-01T00:00:00+00:00"}
    decided = {
        "became_current": [{**entry, "run_id": 3, "by": "source", "replaced": None},
                           {**entry, "run_id": 5, "by": "newest", "replaced": 2}],
        "not_current": [{**entry, "run_id": 4, "by": "source", "current_run_id": 3},
                        {**entry, "run_id": 6, "by": "newest", "current_run_id": 5}],
    }  # fmt: skip
    with caplog.at_level("INFO", logger="headcat"):
        _say_current(decided)
    assert caplog.messages == [
        "m: syntax run 3 is now current (its source catalog served it).",
        "m: syntax run 5 is now current (it is newer than run 2).",
        "m: syntax run 4 is not current: run 3 is (its source catalog served that one).",
        "m: syntax run 6 is not current: run 5 is (it is newer).",
    ]


def test_an_import_of_exactly_shown_runs_still_says_a_line_per_run(caplog: pytest.LogCaptureFixture) -> None:
    """At the bound (SHOWN runs in all, current or not), a line per run; one more and the lines are grouped."""
    from service.cli.catalogs import _say_current
    from service.errors import SHOWN

    became = [{"lens": "features", "model": f"m{i}", "run_id": i + 1, "by": "newest", "replaced": None}
              for i in range(SHOWN - 1)]  # fmt: skip
    kept = [{"lens": "features", "model": "m0", "run_id": 99, "by": "newest", "current_run_id": 1}]
    with caplog.at_level("INFO", logger="headcat"):
        _say_current({"became_current": became, "not_current": kept})
    assert len(caplog.messages) == SHOWN
    assert caplog.messages[-1] == "m0: features run 99 is not current: run 1 is (it is newer)."


def test_an_import_of_many_runs_says_it_a_line_per_lens_and_outcome(caplog: pytest.LogCaptureFixture) -> None:
    """Past SHOWN runs, one line per lens and outcome (not thousands at a hub's scale), with counts by reason."""
    from service.cli.catalogs import _say_current
    from service.errors import SHOWN

    decided: dict[str, list[dict[str, Any]]] = {"became_current": [], "not_current": []}
    for i in range(SHOWN + 1):  # SHOWN + 1 features runs became current and one did not; one syntax run did
        by = "source" if i < 3 else "newest"
        decided["became_current"].append({"lens": "features", "model": f"m{i}", "run_id": 100 + i, "by": by,
                                          "replaced": None})  # fmt: skip
    decided["not_current"].append({"lens": "features", "model": "m0", "run_id": 99, "by": "source",
                                   "current_run_id": 100})  # fmt: skip
    decided["became_current"].append({"lens": "syntax", "model": "m0", "run_id": 7, "by": "newest", "replaced": 2})
    with caplog.at_level("INFO", logger="headcat"):
        _say_current(decided)
    shown = ", ".join(f"m{i} run {100 + i}" for i in range(SHOWN))
    assert caplog.messages == [
        f"features: {SHOWN + 1} imported runs are now current (3 their source catalog served them, {SHOWN - 2} "
        f"newer than the run served before): {shown} and 1 more.",
        "features: 1 imported run is not current (1 their source catalog served another): m0 run 99.",
        "syntax: 1 imported run is now current (1 newer than the run served before): m0 run 7.",
    ]


# --- the CLI ------------------------------------------------------------------------------------------


def test_the_cli_shows_and_chooses(committed_database_url: str, tiny_bert_path: Path) -> None:
    engine = create_engine(committed_database_url)
    try:
        with Session(engine) as session:
            rng = np.random.default_rng(3)
            first = store_model(session, tiny_bert_path, "cli-model", {"encoder": dirichlet(rng, 2, 4)})
            second = store_model(session, tiny_bert_path, "cli-model", {"encoder": dirichlet(rng, 2, 4)}, add_run=True)
            session.commit()
        env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}

        def headcat(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip

        shown = headcat("current", "cli-model")
        assert shown.returncode == 0, shown.stderr
        rows = [line.replace("│", " ").split() for line in shown.stdout.splitlines()]
        assert ["features", str(second)] in rows
        chosen = headcat("current", "cli-model", "features", str(first))
        assert chosen.returncode == 0, chosen.stderr
        with Session(engine) as session:
            model = session.scalars(select(CatalogModel).where(CatalogModel.name == "cli-model")).one()
            assert model.current_feature_run_id == first
        for args, message in (
            (("current", "cli-model", "nope", "1"), "no lens 'nope'"),
            (("current", "cli-model", "features", "999999"), "no feature run with id 999999"),
            (("current", "cli-model", "features"), "give the run id"),
        ):
            refused = headcat(*args)
            assert refused.returncode == 2, refused.stderr
            assert message in " ".join(refused.stderr.split()), refused.stderr
    finally:
        engine.dispose()
