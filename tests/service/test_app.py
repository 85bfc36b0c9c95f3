"""The application's one shape for 4xx answers: ``{"detail": message naming the field, "field": name}``,
for FastAPI's own validation errors as for headcat's, and documented so in OpenAPI."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient


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
