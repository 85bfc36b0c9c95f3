"""The detectors card of the web page (SPEC 10): the grid of a stack coloured by a chosen detector's score,
a mark on the heads with that role, the role badges, and the first sequence's map of a clicked head.
In a real headless Chromium (skips, saying why, without one, as tests/service/test_web.py does); the
colour scale also under node, without a browser."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from tests.induction_model import save_induction_model
from tests.service.conftest import ingest_request
from tests.service.test_web import CHROMIUM, CHROMIUM_ARGS
from tests.service.workers import wait_until
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "service" / "web" / "static" / "detectors.js"
COLORS = {"induction": "#e15759", "duplicate_token": "#f28e2b", "previous_token": "#4e79a7", "sink": "#59a14f"}
NAME = "induct"


def expected_color(score: float, detector: str) -> str:
    """White at 0 to the detector's colour at 1, written here from the card's description."""
    hex_color = COLORS[detector]
    channels = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [int(255 + (c - 255) * min(1.0, max(0.0, score)) + 0.5) for c in channels]  # JS Math.round: half up
    return f"rgb({mixed[0]}, {mixed[1]}, {mixed[2]})"


def test_the_colour_scale_under_node() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is absent")
    cases = [(s, d) for d in COLORS for s in (0.0, 0.25, 0.5, 0.731, 1.0, 1.5, -0.2)]
    program = (f"const d = require({json.dumps(str(SCRIPT))});"
               f"console.log(JSON.stringify({json.dumps(cases)}.map(([s, k]) => d.detectorColor(s, k))));")  # fmt: skip
    done = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=PATIENCE, check=True)
    assert json.loads(done.stdout) == [expected_color(score, detector) for score, detector in cases]


@pytest.fixture(scope="module")
def server(committed_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is absent: apt-get install chromium (see .ci/run)")
    import uvicorn

    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    path = save_induction_model(tmp_path_factory.mktemp("induction-web"))
    run_inline(sessions, "ingest", ingest_request(path, NAME, samples=8, max_length=32))
    run_inline(sessions, "detection", {"model": NAME, "sequences": 4, "length": 10, "device": "cpu"})
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: running.started or not thread.is_alive(), "uvicorn starting", poll=0.05)
    yield f"http://127.0.0.1:{port}", engine
    running.should_exit = True
    thread.join(10)
    engine.dispose()


@pytest.fixture(scope="module")
def page(server: tuple[str, Engine]) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    with tempfile.TemporaryDirectory(prefix="headcat-chromium-") as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        page = context.new_page()
        page.set_default_timeout(30_000)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        yield page, errors
        context.close()


def test_the_card_colours_the_grid_marks_roles_and_shows_a_map(server: tuple[str, Engine], page: Any) -> None:
    import urllib.request

    url, _ = server
    browser, errors = page
    with urllib.request.urlopen(f"{url}/models/{NAME}/detections", timeout=PATIENCE) as answer:
        served = json.load(answer)
    heads = {(h["layer"], h["head"]): h for h in served["heads"]}
    browser.goto(f"{url}/#/model/{NAME}")
    browser.wait_for_selector("#detector-card svg.detector-grid rect.cell")
    for detector in ("induction", "previous_token"):
        browser.select_option("#detector-select", detector)
        browser.wait_for_selector(f'svg.detector-grid[data-detector="{detector}"]')
        cells = browser.eval_on_selector_all(
            "svg.detector-grid rect.cell",
            "cells => cells.map(c => [+c.dataset.layer, +c.dataset.head, c.getAttribute('fill')])",
        )
        assert {(layer, head): fill for layer, head, fill in cells} == {
            key: expected_color(h[detector], detector) for key, h in heads.items()
        }
        marked = browser.locator("svg.detector-grid circle.changed-mark").count()
        assert marked == sum(detector in h["roles"] for h in heads.values()) == 1
    badge = browser.locator('p.role-badge[data-role="induction"]')
    assert badge.get_attribute("data-count") == "1"
    assert "decoder 1-0" in badge.inner_text()
    browser.locator('svg.detector-grid rect.cell[data-layer="0"][data-head="0"]').click()
    browser.wait_for_selector("figure.detector-example canvas.heatmap")
    assert browser.locator("figure.detector-example").get_attribute("data-layer") == "0"
    caption = browser.locator("#detector-card p.hint").last.inner_text()
    run = served["runs"][0]
    assert caption.startswith(f"Detection run #{run['id']}: 4 sequences of 10 random ids × 2 copies (seed 0); ")
    gain = "No repeat gain (not a causal LM)" if run["repeat_gain"] is None else "Repeat gain "
    assert f"a dot marks a head with the role. {gain}" in caption  # a sentence starts with a capital
    assert errors == []
