"""The request's connection: a pooled connection the server closed is replaced without a failed
request, a healthy one costs no extra round trip, reads run without a transaction, writes in one.

Real PostgreSQL, real commits (the module's own database), real server-side connection kills.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import sessionmaker

from service import db
from service.app import create_app
from tests.conftest import grant_key

IDLE, INTRANS = psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS


@pytest.fixture
def engine(committed_database_url: str) -> Iterator[Engine]:
    """The engine ``headcat serve`` makes (used one request at a time, its pool holds one connection)."""
    db.get_engine.cache_clear()
    engine = db.get_engine(committed_database_url)
    yield engine
    engine.dispose()
    db.get_engine.cache_clear()


@pytest.fixture
def pings(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The round-trip pings the pool sends (each one's backend pid)."""
    sent: list[int] = []
    real = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        sent.append(dbapi_connection.info.backend_pid)
        return real(dbapi_connection)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    return sent


def _terminate(url: str, pid: int) -> None:
    with psycopg.connect(db.libpq_url(url), autocommit=True) as other:
        assert other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone() == (True,)


def _pid(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_healthy_pooled_connection_is_reused_without_a_ping(engine: Engine, pings: list[int]) -> None:
    first = _pid(engine)
    assert [_pid(engine) for _ in range(5)] == [first] * 5
    assert pings == []


def test_a_connection_the_server_closed_is_replaced_on_checkout(
    engine: Engine, pings: list[int], committed_database_url: str
) -> None:
    killed = _pid(engine)
    _terminate(committed_database_url, killed)
    replacement = _pid(engine)  # no error: the checkout saw the closed socket, pinged, and reconnected
    assert replacement != killed
    assert pings == [killed]
    assert _pid(engine) == replacement
    assert pings == [killed]  # the new one is healthy: no more pings


def test_the_api_answers_after_its_connections_were_killed(
    engine: Engine, pings: list[int], committed_database_url: str
) -> None:
    key = grant_key(sessionmaker(bind=engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as api:
        assert api.get("/models").status_code == 200
        killed = _pid(engine)
        _terminate(committed_database_url, killed)
        answer = api.get("/models")  # pool_pre_ping's promise, without its round trip on every request
        assert answer.status_code == 200, answer.text
        assert pings == [killed]


def test_reads_run_without_a_transaction_and_writes_in_one(engine: Engine) -> None:
    """A read's statements leave the connection idle (autocommit: no BEGIN, no COMMIT); a write's
    run inside a transaction, rolled back when the write is refused."""
    key = grant_key(sessionmaker(bind=engine))
    seen: list[tuple[str, Any]] = []
    returned: list[Any] = []

    @event.listens_for(engine, "after_cursor_execute")
    def _status(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append((statement.split()[0], conn.connection.dbapi_connection.info.transaction_status))

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_connection: Any, record: Any) -> None:
        returned.append(dbapi_connection.info.transaction_status)

    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as api:
        assert api.get("/heads", params={"model": "nope"}).status_code == 404
        assert seen
        assert {status for _, status in seen} == {IDLE}, seen
        assert returned == [IDLE]

        seen.clear()
        returned.clear()
        refused = api.post("/clusterings", json={"models": ["nope"], "k": 4})
        assert refused.status_code == 404, refused.text
        assert seen
        assert {status for _, status in seen} == {INTRANS}, seen  # the key's check and the model's lookup
        assert returned == [IDLE]  # rolled back before it went back to the pool
