"""The web page in a real headless Chromium: the grid of a model, a head, an unclustered model,
the comparison view, and nothing loaded from anywhere but headcat.

Needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``HEADCAT_CHROMIUM``) and the
``playwright`` package (``.ci/run`` installs both); skips, saying why, without them.
``HEADCAT_SCREENSHOTS=1`` also ingests ``minilm-squad``, with 128 samples per model, and writes
``docs/screenshots/model.png`` and ``compare.png``.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from service.web.palette import UNTYPED_COLOR, color_for
from tests.conftest import SHARED
from tests.service.conftest import ingest_request

pytestmark = pytest.mark.slow

CHROMIUM = Path(os.environ.get("HEADCAT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip
SCREENSHOTS = os.environ.get("HEADCAT_SCREENSHOTS") == "1"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
BASE = "minilm"
UNCLUSTERED = "tiny"


def rgb(hex_color: str) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def sharpened_minilm(minilm_path: Path, directory: Path) -> Path:
    """A MiniLM whose upper layers' queries are scaled up: a stand-in for a fine-tune when
    ``shared/models`` is absent (same shape, some heads change type)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.encoder.layer[3:]:
            layer.attention.self.query.weight.mul_(3.0)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def catalog(
    committed_database_url: str, minilm_path: Path, tiny_bert_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, list[str]]]:
    """MiniLM and one (or, for screenshots, two) fine-tunes clustered jointly with a stability
    run, and the tiny model left unclustered. Returns the engine and the clustered models."""
    samples = 128 if SCREENSHOTS else 32
    sources: dict[str, Path] = {BASE: minilm_path}
    for task in ("sst2", "squad") if SCREENSHOTS else ("sst2",):
        if (SHARED / "models" / f"minilm-{task}").is_dir():
            sources[f"minilm-{task}"] = SHARED / "models" / f"minilm-{task}"
    if len(sources) == 1:
        sources["minilm-sharpened"] = sharpened_minilm(minilm_path, tmp_path_factory.mktemp("sharpened"))
    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    for name, source in sources.items():
        run_inline(sessions, "ingest", ingest_request(source, name, samples=samples, max_length=128))
    clustering = run_inline(sessions, "clustering", {"models": list(sources), "k": 4, "seed": 0}).result or {}
    run_inline(sessions, "stability", {"clustering_id": clustering["clustering_id"], "n_runs": 10, "fraction": 0.5,
                                       "seed": 0})  # fmt: skip
    run_inline(sessions, "ingest", ingest_request(tiny_bert_path, UNCLUSTERED, samples=16))
    yield engine, list(sources)
    engine.dispose()


@pytest.fixture(scope="module")
def server(catalog: tuple[Engine, list[str]]) -> Iterator[str]:
    """uvicorn serving the catalog on a free port of 127.0.0.1, in a thread."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(create_app(catalog[0]), host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert thread.is_alive(), "uvicorn stopped before it started"
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[dict[str, Any]]:
    """One headless Chromium page, with every request URL and page error it sees."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is absent: apt-get install chromium (see .ci/run)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    with tempfile.TemporaryDirectory(prefix="headcat-chromium-") as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1360, "height": 900},
        )  # fmt: skip
        page = context.new_page()
        page.set_default_timeout(30_000)
        seen: dict[str, Any] = {"page": page, "requests": [], "errors": []}
        page.on("request", lambda request: seen["requests"].append(request.url))
        page.on("pageerror", lambda error: seen["errors"].append(str(error)))
        yield seen
        context.close()


def get(server: str, path: str) -> Any:
    with urllib.request.urlopen(f"{server}{path}", timeout=30) as answer:
        return json.load(answer)


def screenshot(page: Any, name: str, tmp_path: Path) -> Path:
    path = DOCS / name if SCREENSHOTS else tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    page.mouse.move(0, 0)  # no hover outline in the picture
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def grid_cells(page: Any, scope: str = "") -> list[dict[str, Any]]:
    return page.eval_on_selector_all(  # type: ignore[no-any-return]
        f"{scope} svg.grid rect.cell",
        """cells => cells.map(c => ({
            layer: +c.dataset.layer, head: +c.dataset.head, type: c.dataset.type || null, fill: c.getAttribute('fill'),
            computed: getComputedStyle(c).fill, changed: c.classList.contains('changed')}))""",
    )


