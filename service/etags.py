"""ETags for what does not change once written: ``If-None-Match`` answers ``304`` before the
response is built.

A finished clustering is immutable, but what ``GET /clusterings/{id}`` says around it is not
quite: which models use it as their current one, its stability runs and which is current, and the models still in the
catalog. Its tag covers those too (:func:`clustering_tag`), read in one small statement.
"""

from __future__ import annotations

import hashlib
import json

from fastapi import Request, Response
from sqlalchemy import text
from sqlalchemy.orm import Session

CACHE_CONTROL = "no-cache"  # caches may keep it, and revalidate each time with If-None-Match


def tag_of(*parts: object) -> str:
    digest = hashlib.sha256(json.dumps(parts, default=str, separators=(",", ":")).encode()).hexdigest()
    return f'"{digest[:32]}"'


def matches(request: Request, tag: str) -> bool:
    """Whether ``If-None-Match`` names ``tag`` (weak comparison, as RFC 9110 asks for GET) or is ``*``."""
    header = request.headers.get("if-none-match")
    if not header:
        return False
    wanted = {part.strip().removeprefix("W/") for part in header.split(",")}
    return "*" in wanted or tag in wanted


def not_modified(tag: str) -> Response:
    return Response(status_code=304, headers={"ETag": tag, "Cache-Control": CACHE_CONTROL})


def clustering_tag(session: Session, clustering_id: int) -> str | None:
    """The tag of a complete clustering's page; None while it is not complete (or does not exist)."""
    row = session.execute(
        text(
            "SELECT c.finished_at, c.current_stability_run_id, "
            "(SELECT array_agg(m.id ORDER BY m.id) FROM models m WHERE m.current_clustering_id = c.id) AS current, "
            "(SELECT array_agg(s.id ORDER BY s.id) FROM stability_runs s WHERE s.clustering_id = c.id) AS stability, "
            "(SELECT array_agg(r.feature_run_id ORDER BY r.feature_run_id) FROM clustering_feature_runs r "
            " WHERE r.clustering_id = c.id) AS runs "
            "FROM clusterings c WHERE c.id = :id AND c.status = 'complete'"
        ),
        {"id": clustering_id},
    ).one_or_none()
    if row is None:
        return None
    return tag_of(
        "clustering", clustering_id, row.finished_at, row.current, row.stability, row.current_stability_run_id, row.runs
    )
