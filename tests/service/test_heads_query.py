"""``GET /heads`` across models: the same heads as SQL over the documented views, keyset pages
that miss and repeat nothing while models are added, and bad cursors and unknown filters as 4xx."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from ingest.types import SCALARS, feature_names
from service.errors import InvalidInput
from service.heads.query import Cursor
from service.orm import (
    CatalogModel,
    Cluster,
    Clustering,
    Corpus,
    FeatureRun,
    Head,
    HeadAssignment,
    HeadFeatures,
    clustering_feature_runs,
)
from tests.service.conftest import TINY

TYPES = ("dense", "diagonal", "dense_vertical", "vertical")
Key = tuple[str, str, int, int]


def add_model(
    session: Session,
    name: str,
    *,
    architecture: str = "bert",
    task: str | None = "base",
    layers: int = 3,
    heads: int = 4,
    stacks: tuple[str, ...] = ("encoder",),
    clusterings: int = 1,
    seed: int = 0,
) -> CatalogModel:
    """A model written as an ingest and a clustering job write it, with seeded random features and
    types; ``clusterings`` fits, the last one current (0: never clustered)."""
    rng = random.Random(seed)
    corpus = session.query(Corpus).filter_by(name="synthetic").one_or_none()
    if corpus is None:
        corpus = Corpus(name="synthetic", kind="builtin", source="synthetic")
        session.add(corpus)
    shape = {s: {"layers": layers, "heads": heads, "kv_heads": heads} for s in stacks}
    model = CatalogModel(name=name, source="synthetic", architecture=architecture, task=task, num_layers=layers,
                         num_heads=heads, stacks=shape)  # fmt: skip
    session.add(model)
    session.flush()
    now = datetime.now(UTC)
    run = FeatureRun(model_id=model.id, corpus_id=corpus.id, status="complete", num_windows=16, max_length=64,
                     num_samples=8, num_tokens=512, special_tokens={}, config={}, device="cpu", dtype="float32",
                     seconds=1.0, started_at=now, finished_at=now)  # fmt: skip
    session.add(run)
    session.flush()
    model.current_feature_run_id = run.id  # as the ingest job does (service/current.py)
    rows = [
        Head(model_id=model.id, stack=s, layer=la, head=h) for s in stacks for la in range(layers) for h in range(heads)
    ]
    session.add_all(rows)
    session.flush()
    for row in rows:
        vector = [rng.random() for _ in range(21)]
        session.add(HeadFeatures(model_id=model.id, feature_run_id=run.id, head_id=row.id,
                                 vector=[v / sum(vector) for v in vector], entropy=rng.uniform(0.5, 3),
                                 prev_token=rng.random(), next_token=rng.random(), mean_distance=rng.uniform(1, 20),
                                 sep_to_sep=rng.random()))  # fmt: skip
    for _ in range(clusterings):
        clustering = Clustering(algorithm="kmeans", k=4, seed=0, num_windows=16, params={}, status="complete",
                                num_heads=len(rows))  # fmt: skip
        session.add(clustering)
        session.flush()
        session.execute(clustering_feature_runs.insert().values(clustering_id=clustering.id, feature_run_id=run.id))
        clusters = [Cluster(clustering_id=clustering.id, index=i, name=t, centroid=[0.0] * 21, size=0, share=0.25)
                    for i, t in enumerate(TYPES)]  # fmt: skip
        session.add_all(clusters)
        session.flush()
        for row in rows:
            session.add(HeadAssignment(model_id=model.id, clustering_id=clustering.id, head_id=row.id,
                                       cluster_id=rng.choice(clusters).id, feature_run_id=run.id))  # fmt: skip
        model.current_clustering_id = clustering.id
    session.flush()
    return model


@pytest.fixture
def catalog(session: Session, tiny_clustered: int) -> Session:
    """``tiny`` (ingested and clustered for real) beside synthetic models of several kinds."""
    add_model(session, "roberta-a", architecture="roberta", task="sequence-classification", layers=4, seed=1)
    add_model(session, "roberta-b", architecture="roberta", task="question-answering", layers=2, heads=3, seed=2)
    add_model(session, "bert-deep", layers=6, heads=2, clusterings=2, seed=3)
    add_model(session, "t5-small", architecture="t5", task="seq2seq-lm", layers=2, heads=2,
              stacks=("encoder", "decoder", "cross"), seed=4)  # fmt: skip
    add_model(session, "unclustered", layers=2, heads=2, clusterings=0, seed=5)
    session.commit()
    return session


def walk(client: TestClient, params: dict[str, Any], limit: int = 5) -> Iterator[dict[str, Any]]:
    """Every head of a query, page by page through ``next``."""
    after = None
    while True:
        page = client.get("/heads", params={**params, "limit": limit, **({"after": after} if after else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["items"]) <= limit
        yield from body["items"]
        after = body["next"]
        if after is None:
            return


def key(head: dict[str, Any]) -> Key:
    return head["model"], head["stack"], head["layer"], head["head"]


CROSS_MODEL = [
    ({"type": "vertical", "layer_gt": 0}, "v.type = 'vertical' AND v.layer > 0"),
    ({"num_layers_ge": 4, "type": "dense"}, "m.num_layers >= 4 AND v.type = 'dense'"),
    ({"architecture": "roberta"}, "m.architecture = 'roberta'"),
    ({"architecture": ["roberta", "t5"], "layer_le": 0}, "m.architecture IN ('roberta', 't5') AND v.layer <= 0"),
    ({"task": ["base", "seq2seq-lm"], "head": 1, "type": "dense"},
     "m.task IN ('base', 'seq2seq-lm') AND v.head = 1 AND v.type = 'dense'"),
    ({"stack": "cross"}, "v.stack = 'cross'"),
    ({"stack": "decoder", "layer_ge": 1}, "v.stack = 'decoder' AND v.layer >= 1"),
    ({"model_prefix": "roberta-"}, "m.name LIKE 'roberta-%'"),
    ({"model": ["bert-deep", TINY], "layer_ge": 1, "layer_lt": 5},
     f"m.name IN ('bert-deep', '{TINY}') AND v.layer >= 1 AND v.layer < 5"),
    ({"num_heads_le": 3, "num_layers_le": 2, "type": "dense"},
     "m.num_heads <= 3 AND m.num_layers <= 2 AND v.type = 'dense'"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "where"), CROSS_MODEL, ids=[str(p) for p, _ in CROSS_MODEL])
def test_cross_model_queries_answer_the_views_heads(
    client: TestClient, catalog: Session, params: dict[str, Any], where: str
) -> None:
    got = list(walk(client, params))
    expected = catalog.execute(
        text(
            f"SELECT v.*, m.task FROM current_head_types v JOIN models m ON m.id = v.model_id WHERE {where} "
            "ORDER BY v.model, v.stack, v.layer, v.head"
        )  # fmt: skip
    ).all()
    assert expected, "a query the catalog cannot answer tests nothing"
    assert [key(h) for h in got] == [(r.model, r.stack, r.layer, r.head) for r in expected]
    for head, row in zip(got, expected, strict=True):
        assert head["type"] == row.type
        assert head["clustering_id"] == row.clustering_id
        assert head["feature_run_id"] == row.feature_run_id
        assert list(head["features"]) == feature_names(16)
        for name in feature_names(16):
            assert head["features"][name] == pytest.approx(getattr(row, name), rel=1e-12)
        assert head["scalars"] == pytest.approx({name: getattr(row, name) for name in SCALARS}, rel=1e-12)


def test_every_model_includes_the_unclustered_ones_without_a_type(client: TestClient, catalog: Session) -> None:
    every = list(walk(client, {}, limit=50))
    typed = catalog.execute(text("SELECT model, stack, layer, head FROM current_head_types")).all()
    untyped = catalog.execute(
        text(
            "SELECT m.name, h.stack, h.layer, h.head FROM heads h JOIN models m ON m.id = h.model_id "
            "WHERE m.current_clustering_id IS NULL"
        )  # fmt: skip
    ).all()
    assert sorted(key(h) for h in every) == sorted([tuple(r) for r in typed] + [tuple(r) for r in untyped])
    assert {h["type"] for h in every if h["model"] == "unclustered"} == {None}
    assert len(every) == catalog.scalar(text("SELECT count(*) FROM heads"))


def test_the_ingested_model_records_its_task(client: TestClient, catalog: Session) -> None:
    assert catalog.scalar(text("SELECT task FROM models WHERE name = :n"), {"n": TINY}) == "base"  # BertModel
    assert {h["model"] for h in walk(client, {"task": "base", "architecture": "bert"}, limit=100)} == {
        TINY, "bert-deep", "unclustered",
    }  # fmt: skip


def test_a_named_clustering_gives_the_types_of_that_fit(client: TestClient, catalog: Session) -> None:
    first = catalog.scalar(
        text(
            "SELECT min(a.clustering_id) FROM head_assignments a "
            "JOIN heads h ON h.model_id = a.model_id AND h.id = a.head_id "
            "JOIN models m ON m.id = h.model_id WHERE m.name = 'bert-deep'"
        )  # fmt: skip
    )
    got = list(walk(client, {"clustering": first, "type": "vertical"}))
    expected = catalog.execute(
        text(
            "SELECT model, stack, layer, head FROM head_types WHERE clustering_id = :c AND type = 'vertical' "
            "ORDER BY model, stack, layer, head"
        ),  # fmt: skip
        {"c": first},
    ).all()
    assert expected
    assert [key(h) for h in got] == [tuple(r) for r in expected]
    assert {h["clustering_id"] for h in got} == {first}


def test_totals_count_named_models_and_on_request(client: TestClient, catalog: Session) -> None:
    named = client.get("/heads", params={"model": ["roberta-a", "roberta-b"], "limit": 2}).json()
    assert named["total"] == 4 * 4 + 2 * 3
    assert client.get("/heads", params={"limit": 2}).json()["total"] is None
    every = client.get("/heads", params={"limit": 2, "total": "true"}).json()
    assert every["total"] == catalog.scalar(text("SELECT count(*) FROM heads"))


def test_every_cursor_page_counts_the_whole_query(client: TestClient, catalog: Session) -> None:
    """Cursor pages across models (their own after= keyset on models and heads) count the query, not what is
    left: the same total on the first, a middle and the last page, with and without total=true."""
    for params, expected in (
        ({"model": ["roberta-a", "roberta-b", "t5-small"], "layer_le": 0}, 4 + 3 + 2 * 3),
        ({"type": "dense", "total": "true"}, None),
    ):
        totals, after, seen = [], None, 0
        while True:
            body = client.get("/heads", params={**params, "limit": 3, **({"after": after} if after else {})}).json()
            totals.append(body["total"])
            seen += len(body["items"])
            after = body["next"]
            if after is None:
                break
        assert len(totals) > 2
        assert totals == [expected if expected is not None else seen] * len(totals)


def test_cursor_pages_miss_and_repeat_nothing_while_models_are_added(client: TestClient, catalog: Session) -> None:
    before = sorted(key(h) for h in walk(client, {}, limit=100))
    seen: list[Key] = []
    after = None
    added = 0
    while True:
        body = client.get("/heads", params={"limit": 7, **({"after": after} if after else {})}).json()
        seen += [key(h) for h in body["items"]]
        after = body["next"]
        if after is None:
            break
        # New models land before the cursor, after it and right at it (same name prefix).
        for name in (f"aaa-{added}", f"zzz-{added}", f"{body['items'][-1]['model']}-{added}"):
            add_model(catalog, name, layers=1, heads=2, seed=100 + added)
        catalog.commit()
        added += 1
    assert added > 5
    assert len(seen) == len(set(seen)), "a head was repeated"
    assert set(before) <= set(seen), f"missed: {sorted(set(before) - set(seen))[:5]}"
    assert seen == sorted(seen), "pages are in (model, stack, layer, head) order"


def test_cursor_and_offset_pages_agree(client: TestClient, catalog: Session) -> None:
    by_cursor = [key(h) for h in walk(client, {"type": "dense"}, limit=3)]
    by_offset = []
    for offset in range(0, len(by_cursor) + 3, 3):
        by_offset += [key(h) for h in client.get("/heads", params={"type": "dense", "limit": 3,
                                                                    "offset": offset}).json()["items"]]  # fmt: skip
    assert by_cursor == by_offset


def _token(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "after",
    [
        "not-a-cursor!",
        _token({"model": "x"}),
        _token(["m", "sideways", 0, 0]),
        _token(["m", "encoder", -1, 0]),
        _token(["m", "encoder", "0", 0]),
        _token(["m", "encoder", 0, 2**40]),
        _token(["", "encoder", 0, 0]),
        _token(["m", "encoder", 0]),
        _token(["m\x00", "encoder", 0, 0]),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_bad_cursors_are_422_naming_after(client: TestClient, after: str) -> None:
    answer = client.get("/heads", params={"after": after})
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "after"


# each range of a cursor's parts at its bounds: (model, layer, head) -> accepted
CURSOR_BOUNDS = [
    (("m" * 200, 0, 0), True),
    (("m" * 201, 0, 0), False),
    (("m", 0, 0), True),
    (("", 0, 0), False),
    (("m", 2**31 - 1, 0), True),
    (("m", 2**31, 0), False),
    (("m", -1, 0), False),
    (("m", 0, 2**31 - 1), True),
    (("m", 0, 2**31), False),
    (("m", 0, -1), False),
]


@pytest.mark.parametrize(("parts", "accepted"), CURSOR_BOUNDS, ids=[f"{p[0][:3]}{len(p[0])}-{p[1]}-{p[2]}"
                                                                   for p, _ in CURSOR_BOUNDS])  # fmt: skip
def test_a_cursor_is_read_up_to_each_bound_and_refused_past_it(parts: tuple[str, int, int], accepted: bool) -> None:
    """A model name of 1 to 200 characters, a layer and a head in ``[0, 2**31)`` (PostgreSQL's integer): the
    values at each bound are read back, one past it refused as out of range."""
    model, layer, head = parts
    token = _token([model, "encoder", layer, head])
    if accepted:
        assert Cursor.decode(token) == Cursor(model, "encoder", layer, head)
    else:
        with pytest.raises(InvalidInput, match="out of range"):
            Cursor.decode(token)


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"layer_gte": "18"}, 422, "layer_gte"),
        ({"architecture": "bert", "importance_lower": "0.1"}, 422, "importance_lower"),
        ({"stack": "middle"}, 422, "stack"),
        ({"num_layers_ge": "-1"}, 422, "num_layers_ge"),
        ({"model": ["tiny", "nope"]}, 404, "model"),
        ({"model": ["x"] * 101}, 422, "model"),
        ({"model_prefix": ""}, 422, "model_prefix"),
        ({"total": "maybe"}, 422, "total"),
        ({"type": "sideways", "architecture": "roberta"}, 422, "type"),
    ],
)
def test_unknown_filters_and_bad_values_are_4xx_naming_the_field(
    client: TestClient, catalog: Session, params: dict[str, Any], status: int, field: str
) -> None:
    answer = client.get("/heads", params=params)
    assert answer.status_code == status, answer.text
    assert field in answer.text
    if answer.json().get("field") is not None:
        assert answer.json()["field"] == field


def test_the_documented_parameters_are_the_accepted_ones(client: TestClient) -> None:
    from service.heads.endpoints import PARAMETERS

    documented = {p["name"] for p in client.get("/openapi.json").json()["paths"]["/heads"]["get"]["parameters"]}
    assert documented == PARAMETERS


def test_one_statement_answers_a_page(client: TestClient, catalog: Session, engine: Any) -> None:
    from sqlalchemy import event

    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.lstrip().upper().startswith(("SAVEPOINT", "RELEASE", "ROLLBACK", "INSERT INTO API_KEYS")):
            statements.append(statement)

    connection = catalog.connection()
    event.listen(connection, "before_cursor_execute", count)
    try:
        assert client.get("/heads", params={"model": "roberta-a", "type": "vertical", "layer_gt": 1}).status_code == 200
        assert client.get("/heads", params={"num_layers_ge": 4, "type": "dense", "limit": 3}).status_code == 200
    finally:
        event.remove(connection, "before_cursor_execute", count)
    heads_statements = [s for s in statements if "api_keys" not in s]
    assert len(heads_statements) == 2, heads_statements