def test_a_model_shows_one_cell_per_head_in_its_types_colour(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{BASE}")
    page.wait_for_selector("svg.grid rect.cell")
    detail = get(server, f"/models/{BASE}")
    heads = {(h["layer"], h["head"]): h["type"] for h in get(server, f"/heads?model={BASE}&limit=1000")["items"]}
    cells = grid_cells(page)
    assert len(cells) == detail["num_layers"] * detail["num_heads"] == 72
    assert {(c["layer"], c["head"]): c["type"] for c in cells} == heads
    for cell in cells:
        assert cell["fill"] == color_for(cell["type"]), cell
        assert cell["computed"] == rgb(color_for(cell["type"])), cell
    assert len(set(heads.values())) >= 2
    # the rest of the model view: shares per layer, t-SNE of the joint clustering, box plots, maps, stability
    clustering = get(server, f"/clusterings/{detail['current_clustering_id']}")
    assert page.locator("svg.grid rect.share").count() >= detail["num_layers"]
    page.wait_for_selector("svg.scatter circle.dot")
    assert page.locator("svg.scatter circle.dot").count() == len(clustering["tsne"])
    assert page.locator("svg.scatter circle.dot.own").count() == 72
    types = set(heads.values())
    assert {page.locator(f'figure[data-type="{t}"] svg.boxplot').count() for t in types} == {1}
    assert page.locator("svg.boxplot").first.locator("g.box").count() == 21
    typical = sum(min(3, list(heads.values()).count(t)) for t in types)  # up to 3 per type
    assert page.locator("figure.type-maps canvas.heatmap").count() == typical
    assert f"{100 * clustering['stability'][0]['score']:.1f} %" in page.locator("p.big").inner_text()
    link = page.locator("a.export-link")
    assert link.get_attribute("href") == f"/models/{BASE}/export?format=prune_heads"


def test_following_a_head_shows_its_features(browser: dict[str, Any], server: str, tmp_path: Path) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{BASE}")
    page.locator('svg.grid rect.cell[data-layer="3"][data-head="4"]').click()
    page.wait_for_function("document.querySelector('#head-title')?.textContent.startsWith('Layer 3, head 4')")
    assert page.url.endswith(f"#/model/{BASE}/head/3/4")
    head = get(server, f"/models/{BASE}/heads/3/4")
    title = page.locator("#head-title").inner_text()
    assert head["type"].replace("dense_vertical", "dense & vertical") in title
    assert page.locator(".head-panel svg.features rect.bar").count() == 21
    rows = page.eval_on_selector_all(
        ".head-panel tr.feature-row", "rows => rows.map(r => [r.dataset.feature, +r.querySelector('td').textContent])"
    )
    assert [name for name, _ in rows] == list(head["features"])
    assert [value for _, value in rows] == pytest.approx(list(head["features"].values()), abs=1e-4)
    assert page.locator(".head-panel canvas.heatmap").count() == 1
    selected = page.locator("svg.grid rect.cell.selected")
    assert (selected.get_attribute("data-layer"), selected.get_attribute("data-head")) == ("3", "4")
    screenshot(page, "model.png", tmp_path)


def test_an_unclustered_model_has_a_grey_grid(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{UNCLUSTERED}")
    page.wait_for_selector("svg.grid rect.cell")
    cells = grid_cells(page)
    assert len(cells) == 2 * 4
    assert {c["fill"] for c in cells} == {UNTYPED_COLOR}
    assert {c["type"] for c in cells} == {None}
    assert "not been clustered" in page.locator("main").inner_text()


def test_the_comparison_view_marks_the_heads_that_changed_type(
    browser: dict[str, Any], server: str, catalog: tuple[Engine, list[str]], tmp_path: Path
) -> None:
    page = browser["page"]
    models = catalog[1]
    page.goto(f"{server}/#/")
    for name in models:
        page.locator(f'tr[data-model="{name}"] input[type=checkbox]').check()
    page.get_by_role("button", name="Compare selected").click()
    page.wait_for_selector("figure.compare-grid svg.grid")
    assert page.url.endswith("#/compare?models=" + ",".join(models))
    comparison = get(server, "/compare?models=" + ",".join(models))
    assert page.locator("figure.compare-grid").count() == len(models)
    for name in models:
        cells = grid_cells(page, f'figure.compare-grid[data-model="{name}"]')
        types = comparison["types"][name]
        assert len(cells) == 72
        baseline = comparison["types"][BASE]
        for cell in cells:
            layer, head = cell["layer"], cell["head"]
            assert cell["fill"] == color_for(types[layer][head])
            assert cell["changed"] == (types[layer][head] != baseline[layer][head])
    for counts in comparison["counts"]:
        figure = page.locator(f'figure.compare-grid[data-model="{counts["model"]}"]')
        assert figure.locator("rect.cell.changed").count() == counts["changed"]
        assert page.locator(f'table.transitions[data-model="{counts["model"]}"]').count() == 1
    assert page.locator("table.changed tbody tr").count() == len(comparison["changed"])
    screenshot(page, "compare.png", tmp_path)
    page.locator("header nav a", has_text="Compare").click()  # the nav link opens the picker
    page.wait_for_selector("button:has-text('Compare')")


def test_everything_comes_from_headcat_and_nothing_failed(browser: dict[str, Any], server: str) -> None:
    assert browser["requests"]
    elsewhere = [url for url in browser["requests"] if not url.startswith(server + "/")]
    assert elsewhere == []
    assert browser["errors"] == []
