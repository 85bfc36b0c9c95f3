"""Nothing silently accepted: an unknown body field is a 422 naming it and the allowed ones; a CLI option out of its
range, or a taken port, is one line and exit 2 before anything runs (no job row, no server started)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from service.app import create_app
from service.errors import RequestBody, fields_at, validation_error
from service.orm import Job
from tests.service.conftest import TINY
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]


def _body_models() -> list[tuple[str, type]]:
    from sqlalchemy import create_engine

    app = create_app(create_engine("postgresql+psycopg://unused@127.0.0.1/unused"))
    found = []

    def walk(routes: list[object]) -> None:
        for route in routes:
            if isinstance(route, APIRoute):
                for param in route.dependant.body_params:
                    found.append((f"{sorted(route.methods)[0]} {route.path}", param.field_info.annotation))
            inner = getattr(route, "original_router", None) or getattr(route, "router", None)
            if inner is not None and inner is not route:
                walk(inner.routes)

    walk(app.router.routes)
    return found


def test_every_request_body_forbids_unknown_fields() -> None:
    bodies = _body_models()
    assert len(bodies) >= 8, bodies  # ingests, clusterings, stability, ablations, attributions, syntax, ...
    for route, model in bodies:
        models = [m for m in getattr(model, "__args__", (model,)) if m is not type(None)]
        for each in models:
            assert issubclass(each, RequestBody), f"{route}: {each} takes unknown fields"


def test_an_unknown_body_field_is_a_422_naming_it_and_the_allowed_ones(client: TestClient) -> None:
    answer = client.post("/clusterings", json={"models": [TINY], "kk": 4})
    assert answer.status_code == 422, answer.text
    assert answer.json() == {
        "detail": "kk: unknown field (allowed: models, series, feature_runs, algorithm, k, seed, stacks, vector)",
        "field": "kk",
    }
    row = {"ops": {"prune": {"heads": [[0, 0]]}}, "lable": "x"}
    nested = client.post("/ablations", json={"model": TINY, "task": "drift", "data": "builtin:wiki", "plan": [row]})
    assert nested.status_code == 422, nested.text
    assert "plan: at plan.0.lable: unknown field (allowed: id, label, ops)" in nested.json()["detail"]
    assert nested.json()["field"] == "plan"


def test_fields_at_follows_lists_and_unions_to_the_nested_model() -> None:
    from service.ablations.schemas import AblationCreate

    assert fields_at(AblationCreate, ["plan", "0"]) == ["id", "label", "ops"]
    assert fields_at(AblationCreate, ["model"]) is None  # a string, not a model
    assert fields_at(AblationCreate, ["nope"]) is None
    errors = [{"type": "extra_forbidden", "loc": ("body", "x"), "msg": "Extra inputs are not permitted", "input": 1}]
    assert validation_error(errors) == ("x: unknown field", "x")  # no model to list the allowed ones from


def _headcat(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url}
    env.pop("COLUMNS", None)  # a pipe: the line must not be wrapped
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=PATIENCE)  # fmt: skip


def _jobs(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(select(func.count()).select_from(Job)) or 0)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["stability", "1", "--runs", "-3"], "error: --runs: Input should be greater than or equal to 2 (got -3)"),
        (["stability", "1", "--fraction", "5"], "error: --fraction: Input should be less than or equal to 1 (got 5.0)"),
        (["stability", "999"], "error: clustering: no clustering with id 999"),
        (
            ["quickstart", "--samples", "-1", "--no-serve"],
            "error: --samples: Input should be greater than or equal to 1 (got -1)",
        ),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2_before_any_job(
    catalog_engine: Engine, committed_database_url: str, args: list[str], line: str
) -> None:
    before = _jobs(catalog_engine)
    done = _headcat(*args, url=committed_database_url)
    assert done.returncode == 2, done.stderr
    assert [x for x in done.stderr.splitlines() if x.startswith("error:")] == [line], done.stderr
    assert "Traceback" not in done.stderr
    assert _jobs(catalog_engine) == before


@pytest.mark.parametrize("command", [["serve"], ["quickstart", "--samples", "8"]])
def test_a_taken_port_is_refused_first_naming_the_process_that_holds_it(
    catalog_engine: Engine, committed_database_url: str, command: list[str]
) -> None:
    before = _jobs(catalog_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _headcat(*command, "--port", str(port), url=committed_database_url)
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()
    assert said[-1].startswith(f"error: --port: 127.0.0.1:{port} is already in use by pid {os.getpid()} ("), said
    assert said[-1].endswith("); stop it or choose another --port"), said
    assert len(said) == 1, said  # nothing was started before the check: no log line
    assert _jobs(catalog_engine) == before
