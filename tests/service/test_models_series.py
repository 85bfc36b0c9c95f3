"""``GET /models`` and ``GET /models/{name}`` say which series a model is a step of, its step, the hub revision
asked for and the commit it resolved to (issue 34); all null for a lone model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from tests.induction_model import save_induction_series
from tests.service.conftest import TINY, ingest_request

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_induction_series(tmp_path_factory.mktemp("models-series"), {0: (0.0, 0.0), 300: (1.0, 1.0)})


def test_a_step_shows_its_series_step_and_revisions_and_a_lone_model_nulls(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int, checkpoints: Path
) -> None:
    for step in (0, 300):
        job = run_inline(sessions, "ingest", ingest_request(checkpoints / f"step-{step}", f"grow-{step}", samples=4,
                                                            max_length=32, series="grow", step=step))  # fmt: skip
        assert job.status == "succeeded", job.error
    with sessions() as session, session.begin():  # as an ingest of --revision step300 stores it (no hub here)
        session.execute(text(f"UPDATE models SET requested_revision = 'step300', revision = '{COMMIT}' "
                             "WHERE name = 'grow-300'"))  # fmt: skip
    fields = ("series", "step", "requested_revision", "revision")
    expected = {
        TINY: (None, None, None, None),
        "grow-0": ("grow", 0, None, None),
        "grow-300": ("grow", 300, "step300", COMMIT),
    }
    listed = client.get("/models")
    assert listed.status_code == 200
    assert {m["name"]: tuple(m[f] for f in fields) for m in listed.json()} == expected
    for name, values in expected.items():
        detail = client.get(f"/models/{name}")
        assert detail.status_code == 200
        assert tuple(detail.json()[f] for f in fields) == values
    series = client.get("/series/grow").json()
    assert [(i["model"], i["step"]) for i in series["items"]] == [("grow-0", 0), ("grow-300", 300)]
