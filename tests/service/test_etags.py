"""ETags of immutable pages: ``If-None-Match`` answers 304, and the tag moves when the page would."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from tests.service.conftest import TINY


def test_a_complete_clustering_answers_304_until_its_page_changes(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int
) -> None:
    first = client.get(f"/clusterings/{tiny_clustered}")
    assert first.status_code == 200
    tag = first.headers["ETag"]
    assert first.json()["current_for"] == [TINY]

    for header in (tag, f"W/{tag}", f'"other", {tag}', "*"):
        again = client.get(f"/clusterings/{tiny_clustered}", headers={"If-None-Match": header})
        assert again.status_code == 304, header
        assert again.content == b""
        assert again.headers["ETag"] == tag
    assert client.get(f"/clusterings/{tiny_clustered}", headers={"If-None-Match": '"other"'}).status_code == 200

    # Re-clustering the model makes the old clustering no longer current: its page, and tag, change.
    job = run_inline(sessions, "clustering", {"models": [TINY], "k": 3, "seed": 1})
    assert job.status == "succeeded", job.error
    changed = client.get(f"/clusterings/{tiny_clustered}", headers={"If-None-Match": tag})
    assert changed.status_code == 200
    assert changed.json()["current_for"] == []
    assert changed.headers["ETag"] != tag


def test_unknown_clusterings_stay_404_whatever_the_header(client: TestClient) -> None:
    answer = client.get("/clusterings/999999", headers={"If-None-Match": "*"})
    assert answer.status_code == 404
    assert answer.json()["field"] == "clustering"
