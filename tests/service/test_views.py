"""SQL for people: the ``head_types`` views and the SQL page's cross-model queries, on real models.

The real MiniLM and its SST-2 fine-tune (``shared/models/minilm-sst2``) are ingested and
clustered jointly; the queries are read from the documentation, so what is documented is what
is tested.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import sessionmaker

from ingest.types import SCALARS, feature_names
from service.app import create_app
from service.jobs.runner import run_inline
from tests.service.conftest import ingest_request

pytestmark = pytest.mark.slow

SQL_PAGE = Path(__file__).resolve().parents[2] / "docs" / "usage" / "sql.md"
CHANGED_QUERY = "-- heads whose type differs between two models"
COUNTS_QUERY = "-- how many heads went from each type to each other type"
BASE, TUNED = "minilm", "minilm-sst2"


def documented_query(marker: str) -> str:
    """The ```sql block of the docs' SQL page that starts with ``marker``."""
    for block in re.findall(r"```sql\n(.*?)```", SQL_PAGE.read_text(), flags=re.DOTALL):
        if block.startswith(marker):
            return block
    raise AssertionError(f"no ```sql block starting with {marker!r} in {SQL_PAGE}")


@pytest.fixture(scope="module")
def engine(committed_database_url: str, minilm_path: Path, shared_dir: Path) -> Iterator[Engine]:
    tuned = shared_dir / "models" / TUNED
    if not tuned.is_dir():
        pytest.skip(f"{tuned} is absent")
    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    run_inline(sessions, "ingest", ingest_request(minilm_path, BASE, samples=32))
    run_inline(sessions, "ingest", ingest_request(tuned, TUNED, samples=32))
    run_inline(sessions, "clustering", {"models": [BASE, TUNED], "k": 4, "seed": 0})
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def api(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as client:
        yield client


def rows(engine: Engine, sql: str, **params: Any) -> list[dict[str, Any]]:
    with engine.connect() as connection:
        return [dict(r._mapping) for r in connection.execute(text(sql), params)]


def test_current_head_types_has_one_row_per_head_with_features_by_name(engine: Engine, api: TestClient) -> None:
    for model in (BASE, TUNED):
        found = rows(engine, "SELECT * FROM current_head_types WHERE model = :m ORDER BY layer, head", m=model)
        assert [(r["layer"], r["head"]) for r in found] == [(la, h) for la in range(6) for h in range(12)]
        current = api.get(f"/models/{model}").json()["current_clustering_id"]
        assert {r["clustering_id"] for r in found} == {current}
        assert all(r["is_current"] for r in found)
        served = {
            (h["layer"], h["head"]): h for h in api.get("/heads", params={"model": model, "limit": 100}).json()["items"]
        }
        for r in found:
            head = served[r["layer"], r["head"]]
            assert r["type"] == head["type"]
            assert [r[name] for name in feature_names(16)] == pytest.approx(list(head["features"].values()))
            assert [r[name] for name in SCALARS] == pytest.approx([head["scalars"][s] for s in SCALARS])


def test_the_views_are_documented_in_the_database(engine: Engine) -> None:
    found = rows(engine, "SELECT obj_description('head_types'::regclass) AS a, "
                         "obj_description('current_head_types'::regclass) AS b")[0]  # fmt: skip
    assert "one row per head" in found["a"]
    assert found["b"]


def test_the_readme_query_lists_the_heads_whose_type_changed(engine: Engine, api: TestClient) -> None:
    changed = rows(engine, documented_query(CHANGED_QUERY))
    assert changed, "fine-tuning on SST-2 changes the type of some heads"
    assert list(changed[0]) == ["layer", "head", BASE, TUNED]
    types = api.get("/compare", params={"models": f"{BASE},{TUNED}"}).json()["types"]
    expected = [
        (la, h, types[BASE][la][h], types[TUNED][la][h])
        for la in range(6)
        for h in range(12)
        if types[BASE][la][h] != types[TUNED][la][h]
    ]
    assert [tuple(r.values()) for r in changed] == expected
    assert 0 < len(changed) < 72  # fine-tuning moves some heads, not all


def test_the_readme_count_query_agrees_with_the_comparison(engine: Engine, api: TestClient) -> None:
    counted = rows(engine, documented_query(COUNTS_QUERY))
    comparison = api.get("/compare", params={"models": f"{BASE},{TUNED}"}).json()
    transitions = comparison["counts"][0]["transitions"]
    assert {(r[BASE], r[TUNED]): r["heads"] for r in counted} == {
        (before, after): n for before, row in transitions.items() for after, n in row.items()
    }
    assert sum(r["heads"] for r in counted) == 72
    assert sum(r["heads"] for r in counted if r[BASE] != r[TUNED]) == comparison["counts"][0]["changed"]
