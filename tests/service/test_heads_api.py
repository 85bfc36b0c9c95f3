"""``GET /heads``, ``/models``: the filters of SPEC section 5 and their bad-input answers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ingest.types import SCALARS, feature_names
from tests.service.conftest import TINY


def test_health(client: TestClient) -> None:
    health = client.get("/health").json()
    assert (health["status"], health["database"]) == ("ok", "ok")


def test_heads_carry_type_features_and_scalars(reader: TestClient) -> None:
    page = reader.get("/heads", params={"model": TINY}).json()
    assert page["total"] == 8
    assert len(page["items"]) == 8
    head = page["items"][0]
    assert (head["model"], head["layer"], head["head"]) == (TINY, 0, 0)
    assert head["clustering_id"] == reader.get(f"/models/{TINY}").json()["current_clustering_id"]
    assert list(head["features"]) == feature_names(16)
    assert sum(head["features"].values()) == pytest.approx(1.0, abs=1e-5)
    assert set(head["scalars"]) == set(SCALARS)
    assert {h["type"] for h in page["items"]} <= {"dense", "diagonal", "dense_vertical", "vertical"}


def test_filters_select_exactly_the_matching_heads(reader: TestClient) -> None:
    every = reader.get("/heads", params={"model": TINY}).json()["items"]
    some_type = every[-1]["type"]
    cases = {
        (("layer_gt", 0),): lambda h: h["layer"] > 0,
        (("layer_ge", 1), ("head", 2)): lambda h: h["layer"] >= 1 and h["head"] == 2,
        (("layer_lt", 1),): lambda h: h["layer"] < 1,
        (("layer_le", 0), ("type", some_type)): lambda h: h["layer"] <= 0 and h["type"] == some_type,
        (("type", some_type), ("layer_gt", 0)): lambda h: h["layer"] > 0 and h["type"] == some_type,
    }
    for params, keep in cases.items():
        got = reader.get("/heads", params={"model": TINY, **dict(params)}).json()
        expected = [(h["layer"], h["head"]) for h in every if keep(h)]
        assert [(h["layer"], h["head"]) for h in got["items"]] == expected, params
        assert got["total"] == len(expected)


def test_paging(reader: TestClient) -> None:
    first = reader.get("/heads", params={"model": TINY, "limit": 3}).json()
    rest = reader.get("/heads", params={"model": TINY, "limit": 3, "offset": 3}).json()
    assert first["total"] == rest["total"] == 8
    second = reader.get("/heads", params={"model": TINY, "limit": 3, "after": first["next"]}).json()
    last = reader.get("/heads", params={"model": TINY, "limit": 3, "after": second["next"]}).json()
    assert (second["total"], second["offset"], last["total"], last["next"]) == (8, 0, 8, None)  # the query's count
    assert [(h["layer"], h["head"]) for h in second["items"]] == [(h["layer"], h["head"]) for h in rest["items"]]
    skipped = reader.get("/heads", params={"model": TINY, "limit": 2, "offset": 1, "after": first["next"]}).json()
    assert skipped["total"] == 8
    assert [(h["layer"], h["head"]) for h in skipped["items"]] == [(h["layer"], h["head"]) for h in rest["items"][1:]]
    assert [(h["layer"], h["head"]) for h in first["items"] + rest["items"]] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1),
    ]  # fmt: skip


def test_an_unclustered_model_lists_heads_without_a_type(client: TestClient, tiny_ingested: int) -> None:
    page = client.get("/heads", params={"model": TINY}).json()
    assert page["total"] == 8
    assert {h["type"] for h in page["items"]} == {None}
    answer = client.get("/heads", params={"model": TINY, "type": "vertical"})
    assert answer.status_code == 422
    assert "not been clustered" in answer.json()["detail"]


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"layer_gt": "abc"}, 422, "layer_gt"),
        ({"head": "-1"}, 422, "head"),
        ({"limit": "0"}, 422, "limit"),
        ({"limit": "100000"}, 422, "limit"),
        ({"offset": "-5"}, 422, "offset"),
        ({"layer_lt": "99999999999999999999"}, 422, "layer_lt"),
        ({"clustering": "x"}, 422, "clustering"),
        ({"model": "nope"}, 404, "model"),
        ({"type": "sideways"}, 422, "type"),
        ({"clustering": "999999"}, 404, "clustering"),
    ],
)
def test_bad_input_is_4xx_naming_the_field(reader: TestClient, params: dict[str, str], status: int, field: str) -> None:
    answer = reader.get("/heads", params={"model": TINY, **params} if "model" not in params else params)
    assert answer.status_code == status, answer.text
    assert field in answer.text


def test_unknown_model_and_type_list_the_known_values(reader: TestClient) -> None:
    answer = reader.get("/heads", params={"model": "mnli"}).json()
    assert "'tiny'" in answer["detail"]
    answer = reader.get("/heads", params={"model": TINY, "type": "sideways"}).json()
    assert "known types" in answer["detail"]


def test_models_and_model_detail(reader: TestClient) -> None:
    assert [m["name"] for m in reader.get("/models").json()] == [TINY]
    detail = reader.get(f"/models/{TINY}").json()
    assert detail["num_layers"] == 2
    assert detail["num_heads"] == 4
    assert detail["current_clustering_id"] == reader.get("/clusterings").json()[0]["id"]
    assert len(detail["feature_runs"]) == 1
    assert detail["feature_runs"][0]["corpus"]["kind"] == "builtin"
    assert [layer["layer"] for layer in detail["layers"]] == [0, 1]
    assert sum(sum(layer["counts"].values()) for layer in detail["layers"]) == 8
    assert sum(c["share"] for c in detail["clustering"]["clusters"]) == pytest.approx(1.0)
    assert reader.get("/models/nope").status_code == 404


def test_openapi_documents_the_contract(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/heads", "/models", "/models/{name}", "/clusterings", "/jobs/{job_id}", "/ingests"):
        assert path in paths
