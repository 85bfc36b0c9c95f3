"""A write commits before its answer is sent: a client told 202 (or 201) finds what it was told of."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from tests.conftest import grant_key
from tests.service.conftest import TINY


def test_a_write_commits_before_its_answer_is_sent(catalog_engine: Engine) -> None:
    """The order of the commit and the answer's first message, as a server sends it (FastAPI's default dependency
    scope commits after the answer: `headcat serve` then answered a job poll made at once with 404)."""
    app = create_app(catalog_engine)
    events: list[str] = []
    event.listen(app.state.session_factory, "after_commit", lambda session: events.append("commit"))

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                events.append(f"answer {message['status']}")
            await send(message)

        await app(scope, receive, sending)

    key = grant_key(sessionmaker(bind=catalog_engine))
    with TestClient(recorded, headers={"Authorization": f"Bearer {key}"}) as client:
        events.clear()  # the key's own commit, and any at start-up
        accepted = client.post("/clusterings", json={"models": [TINY], "k": 3, "seed": 11})
        assert accepted.status_code == 202, accepted.text
        assert events == ["commit", "answer 202"]
        job = client.get(f"/jobs/{accepted.json()['job_id']}")
        assert job.status_code == 200, job.text
        assert events[2:] == ["answer 200"]  # a read: no commit (an autocommit session)
