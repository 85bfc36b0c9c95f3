"""An API key is its whole secret: the shown prefix is a label, never a credential.

Caught: a key check that looks a key up by its visible prefix (``hc_`` + 8 characters, what
``headcat keys list`` shows and logs may carry) and accepts it without comparing the hash of the
whole secret. A forged secret with a real key's prefix, every other character different, must get
401 on a write and on a closed read, and ``find`` must not take it for the key.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.auth import repository as keys
from service.auth.deps import authenticate
from service.deps import get_session
from service.errors import NotFound, Unauthorized
from service.orm import ApiKey, Job
from service.settings import get_settings
from tests.conftest import grant_key


def forge(secret: str) -> str:
    """The same visible prefix, every later character changed, same length and alphabet."""
    shown = secret[: keys.DISPLAY_CHARS]
    rest = "".join("B" if c == "A" else "A" for c in secret[keys.DISPLAY_CHARS :])
    return shown + rest


def closed_api(engine: Engine, sessions: sessionmaker[Session], secret: str) -> TestClient:
    app = create_app(engine, get_settings().model_copy(update={"reads_require_key": True}))

    def session_in_test_transaction() -> Iterator[Session]:
        with sessions() as session, session.begin():
            yield session

    app.dependency_overrides[get_session] = session_in_test_transaction
    return TestClient(app, headers={"Authorization": f"Bearer {secret}"})


def test_a_forged_secret_with_a_real_keys_prefix_is_refused(engine: Engine, sessions: sessionmaker[Session]) -> None:
    secret = grant_key(sessions, "real")
    forged = forge(secret)
    assert forged[: keys.DISPLAY_CHARS] == secret[: keys.DISPLAY_CHARS]
    assert forged != secret
    assert len(forged) == len(secret)

    with sessions() as session:
        jobs_before = session.scalar(select(func.count()).select_from(Job))
        assert authenticate(session, secret).name == "real"
        with pytest.raises(Unauthorized):
            authenticate(session, forged)
        with pytest.raises(Unauthorized):
            authenticate(session, secret[: keys.DISPLAY_CHARS])  # the prefix alone

    write = closed_api(engine, sessions, forged).post("/clusterings", json={"models": ["nosuch"]})
    assert write.status_code == 401, write.text
    assert write.json()["field"] == "authorization"
    read = closed_api(engine, sessions, forged).get("/models")
    assert read.status_code == 401, read.text
    assert closed_api(engine, sessions, secret).get("/models").status_code == 200
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == jobs_before
        real = session.scalars(select(ApiKey).where(ApiKey.name == "real")).one()
        assert real.last_used_at is not None  # only the real secret's use was recorded


def test_find_matches_a_whole_secret_by_its_hash(sessions: sessionmaker[Session]) -> None:
    secret = grant_key(sessions, "findable")
    with sessions() as session:
        key = keys.find(session, secret)
        assert key.name == "findable"
        assert keys.find(session, secret[: keys.DISPLAY_CHARS]).id == key.id  # the shown prefix names it
        assert keys.find(session, str(key.id)).id == key.id
        with pytest.raises(NotFound):
            keys.find(session, forge(secret))  # longer than the prefix: the hash decides
        assert keys.by_secret(session, forge(secret)) is None
        assert keys.by_secret(session, secret) is not None
