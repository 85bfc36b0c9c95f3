"""The key check as a client meets it: every refusal's status and whole body, on a write and on a
closed read, and how a closed read parses its ``Authorization`` header. Open reads need no key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.auth import repository as keys
from service.deps import get_session
from service.orm import ApiKey
from service.settings import get_settings
from tests.conftest import grant_key

NEEDS_KEY = {"detail": "authorization: this needs an API key (Authorization: Bearer <key>)", "field": "authorization"}
NOT_A_KEY = {"detail": "authorization: that is not a headcat API key (hc_...)", "field": "authorization"}
UNKNOWN = {"detail": "authorization: unknown API key", "field": "authorization"}
WELL_FORMED_UNKNOWN = "hc_" + "Z" * 43


def api(engine: Engine, sessions: sessionmaker[Session], *, closed: bool) -> TestClient:
    app = create_app(engine, get_settings().model_copy(update={"reads_require_key": closed}))

    def session_in_test_transaction() -> Iterator[Session]:
        with sessions() as session, session.begin():
            yield session

    app.dependency_overrides[get_session] = session_in_test_transaction
    return TestClient(app)


def write(client: TestClient, authorization: str | None) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = client.post("/clusterings", json={"models": ["nosuch"]}, headers=headers)
    return response.status_code, response.json()


def read(client: TestClient, authorization: str | None) -> tuple[int, object]:
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = client.get("/models", headers=headers)
    return response.status_code, response.json()


@pytest.fixture
def revoked(sessions: sessionmaker[Session]) -> tuple[str, str]:
    """A revoked key's secret, and the 403 body it gets."""
    secret = grant_key(sessions, "gone")
    with sessions() as session, session.begin():
        key = session.scalars(select(ApiKey).where(ApiKey.name == "gone")).one()
        keys.revoke(session, key)
        prefix = key.prefix
    body = {"detail": f"authorization: API key {prefix}... (gone) was revoked", "field": "authorization"}
    return secret, str(body["detail"])


def test_every_refusal_of_a_write_names_the_authorization(
    engine: Engine, sessions: sessionmaker[Session], revoked: tuple[str, str]
) -> None:
    client = api(engine, sessions, closed=False)
    assert write(client, None) == (401, NEEDS_KEY)
    assert write(client, "Bearer not-a-key") == (401, NOT_A_KEY)
    assert write(client, "Bearer hc_" + "a" * 19) == (401, NOT_A_KEY)  # 19 characters after hc_: too short
    assert write(client, "Bearer hc_" + "a" * 101) == (401, NOT_A_KEY)  # 101: too long
    assert write(client, f"Bearer {WELL_FORMED_UNKNOWN}") == (401, UNKNOWN)
    secret, message = revoked
    assert write(client, f"Bearer {secret}") == (403, {"detail": message, "field": "authorization"})
    status, body = write(client, f"Bearer {grant_key(sessions, 'live')}")
    assert status == 404, body  # past the key check: the unknown model is what is refused
    assert body["field"] == "models"
    assert str(body["detail"]).startswith("models: no model named 'nosuch'")


def test_a_key_in_use_is_recorded(engine: Engine, sessions: sessionmaker[Session]) -> None:
    """(By a request that succeeds: a refused one rolls its transaction back, the record with it.)"""
    secret = grant_key(sessions, "used")
    assert read(api(engine, sessions, closed=True), f"Bearer {secret}")[0] == 200
    with sessions() as session:
        assert session.scalars(select(ApiKey).where(ApiKey.name == "used")).one().last_used_at is not None


def test_open_reads_need_no_key_and_ignore_a_bad_one(engine: Engine, sessions: sessionmaker[Session]) -> None:
    client = api(engine, sessions, closed=False)
    assert read(client, None)[0] == 200
    assert read(client, "Bearer not-a-key")[0] == 200
    assert read(client, f"Bearer {WELL_FORMED_UNKNOWN}")[0] == 200


def test_closed_reads_parse_the_header_and_refuse_as_writes_do(
    engine: Engine, sessions: sessionmaker[Session], revoked: tuple[str, str]
) -> None:
    secret = grant_key(sessions, "reader")
    client = api(engine, sessions, closed=True)
    assert read(client, None) == (401, NEEDS_KEY)
    assert read(client, "") == (401, NEEDS_KEY)
    assert read(client, "Bearer") == (401, NEEDS_KEY)
    assert read(client, f"Basic {secret}") == (401, NEEDS_KEY)  # another scheme carries no key
    assert read(client, "Bearer not-a-key") == (401, NOT_A_KEY)
    assert read(client, f"Bearer {WELL_FORMED_UNKNOWN}") == (401, UNKNOWN)
    assert read(client, f"Bearer {revoked[0]}") == (403, {"detail": revoked[1], "field": "authorization"})
    for header in (f"Bearer {secret}", f"bearer {secret}", f"BEARER {secret}", f"Bearer  {secret} "):
        assert read(client, header)[0] == 200, header  # the scheme in any case; spaces around the key
