"""The series card of the web page (issue 34, ``service/web/static/series.js``): the head grid of a series
coloured by each head's formation step for a chosen role, the chosen head's score over the steps on a
log-step axis with the repeat gain and losses where measured ('not measured' otherwise), and the types over
the steps as a stacked band.

A series of four checkpoints of the hand-set induction circuit is ingested here; the card is rendered from
what the endpoints serve (``GET /models/{name}``, ``GET /series/{name}``, ``GET /series/{name}/heads``) before
any detection, then after three of the four steps are detected and every step clustered jointly, under
node with a small DOM of its own (``series_card_harness.js``), so it runs without a browser (skips without
node); and once in a real headless Chromium, as tests/service/test_detections_web.py does (skips, saying why,
without one)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from service.web.palette import palette
from tests.induction_model import save_induction_series
from tests.service.conftest import ingest_request
from tests.service.workers import wait_until
from tests.waiting import PATIENCE

STATIC = Path(__file__).resolve().parents[2] / "service" / "web" / "static"
SERIES = "grow"
STEPS = {0: (0.0, 0.0), 10: (0.5, 0.0), 100: (1.0, 1.0), 1000: (1.0, 1.0)}
DETECTED = (0, 10, 100)  # step 1000 is left without a detection run: its gain and loss are not measured
MODEL = f"{SERIES}-step-100"
STOPS = ((68, 1, 84), (33, 145, 140), (253, 231, 37))  # viridis' ends and middle, as the card's hint says
ROLES = ("induction", "duplicate_token", "previous_token", "sink")


def node_binary() -> str:
    binary = shutil.which("node")
    if binary is None:
        pytest.skip("node is absent")
    return binary


def expected_color(step: int | None, first: int, last: int) -> str:
    """Grey when not formed; else dark purple (first step) to yellow (last) by log10(1 + step), in two halves."""
    if step is None:
        return "#eeeeee"
    span = math.log10(1 + last) - math.log10(1 + first)
    t = 0.0 if span <= 0 else min(1.0, max(0.0, (math.log10(1 + step) - math.log10(1 + first)) / span))
    i = min(1, int(t * 2))
    f = t * 2 - i
    mixed = [math.floor(a + (b - a) * f + 0.5) for a, b in zip(STOPS[i], STOPS[i + 1], strict=True)]
    return f"rgb({mixed[0]}, {mixed[1]}, {mixed[2]})"


def run_node(program: str) -> Any:
    done = subprocess.run([node_binary(), "-e", program], capture_output=True, text=True, timeout=PATIENCE,
                          check=False, cwd=STATIC)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_formation_colours_and_the_log_step_ticks_under_node() -> None:
    cases = [(s, 0, 4000) for s in (0, 10, 63, 250, 1000, 4000)] + [(None, 0, 10), (500, 500, 500), (7, 5, 9)]
    program = (f"const s = require('./series.js'); const cases = {json.dumps(cases)};"
               "console.log(JSON.stringify(cases.map(([a, b, c]) => s.formationColor(a, b, c))));")  # fmt: skip
    assert run_node(program) == [expected_color(*case) for case in cases]
    ranges = [(0, 4000), (0, 900), (100, 300), (250, 4000), (110, 190), (0, 0), (1, 143000)]
    ticks = run_node(f"const s = require('./series.js'); const ranges = {json.dumps(ranges)};"
                     "console.log(JSON.stringify(ranges.map(([a, b]) => s.logStepTicks(a, b))));")  # fmt: skip
    assert ticks[0] == [0, 1, 10, 100, 1000]
    assert ticks[2] == [100, 200]  # one power of ten inside: 2 and 5 times them join it
    assert ticks[3] == [500, 1000, 2000]
    assert ticks[6] == [1, 10, 100, 1000, 10000, 100000]
    for (lo, hi), found in zip(ranges, ticks, strict=True):
        assert found, (lo, hi)
        assert all(lo <= t <= hi for t in found), (lo, hi, found)
        for t in found:  # round: 0, or 1, 2 or 5 times a power of ten (or a round linear step inside)
            mantissa = t / 10 ** math.floor(math.log10(t)) if t else 1
            assert min(abs(mantissa - m) for m in (1, 1.5, 2, 5)) < 1e-9, (lo, hi, t)


# --- the card, rendered from the served JSON under node ----------------------------------------------------

HARNESS = Path(__file__).with_name("series_card_harness.js")


def render(responses: dict[str, Any], model: str) -> Any:
    done = subprocess.run([node_binary(), str(HARNESS)], input=json.dumps({"responses": responses, "model": model,
                          "palette": palette()}), capture_output=True, text=True, timeout=PATIENCE, check=False,
                          cwd=STATIC)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def served(client: TestClient, model: str) -> dict[str, Any]:
    """What the card reads, as the endpoints serve it now."""
    paths = [f"/models/{model}", f"/series/{SERIES}", *(f"/series/{SERIES}/heads?score={r}" for r in ROLES)]
    answers = {path: client.get(path) for path in paths}
    for path, answer in answers.items():
        assert answer.status_code == 200, (path, answer.text)
    return {path: answer.json() for path, answer in answers.items()}


@pytest.fixture
def series_client(
    client: TestClient, sessions: sessionmaker[Session], tmp_path_factory: pytest.TempPathFactory
) -> TestClient:
    directory = save_induction_series(tmp_path_factory.mktemp("series-web"), STEPS)
    for step in STEPS:
        request = ingest_request(directory / f"step-{step}", f"{SERIES}-step-{step}", samples=4, max_length=32,
                                 series=SERIES, step=step)  # fmt: skip
        job = run_inline(sessions, "ingest", request)
        assert job.status == "succeeded", job.error
    return client


def test_the_card_of_a_series_step_from_the_served_data(
    series_client: TestClient, sessions: sessionmaker[Session]
) -> None:
    client = series_client
    # A lone model has no card.
    lone = served(client, MODEL)
    lone[f"/models/{MODEL}"] = {**lone[f"/models/{MODEL}"], "series": None, "step": None}
    assert render(lone, MODEL) is None

    # Before any detection or clustering: a grey grid, and nothing drawn that was not measured.
    bare = render(served(client, MODEL), MODEL)["first"]
    assert {fill for *_, fill, _ in bare["cells"]} == {"#eeeeee"}
    assert len(bare["cells"]) == 4  # 2 layers x 2 heads
    assert bare["notMeasured"] == ["score", "gain", "types"]
    assert bare["points"] == []

    for step in DETECTED:
        job = run_inline(sessions, "detection", {"model": f"{SERIES}-step-{step}", "sequences": 4, "length": 10,
                                                 "device": "cpu"})  # fmt: skip
        assert job.status == "succeeded", job.error
    job = run_inline(sessions, "clustering", {"models": [f"{SERIES}-step-{s}" for s in STEPS], "k": 2, "seed": 0})
    assert job.status == "succeeded", job.error
    data = served(client, MODEL)
    seen = render(data, MODEL)
    series = data[f"/series/{SERIES}"]
    for view, role in (("first", "induction"), ("previous", "previous_token"), ("clicked", "previous_token")):
        card = seen[view]
        heads = data[f"/series/{SERIES}/heads?score={role}"]
        assert heads["steps"] == list(DETECTED)
        first, last = heads["steps"][0], heads["steps"][-1]
        assert card["role"] == role
        assert {(la, he): fill for la, he, fill, _ in card["cells"]} == {
            (h["layer"], h["head"]): expected_color(h["formed_at"][role], first, last) for h in heads["items"]
        }
        # the head shown: the one clicked, else the earliest formed for the role (else the first)
        formed = sorted((h["formed_at"][role], h["layer"], h["head"]) for h in heads["items"]
                        if h["formed_at"][role] is not None)  # fmt: skip
        chosen = (1, 0) if view == "clicked" else (formed[0][1], formed[0][2]) if formed else (0, 0)
        assert (int(card["head"]["layer"]), int(card["head"]["head"]), card["head"]["role"]) == (*chosen, role)
        assert [c[:2] for c in card["cells"] if c[3]] == [list(chosen)]
        head = next(h for h in heads["items"] if (h["layer"], h["head"]) == chosen)
        assert [(s, v) for line, s, v in card["points"] if line == role] == [
            (p["step"], pytest.approx(p["value"])) for p in head["values"] if p["value"] is not None
        ]
        assert card["formedMark"] == ([] if head["formed_at"][role] is None else [head["formed_at"][role]])
        assert card["threshold"] == 1
        # the repeat gain and losses at the detected steps only, and the step that was not measured said
        runs = {i["step"]: i["detection_run"] for i in series["items"]}
        for line, key in (("repeat gain", "repeat_gain"), ("loss, first copy", "loss_first"),
                          ("loss, later copies", "loss_later")):  # fmt: skip
            assert [(s, v) for name, s, v in card["points"] if name == line] == [
                (s, pytest.approx(runs[s][key])) for s in DETECTED
            ]
        assert "Repeat gain and loss measured at 3 of 4 steps; not measured at step 1,000." in card["hints"]
        assert f"{role} score measured at 3 of 4 steps; not measured at step 1,000." in card["hints"]
        # the types over every step (the joint clustering covers step 1000 too)
        counts: dict[tuple[int, str], int] = {}
        for h in heads["items"]:
            for p in h["values"]:
                counts[p["step"], p["type"]] = counts.get((p["step"], p["type"]), 0) + 1
        assert {(s, t): n for s, t, n in card["band"]} == counts
        assert {s for s, _ in counts} == set(STEPS)
        assert card["notMeasured"] == []
        assert set(card["xTicks"]) <= {"0", "1", "2", "5", "10", "20", "50", "100", "200", "500", "1,000"}
        ticks = card["xTicks"]  # the score, the gain and losses, the types: one step axis
        assert ticks == ["0", "1", "10", "100", "1,000"] * 3
        assert card["titles"].count("training step (log scale)") == 3
        assert {f"{role} score", "nats", "share of heads"} <= set(card["titles"])
        assert f"{MODEL} is step 100 of series {SERIES} (4 steps, 0 to 1,000)." in card["text"]


# --- in a real browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_server(committed_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The four steps ingested, three detected, all clustered, in a committed catalog served by uvicorn."""
    from tests.service.test_web import CHROMIUM

    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is absent: apt-get install chromium (see .ci/run)")
    import uvicorn

    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    directory = save_induction_series(tmp_path_factory.mktemp("series-browser"), STEPS)
    for step in STEPS:
        request = ingest_request(directory / f"step-{step}", f"{SERIES}-step-{step}", samples=4, max_length=32,
                                 series=SERIES, step=step)  # fmt: skip
        assert run_inline(sessions, "ingest", request).status == "succeeded"
    for step in DETECTED:
        detect = {"model": f"{SERIES}-step-{step}", "sequences": 4, "length": 10, "device": "cpu"}
        assert run_inline(sessions, "detection", detect).status == "succeeded"
    cluster = {"models": [f"{SERIES}-step-{s}" for s in STEPS], "k": 2, "seed": 0}
    assert run_inline(sessions, "clustering", cluster).status == "succeeded"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: running.started or not thread.is_alive(), "uvicorn starting", poll=0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)
    engine.dispose()


