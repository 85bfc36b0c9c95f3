"""Stacks above the attention path (SPEC section 6): a catalog encoder-decoder's heads are
``(stack, layer, head)`` in its model record, exports, clusterings, ablation requests and pages.

The encoder-decoder is a tiny random BART (2 layers x 4 heads in each stack) stored through the
ingest service's own writer, with per-stack feature arrays drawn from a seeded generator: what
is tested here is everything that reads stored heads, not the extraction (the attention path's
conformance test covers that).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict
from service.ingests.schemas import IngestCreate
from service.ingests.service import store_feature_run
from service.jobs.runner import run_inline
from service.orm import CatalogModel, Cluster, Clustering, Head, HeadAssignment, Job
from tests.service.synthetic import feature_result

BART = "tiny-bart"
SHAPES = {"encoder": (2, 4), "decoder": (2, 4), "cross": (2, 4)}
WINDOWS = 16


def _result(shapes: dict[str, tuple[int, int]], seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    vectors = {}
    for offset, (name, (layers, heads)) in enumerate(shapes.items()):
        # each stack leans on other features, so a joint clustering has something to separate
        alpha = np.full(WINDOWS + 5, 0.3)
        alpha[(offset * 7) % (WINDOWS + 5)] = 8.0
        vectors[name] = rng.dirichlet(alpha, size=(layers, heads))
    return feature_result(vectors, num_windows=WINDOWS, seed=seed + 1)


def _store(
    session: Session, path: Path, shapes: dict[str, tuple[int, int]], *, add_run: bool = False, name: str = BART
) -> int:
    from ingest.corpora import load_corpus
    from ingest.loading import load_model

    loaded = load_model(str(path), device="cpu")
    request = IngestCreate(model=str(path), name=name, samples=4, add_run=add_run)
    result = _result(shapes, seed=len(name))
    return store_feature_run(session, request, loaded, load_corpus("builtin:wiki"), result, datetime.now(UTC))


@pytest.fixture
def bart(sessions: sessionmaker[Session], bart_path: Path) -> int:
    with sessions() as session, session.begin():
        return _store(session, bart_path, SHAPES)


def test_the_model_record_has_its_stacks(client: TestClient, bart: int) -> None:
    body = client.get(f"/models/{BART}").json()
    assert body["stacks"] == {name: {"layers": 2, "heads": 4, "kv_heads": 4} for name in SHAPES}
    assert body["num_key_value_heads"] is None
    assert (body["num_layers"], body["num_heads"]) == (2, 4)


def test_a_second_run_whose_stacks_differ_is_refused(
    sessions: sessionmaker[Session], bart_path: Path, bart: int
) -> None:
    refused = r"^name: 'tiny-bart' has the stacks .* in the catalog, but .* has encoder 2 x 4$"
    with sessions() as session, pytest.raises(Conflict, match=refused):
        _store(session, bart_path, {"encoder": (2, 4)}, add_run=True)
    with sessions() as session:  # the same stacks: a second run of the same heads
        _store(session, bart_path, SHAPES, add_run=True)
        assert session.scalar(select(func.count()).select_from(Head)) == 24


def named_field(answer: Any) -> str:
    """The field a 4xx names (one shape for service and request-schema errors)."""
    return str(answer.json()["field"])


def said(answer: Any) -> str:
    return str(answer.json()["detail"])


def _export(client: TestClient, **params: Any) -> Any:
    answer = client.get(f"/models/{BART}/export", params=params)
    assert answer.status_code == 200, answer.text
    return answer


def test_exports_are_per_stack(client: TestClient, bart: int) -> None:
    every = _export(client, layer_le=0, head=1)
    assert every.json() == {"encoder": {"0": [1]}, "decoder": {"0": [1]}, "cross": {"0": [1]}}
    assert every.headers["x-headcat-selected"] == "3"
    decoder = _export(client, stack="decoder", heads="0:1,1:3")
    assert decoder.json() == {"0": [1], "1": [3]}  # one stack: the form of a single-stack model
    masks = _export(client, format="head_mask", heads="decoder:1:2,cross:0:0").json()
    assert masks["encoder"] == [[1] * 4, [1] * 4]
    assert masks["decoder"] == [[1] * 4, [1, 1, 0, 1]]
    assert masks["cross"] == [[0, 1, 1, 1], [1] * 4]
    pairs = _export(client, format="pairs", heads="decoder:1:2,0:3").json()
    assert pairs == [["encoder", 0, 3], ["decoder", 0, 3], ["decoder", 1, 2], ["cross", 0, 3]]
    table = _export(client, format="csv", stack="cross", layer_ge=1).text.splitlines()
    assert table[0].split(",")[-1] == "stack"
    assert [line.split(",")[-1] for line in table[1:]] == ["cross"] * 4
    assert [line.split(",")[1:3] for line in table[1:]] == [["1", str(h)] for h in range(4)]
    npy = _export(client, format="head_mask.npy", stack="encoder", layer_lt=1)
    assert npy.headers["content-type"] == "application/x-npy"


def test_scores_per_stack_are_the_stored_features(client: TestClient, session: Session, bart: int) -> None:
    from service.orm import HeadFeatures

    stored = {
        (stack, layer, head): vector[WINDOWS + 1]  # cls
        for stack, layer, head, vector in session.execute(
            select(Head.stack, Head.layer, Head.head, HeadFeatures.vector).join(HeadFeatures)
        )
    }
    scores = _export(client, format="scores", score="cls").json()
    for stack, (layers, heads) in SHAPES.items():
        for layer in range(layers):
            for head in range(heads):
                assert scores[stack][layer][head] == pytest.approx(stored[stack, layer, head], abs=1e-12)


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"stack": "middle"}, "stack", "'encoder', 'decoder' or 'cross'"),
        ({"format": "head_mask.npy"}, "stack", "give stack="),
        ({"heads": "decoder:2:0"}, "heads", "decoder stack"),
        ({"heads": "top:0:0"}, "heads", "STACK:LAYER:HEAD"),
        ({"stack": "encoder", "heads": "cross:0:0"}, "heads", "does not cover"),
        ({"layer_ge": 2}, "layer_ge", "every stack of 'tiny-bart' (encoder, decoder, cross; give stack= for one)"),
    ],
)
def test_bad_stack_input_is_4xx_naming_the_field(
    client: TestClient, bart: int, params: dict[str, Any], field: str, words: str
) -> None:
    answer = client.get(f"/models/{BART}/export", params=params)
    assert 400 <= answer.status_code < 500, answer.text
    assert named_field(answer) == field
    assert words in said(answer)


def test_a_single_stack_model_refuses_a_stack_it_lacks(client: TestClient, tiny_ingested: int) -> None:
    answer = client.get("/models/tiny/export", params={"stack": "cross"})
    assert answer.status_code == 422
    assert answer.json()["field"] == "stack"
    assert "has no cross stack; its stacks: 'encoder'" in answer.json()["detail"]
    assert (
        client.get("/models/tiny/export", params={"stack": "encoder"}).json()
        == client.get("/models/tiny/export").json()
    )


def test_a_clustering_takes_every_stack_by_default_or_the_ones_named(
    sessions: sessionmaker[Session], client: TestClient, bart: int
) -> None:
    job = run_inline(sessions, "clustering", {"models": [BART], "k": 4, "seed": 0})
    clustering_id = job.result["clustering_id"]  # type: ignore[index]
    with sessions() as session:
        clustering = session.get_one(Clustering, clustering_id)
        assert clustering.params["stacks"] == ["encoder", "decoder", "cross"]
        assert clustering.params["stacks_default"] is True
        assert clustering.num_heads == 24
        assigned = session.execute(
            select(Head.stack, func.count())
            .join(HeadAssignment, HeadAssignment.head_id == Head.id)
            .where(HeadAssignment.clustering_id == clustering_id)
            .group_by(Head.stack)
        ).all()
        assert dict(assigned) == {"encoder": 8, "decoder": 8, "cross": 8}
    read = client.get(f"/clusterings/{clustering_id}").json()
    (shares,) = read["models"]
    assert list(shares["stacks"]) == ["encoder", "decoder", "cross"]
    assert [sum(layer.values()) for layer in shares["stacks"]["cross"]] == [4, 4]
    assert {point["stack"] for point in read["tsne"]} == {"encoder", "decoder", "cross"}
    detail = client.get(f"/models/{BART}").json()
    assert [(row["stack"], row["layer"]) for row in detail["layers"]] == [
        (stack, layer) for stack in SHAPES for layer in range(2)
    ]

    job = run_inline(sessions, "clustering", {"models": [BART], "k": 2, "seed": 0, "stacks": ["cross", "encoder"]})
    with sessions() as session:
        clustering = session.get_one(Clustering, job.result["clustering_id"])  # type: ignore[index]
        assert clustering.params["stacks"] == ["encoder", "cross"]
        assert clustering.num_heads == 16
    stability = run_inline(sessions, "stability", {"clustering_id": clustering.id, "n_runs": 2, "fraction": 0.5})
    assert stability.status == "succeeded", stability.error
    run = client.get(f"/stability-runs/{stability.result['stability_run_id']}").json()  # type: ignore[index]
    assert {head["stack"] for head in run["heads"]} == {"encoder", "cross"}


def test_a_clustering_of_a_stack_a_model_lacks_is_refused(client: TestClient, tiny_ingested: int) -> None:
    answer = client.post("/clusterings", json={"models": ["tiny"], "stacks": ["cross"]})
    assert answer.status_code == 422
    assert answer.json()["field"] == "stacks"
    assert "'tiny' has no cross stack; its stacks: encoder" in answer.json()["detail"]
    answer = client.post("/clusterings", json={"models": ["tiny"], "stacks": ["middle"]})
    assert answer.status_code == 422
    assert named_field(answer) == "stacks"


def _ablate(client: TestClient, plan: list[Any]) -> Any:
    return client.post("/ablations", json={"model": BART, "data": "builtin:wiki", "task": "drift", "plan": plan})


def test_ablation_selections_with_stacks_are_checked_before_anything_is_queued(
    client: TestClient, session: Session, bart: int
) -> None:
    jobs = session.scalar(select(func.count()).select_from(Job))
    for plan, field, words in [
        ([{"prune": "decoder:layers:2"}], "plan", "layer 2 is out of range: the decoder stack has 2 layers"),
        ([{"prune": "layers:0/heads:4"}], "plan", "head 4 (layer 0) is out of range"),
        ([{"prune": "middle:layers:0"}], "plan", "unknown stack 'middle'"),
        ([{"prune": {"stack": "cross", "union": [{"all": True}]}}], "plan", "a union has no stack"),
        ([{"drop_intra": "cross:all"}], "plan", "not defined on the cross stack"),
        ([{"prune": [[0, 1]], "uniform": "decoder:0:1"}], "plan", "selected for both prune and uniform"),
        ([{"prune": "decoder:dense"}], "clustering", "has not been clustered"),
    ]:
        answer = _ablate(client, cast(list[Any], plan))
        assert 400 <= answer.status_code < 500, (plan, answer.text)
        assert named_field(answer) == field, answer.text
        assert words in said(answer), (plan, answer.text)
    assert session.scalar(select(func.count()).select_from(Job)) == jobs  # nothing queued
    # Well-formed stacked rows: refused all the same, naming the model, since the evaluators cannot feed
    # an encoder-decoder's decoder (what headcat cannot compute, it refuses before any compute).
    refused = _ablate(client, [{"prune": "encoder:layers:0"}, {"prune": {"stack": "decoder", "heads": [[1, 2]]}}])
    assert refused.status_code == 422, refused.text
    assert named_field(refused) == "model"
    assert "is an encoder-decoder" in said(refused)
    assert session.scalar(select(func.count()).select_from(Job)) == jobs


def test_the_service_resolves_stacked_rows_against_the_catalog_shapes(session: Session, bart: int) -> None:
    from service.ablations.schemas import AblationCreate
    from service.ablations.service import plan_rows
    from service.models import repository as models

    model = models.require(session, BART)
    shapes = models.shapes(model)
    request = AblationCreate(model=BART, data="builtin:wiki", task="drift",
                             plan=[{"prune": "encoder:layers:0"}, {"prune": "layers:1/heads:2"}])  # fmt: skip
    rows = plan_rows(request, {}, shapes)
    specs = [row.to_spec(None, shapes=shapes) for row in rows]
    assert specs[0].is_empty
    assert set(specs[1].heads) == {("encoder", 0, h) for h in range(4)}
    assert set(specs[2].heads) == {(stack, 1, 2) for stack in SHAPES}  # no stack named: every stack


def test_the_head_page_names_the_stack(client: TestClient, bart: int) -> None:
    answer = client.get(f"/models/{BART}/heads/0/1")
    assert answer.status_code == 422
    assert answer.json()["field"] == "stack"
    head = client.get(f"/models/{BART}/heads/1/2", params={"stack": "cross"}).json()
    assert (head["stack"], head["layer"], head["head"], head["kv_heads"], head["kv_head"]) == (
        "cross",
        1,
        2,
        None,
        None,
    )


def test_compare_takes_one_stack(
    sessions: sessionmaker[Session], client: TestClient, bart_path: Path, bart: int
) -> None:
    with sessions() as session, session.begin():
        _store(session, bart_path, SHAPES, name="tiny-bart-b")
    run_inline(sessions, "clustering", {"models": [BART, "tiny-bart-b"], "k": 4, "seed": 0})
    default = client.get("/compare", params={"models": f"{BART},tiny-bart-b"}).json()
    assert default["stack"] == "encoder"
    cross = client.get("/compare", params={"models": f"{BART},tiny-bart-b", "stack": "cross"}).json()
    assert cross["stack"] == "cross"
    with sessions() as session:
        types = dict(
            session.execute(
                select(Head.layer * 10 + Head.head, func.min(Cluster.name))
                .join(HeadAssignment, HeadAssignment.head_id == Head.id)
                .join(Cluster, Cluster.id == HeadAssignment.cluster_id)
                .join(CatalogModel, CatalogModel.id == Head.model_id)
                .where(CatalogModel.name == BART, Head.stack == "cross")
                .group_by(Head.layer, Head.head)
            ).all()
        )
    assert cross["types"][BART] == [[types[layer * 10 + head] for head in range(4)] for layer in range(2)]
    answer = client.get("/compare", params={"models": f"{BART},tiny", "stack": "middle"})
    assert answer.status_code == 422
    assert named_field(answer) == "stack"


def test_grouped_key_value_heads_are_shown_per_query_head(session: Session, client: TestClient, bart: int) -> None:
    model = session.scalars(select(CatalogModel).where(CatalogModel.name == BART)).one()
    model.stacks = {**model.stacks, "decoder": {"layers": 2, "heads": 4, "kv_heads": 2}}
    session.commit()
    assert client.get(f"/models/{BART}").json()["stacks"]["decoder"]["kv_heads"] == 2
    for head, group in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        read = client.get(f"/models/{BART}/heads/1/{head}", params={"stack": "decoder"}).json()
        assert (read["kv_heads"], read["kv_head"]) == (2, group)
    assert client.get(f"/models/{BART}/heads/1/3", params={"stack": "encoder"}).json()["kv_head"] is None
