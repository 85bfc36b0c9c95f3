"""An API key is its whole secret: the shown prefix is a label, never a credential.

Caught: a key check that looks a key up by its visible prefix (``hc_`` + 8 characters, what
``headcat keys list`` shows and logs may carry) and accepts it without comparing the hash of the
whole secret. A forged secret with a real key's prefix, every other character different, must get
401 on a write and on a closed read, and ``find`` must not take it for the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.auth import repository as keys
from service.auth.deps import authenticate
from service.deps import get_session
from service.errors import HeadcatError, InvalidInput, NotFound, Unauthorized
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


def raised(error: type[HeadcatError], call: Any) -> tuple[str, str | None]:
    with pytest.raises(error) as caught:
        call()
    return caught.value.message, caught.value.field


def test_key_names_secrets_and_every_refusal_naming_its_field(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        key, secret = keys.create(session, "  padded  ")
        assert key.name == "padded"
        assert re.fullmatch(r"hc_[A-Za-z0-9_\-]{43}", secret)  # 32 random bytes, url-safe
        assert keys.create(session, "n" * 200)[0].name == "n" * 200
        expected = ("name: a key's name is 1 to 200 characters", "name")
        for bad in ("", "   ", "n" * 201):
            assert raised(InvalidInput, lambda bad=bad: keys.create(session, bad)) == expected

        assert raised(NotFound, lambda: keys.find(session, "999999")) == ("key: no key with id 999999", "key")
        shape = ("key: give a key's id or the start of its secret (hc_xxxx...)", "key")
        for bad in ("hc_abc", "xx_abcdefgh", "abc"):
            assert raised(InvalidInput, lambda bad=bad: keys.find(session, bad)) == shape
        assert raised(NotFound, lambda: keys.find(session, "hc_zzzz")) == ("key: no key starts with 'hc_zzzz'", "key")


def test_find_by_prefix_is_literal_and_refuses_an_ambiguous_one(sessions: sessionmaker[Session]) -> None:
    """``_`` in ``hc_`` is a LIKE wildcard: the prefix must match literally."""
    with sessions() as session, session.begin():
        for prefix in ("hcXwxyz1234", "hc_abcd1234", "hc_abcd5678"):
            session.add(ApiKey(name=prefix, prefix=prefix, key_hash=keys.digest(prefix + "-secret")))
        session.flush()
        assert raised(NotFound, lambda: keys.find(session, "hc_wxyz")) == ("key: no key starts with 'hc_wxyz'", "key")
        assert keys.find(session, "hc_abcd1").name == "hc_abcd1234"
        message = "key: 2 keys start with 'hc_abcd'; give the id"
        assert raised(InvalidInput, lambda: keys.find(session, "hc_abcd")) == (message, "key")


def test_listing_revoking_and_touching(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, session.begin():
        made = [keys.create(session, name)[0] for name in ("first", "second", "third")]
        revoked = keys.revoke(session, made[0])  # an UPDATE: the row moves to the end of the table
        assert revoked.revoked_at is not None
        assert revoked.revoked_at.tzinfo is not None
        first_revocation = revoked.revoked_at
        assert keys.revoke(session, made[0]).revoked_at == first_revocation  # revoking again changes nothing
        assert made[1].revoked_at is None
        listed = [k.name for k in keys.list_all(session) if k.name in ("first", "second", "third")]
        assert listed == ["first", "second", "third"]

        key = made[1]
        keys.touch(session, key)
        session.refresh(key)
        assert key.last_used_at is not None
        recent = datetime.now(UTC) - keys.TOUCH_EVERY / 2
        key.last_used_at = recent
        session.flush()
        keys.touch(session, key)  # used half a minute ago: not written again
        session.refresh(key)
        assert key.last_used_at == recent
        key.last_used_at = datetime.now(UTC) - 2 * keys.TOUCH_EVERY
        session.flush()
        keys.touch(session, key)
        session.refresh(key)
        assert datetime.now(UTC) - key.last_used_at < keys.TOUCH_EVERY
