"""The application's one shape for 4xx answers: ``{"detail": message naming the field, "field": name}``,
for FastAPI's own validation errors as for headcat's, and documented so in OpenAPI."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from tests.service.conftest import TINY


def assert_one_shape(answer: Any, status: int, field: str | None) -> str:
    body = answer.json()
    assert answer.status_code == status, body
    assert set(body) == {"detail", "field"}, body
    assert isinstance(body["detail"], str), body
    assert body["field"] == field, body
    if field is not None:
        assert body["detail"].startswith(f"{field}: "), body
    return str(body["detail"])


@pytest.mark.parametrize(
    ("path", "field", "words"),
    [
        ("/heads?layer_gt=abc", "layer_gt", "valid integer, unable to parse string as an integer (got 'abc')"),
        ("/heads?limit=0", "limit", "greater than or equal to 1"),
        ("/jobs/abc", "job_id", "valid integer"),
    ],
)
def test_fastapi_validation_errors_name_the_field(client: TestClient, path: str, field: str, words: str) -> None:
    detail = assert_one_shape(client.get(path), 422, field)
    assert words in detail


def test_body_validation_errors_name_the_field(client: TestClient) -> None:
    request = {"model": "sentence-transformers/all-MiniLM-L6-v2", "name": "x", "samples": "many"}
    detail = assert_one_shape(client.post("/ingests", json=request), 422, "samples")
    assert "valid integer" in detail
    assert_one_shape(client.post("/ingests", json=[1, 2]), 422, "body")
    missing = assert_one_shape(client.post("/ingests", json={"name": "x"}), 422, "model")
    assert missing == "model: Field required"
    # Two bad fields: both named in the message, the first one in ``field``.
    both = assert_one_shape(client.post("/ingests", json={"model": "m", "name": "x y", "dtype": "f8"}), 422, "name")
    assert "; dtype: " in both


def test_headcat_errors_and_http_errors_have_the_same_shape(client: TestClient) -> None:
    assert_one_shape(client.get("/models/no-such-model"), 404, "name")
    assert_one_shape(client.get("/no/such/path"), 404, None)
    assert_one_shape(client.delete("/heads"), 405, None)


def test_openapi_documents_the_one_shape(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    error = schema["components"]["schemas"]["HTTPValidationError"]
    assert error["properties"]["detail"]["type"] == "string"
    assert "field" in error["properties"]
    assert "ValidationError" not in schema["components"]["schemas"]  # FastAPI's list items are gone
    refs = [
        answer["content"]["application/json"]["schema"]["$ref"]
        for operation in (op for item in schema["paths"].values() for op in item.values())
        for status, answer in operation.get("responses", {}).items()
        if status.startswith("4")
    ]
    assert len(refs) > 20
    assert set(refs) == {"#/components/schemas/HTTPValidationError"}


# --- whether a job will run: GET /health and a write's 202 say whether a worker is alive ------------


def test_health_and_a_write_say_when_no_worker_is_alive(
    client: TestClient, session: Session, tiny_ingested: int
) -> None:
    from service.jobs.schemas import NO_WORKER

    assert client.get("/health").json() == {"status": "ok", "database": "ok", "workers": 0, "warning": NO_WORKER}
    queued = client.post("/clusterings", json={"models": [TINY], "k": 3, "seed": 1})
    assert queued.status_code == 202, queued.text
    assert (queued.json()["workers"], queued.json()["warning"]) == (0, NO_WORKER)

    # A worker whose heartbeat is 40 s old is dead (30 s); one that beat 2 s ago is alive.
    session.execute(text("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now() - interval '40 seconds')"))
    queued = client.post("/clusterings", json={"models": [TINY], "k": 3, "seed": 2})
    assert (queued.json()["workers"], queued.json()["warning"]) == (0, NO_WORKER)
    session.execute(text("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now() - interval '2 seconds')"))
    queued = client.post("/clusterings", json={"models": [TINY], "k": 3, "seed": 3})
    assert (queued.json()["workers"], queued.json()["warning"]) == (1, None)


# --- bodies: JSON only, said so (415); malformed JSON named as such, with its position --------------


@pytest.mark.parametrize(
    ("headers", "got"),
    [
        ({"Content-Type": "application/x-www-form-urlencoded"}, "application/x-www-form-urlencoded"),  # curl -d
        ({"Content-Type": "text/plain; charset=utf-8"}, "text/plain"),
        ({}, "not given"),
    ],
)
def test_a_body_that_is_not_sent_as_json_is_refused_415_saying_what_to_send(
    client: TestClient, headers: dict[str, str], got: str
) -> None:
    body = b'{"models": ["tiny"], "k": 3}'
    detail = assert_one_shape(client.post("/clusterings", content=body, headers=headers), 415, "body")
    assert "Content-Type: application/json" in detail
    assert f"(this request's is {got})" in detail
    assert "--json" in detail


def test_json_bodies_and_bodiless_posts_pass(client: TestClient, tiny_ingested: int) -> None:
    body = b'{"models": ["tiny"], "k": 3}'
    for media in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
        assert client.post("/clusterings", content=body, headers={"Content-Type": media}).status_code == 202
    # No body at all is not a body of the wrong type: the endpoint's own answer (the body is required).
    assert_one_shape(client.post("/clusterings", headers={"Content-Type": "text/plain"}), 422, "body")


@pytest.mark.parametrize(("body", "position"), [('{"models": ["tiny"], "k": ', 26), ('{"models": ["tiny",}', 19)])
def test_malformed_json_is_a_4xx_on_the_body_naming_the_position(client: TestClient, body: str, position: int) -> None:
    answer = client.post("/clusterings", content=body, headers={"Content-Type": "application/json"})
    detail = assert_one_shape(answer, 422, "body")
    assert detail.startswith(f"body: the JSON is malformed at character {position} (counting from 0): "), detail