def test_the_card_in_a_browser(browser_server: str) -> None:
    from tests.service.test_web import CHROMIUM, CHROMIUM_ARGS

    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    with urllib.request.urlopen(f"{browser_server}/series/{SERIES}/heads?score=induction", timeout=PATIENCE) as r:
        heads = json.load(r)
    first, last = heads["steps"][0], heads["steps"][-1]
    with tempfile.TemporaryDirectory(prefix="headcat-chromium-") as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        page = context.new_page()
        page.set_default_timeout(PATIENCE * 1000)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{browser_server}/#/model/{MODEL}")
        page.wait_for_selector('#series-card svg.series-grid[data-role="induction"] rect.cell')
        cells = page.eval_on_selector_all(
            "#series-card svg.series-grid rect.cell",
            "cells => cells.map(c => [+c.dataset.layer, +c.dataset.head, c.getAttribute('fill')])",
        )
        assert {(layer, head): fill for layer, head, fill in cells} == {
            (h["layer"], h["head"]): expected_color(h["formed_at"]["induction"], first, last) for h in heads["items"]
        }
        page.locator('#series-card svg.series-grid rect.cell[data-layer="1"][data-head="0"]').click()
        page.wait_for_selector('#series-head[data-layer="1"][data-head="0"]')
        assert page.locator("#series-head svg.step-plot").count() == 2  # the score, and the gain and losses
        assert page.locator("#series-card svg.type-band rect.band").count() > 0
        banded = page.eval_on_selector_all("#series-card svg.type-band rect.band", "r => r.map(x => x.dataset.type)")
        named = page.eval_on_selector_all(".series-band-holder .legend-item", "s => s.map(x => x.dataset.type)")
        assert sorted(named) == sorted(set(banded))  # every colour of the band named once, no other
        assert "training step (log scale)" in page.locator("#series-card").inner_text()
        if os.environ.get("HEADCAT_CARD_SHOT"):  # a look at the card (a path to write it to), not a check
            page.locator("#series-card").screenshot(path=os.environ["HEADCAT_CARD_SHOT"])
        context.close()
    assert errors == []
