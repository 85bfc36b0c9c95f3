"""The web page in a real headless Chromium: the grid of a model, a head, an unclustered model,
the comparison view, and nothing loaded from anywhere but headcat. First, without a browser,
the read endpoints the page needs (a head, examples per type, ``/compare``) and its assets.

Needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``HEADCAT_CHROMIUM``) and the
``playwright`` package (``.ci/run`` installs both); skips, saying why, without them.
``HEADCAT_SCREENSHOTS=1`` also ingests ``minilm-squad``, with 128 samples per model, and writes
``docs/screenshots/model.png`` and ``compare.png``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from service.web.endpoints import bin_labels
from service.web.palette import FALLBACK_COLORS, TYPE_COLORS, UNTYPED_COLOR, color_for, palette
from tests.conftest import SHARED
from tests.service.conftest import TINY, ingest_request
from tests.service.test_syntax import GOLD
from tests.waiting import PATIENCE, wait_until

CHROMIUM = Path(os.environ.get("HEADCAT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip
SCREENSHOTS = os.environ.get("HEADCAT_SCREENSHOTS") == "1"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
BASE = "minilm"
UNCLUSTERED = "tiny-raw"


def to_fixed(value: float, digits: int = 1) -> str:
    """JavaScript's ``value.toFixed(digits)`` for a positive number: the double's exact decimal value rounded
    half up (31.25 gives 31.3), where Python's format rounds half to even (31.2)."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


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
def tiny_catalog(
    committed_database_url: str, tiny_bert_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A committed catalog for the module: ``tiny`` and ``tiny-2`` (same shape, other random
    weights) clustered jointly, ``tiny-3`` (3 layers) clustered alone, ``tiny-raw`` unclustered."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    sources = {TINY: tiny_bert_path, UNCLUSTERED: tiny_bert_path}
    for name, layers, seed in (("tiny-2", 2, 1), ("tiny-3", 3, 2)):
        torch.manual_seed(seed)
        sources[name] = tmp_path_factory.mktemp(name)
        BertModel(BertConfig.from_pretrained(tiny_bert_path, num_hidden_layers=layers)).eval().save_pretrained(
            sources[name]
        )
        AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(sources[name])
    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    for name, source in sources.items():
        run_inline(sessions, "ingest", ingest_request(source, name, samples=16))
    run_inline(sessions, "clustering", {"models": [TINY, "tiny-2"], "k": 4, "seed": 0})
    run_inline(sessions, "clustering", {"models": ["tiny-3"], "k": 2, "seed": 0})
    gold = tmp_path_factory.mktemp("parses") / "gold.conllu"
    gold.write_text("\n".join([GOLD] * 5))  # 10 sentences: each relation has the 5 pairs the page asks for
    run_inline(sessions, "syntax", {"model": TINY, "parses": str(gold), "device": "cpu"})
    measured(sessions, tiny_bert_path, tmp_path_factory)
    yield engine
    engine.dispose()


MEASURED = "tiny-measured"


def measured(sessions: sessionmaker[Any], tiny_bert_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``tiny-measured``: clustered (attention features), one attribution run of 1 sample on 2 queries with 1
    probe, a global-vector clustering of it, and one-step pruning curves (drift)."""
    for kind, request in (
        ("ingest", ingest_request(tiny_bert_path, MEASURED, samples=8)),
        ("clustering", {"models": [MEASURED], "k": 2, "seed": 0}),
        ("attribution", {"model": MEASURED, "samples": 1, "max_length": 16, "queries": 2, "probes": 1,
                         "device": "cpu"}),
        ("clustering", {"models": [MEASURED], "k": 2, "seed": 0, "vector": "global"}),
        ("pruning", {"model": MEASURED, "data": "builtin:wiki", "limit": 4, "rankings": ["random"], "steps": 1,
                     "max_length": 32, "device": "cpu"}),
    ):  # fmt: skip
        job = run_inline(sessions, kind, request)
        assert job.status == "succeeded", (kind, job.error)


@pytest.fixture(scope="module")
def catalog(
    tiny_catalog: Engine, minilm_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Engine, list[str]]:
    """Added to the tiny catalog: MiniLM and one (or, for screenshots, two) fine-tunes clustered
    jointly, with a stability run. Returns the engine and the jointly clustered models."""
    samples = 128 if SCREENSHOTS else 32
    sources: dict[str, Path] = {BASE: minilm_path}
    for task in ("sst2", "squad") if SCREENSHOTS else ("sst2",):
        if (SHARED / "models" / f"minilm-{task}").is_dir():
            sources[f"minilm-{task}"] = SHARED / "models" / f"minilm-{task}"
    if len(sources) == 1:
        sources["minilm-sharpened"] = sharpened_minilm(minilm_path, tmp_path_factory.mktemp("sharpened"))
    sessions = sessionmaker(bind=tiny_catalog, expire_on_commit=False)
    for name, source in sources.items():
        run_inline(sessions, "ingest", ingest_request(source, name, samples=samples, max_length=128))
    clustering = run_inline(sessions, "clustering", {"models": list(sources), "k": 4, "seed": 0}).result or {}
    run_inline(sessions, "stability", {"clustering_id": clustering["clustering_id"], "n_runs": 10, "fraction": 0.5,
                                       "seed": 0})  # fmt: skip
    return tiny_catalog, list(sources)


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
    wait_until(lambda: running.started or not thread.is_alive(), "uvicorn starting", poll=0.05)
    assert thread.is_alive(), "uvicorn stopped before it started"
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
        page.set_default_timeout(PATIENCE * 1000)
        seen: dict[str, Any] = {"page": page, "requests": [], "errors": []}
        page.on("request", lambda request: seen["requests"].append(request.url))
        page.on("pageerror", lambda error: seen["errors"].append(str(error)))
        yield seen
        context.close()


def get(server: str, path: str) -> Any:
    with urllib.request.urlopen(f"{server}{path}", timeout=PATIENCE) as answer:
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


@pytest.mark.slow
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
    # hatched cells: the heads whose type fewer than 9 of 10 stability fits give (the latest run's agreement)
    items = get(server, f"/heads?model={BASE}&limit=1000")["items"]
    assert all(h["agreement"] is not None for h in items)
    uncertain = {(h["layer"], h["head"]) for h in items if h["agreement"] < 0.9}
    hatched = page.eval_on_selector_all(
        "svg.grid rect.hatch", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head, r.getAttribute('fill')])"
    )
    assert {(layer, head) for layer, head, _ in hatched} == uncertain
    assert all(fill.startswith("url(#hatch-") for _, _, fill in hatched)
    assert page.locator("svg.grid rect.cell.uncertain").count() == len(uncertain)
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
    assert f"{to_fixed(100 * clustering['stability'][0]['score'])} %" in page.locator("p.big").inner_text()
    link = page.locator("a.export-link")
    assert link.get_attribute("href") == f"/models/{BASE}/export?format=prune_heads"


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_unclustered_model_has_a_grey_grid(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{UNCLUSTERED}")
    page.wait_for_selector("svg.grid rect.cell")
    cells = grid_cells(page)
    assert len(cells) == 2 * 4
    assert {c["fill"] for c in cells} == {UNTYPED_COLOR}
    assert {c["type"] for c in cells} == {None}
    assert "not been clustered" in page.locator("main").inner_text()


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_home_page_has_a_legend_for_its_type_bars(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/")
    page.wait_for_selector("td.shares svg.sharebar rect")
    items = page.locator("p.type-legend .legend-item")
    assert [items.nth(i).get_attribute("data-type") for i in range(items.count())] == list(TYPE_COLORS)
    assert items.first.locator(".swatch").evaluate("s => getComputedStyle(s).backgroundColor") == rgb(
        TYPE_COLORS[next(iter(TYPE_COLORS))]
    )


@pytest.mark.slow
def test_a_head_in_one_clustering_prints_no_null(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/tiny-3/head/0/1")  # tiny-3 is in one clustering, of itself alone
    page.wait_for_function("document.querySelector('#head-title')?.textContent.startsWith('Layer 0, head 1')")
    assert len(get(server, "/models/tiny-3/heads/0/1")["history"]) == 1
    assert "null" not in page.locator("#head-panel").inner_text()


@pytest.mark.slow
def test_the_pruning_curve_has_axis_titles_and_round_ticks(
    browser: dict[str, Any], server: str, tmp_path: Path
) -> None:
    """Ticks at whole steps of 1, 2 or 5 x 10^n covering every point and the baseline (not the data's own
    rounded min, mid and max), and a title on each axis."""
    page = browser["page"]
    page.goto(f"{server}/#/model/{MEASURED}")
    page.wait_for_selector("#importance-card svg.curves")
    plot = page.locator("#importance-card svg.curves")
    ticks = [Decimal(t) for t in plot.locator("text.y-tick").all_text_contents()]
    x_ticks = plot.locator("text.x-tick").all_text_contents()
    titles = plot.locator("text.axis-title").all_text_contents()
    curve = get(server, f"/models/{MEASURED}/pruning-curves?limit=1")[0]
    values = [p["metrics"][curve["metric"]] for line in curve["curves"] for p in line["points"]]
    values.append(curve["baseline"][curve["metric"]])
    step = ticks[1] - ticks[0]
    assert step.normalize().as_tuple().digits in ((1,), (2,), (5,)), f"step {step} is not 1, 2 or 5 x 10^n"
    assert all(b - a == step for a, b in zip(ticks, ticks[1:], strict=False)), ticks
    assert all(t % step == 0 for t in ticks), ticks
    assert ticks[0] <= min(values)
    assert ticks[-1] >= max(values)
    assert (x_ticks[0], x_ticks[-1]) == ("0%", "50%")
    assert titles == ["share of heads pruned", curve["metric"]]
    shot = (DOCS if SCREENSHOTS else tmp_path) / "pruning-curve.png"
    page.mouse.move(0, 0)
    page.locator("#importance-card").screenshot(path=str(shot))
    assert shot.stat().st_size > 5_000


@pytest.mark.slow
def test_the_attribution_card_counts_in_words(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{MEASURED}")
    facts = page.locator("p.facts span").filter(has_text=re.compile(r"^run #"))
    facts.wait_for()
    run = get(server, f"/models/{MEASURED}/attributions?limit=1")[0]
    assert facts.inner_text() == f"run #{run['id']}: 1 sample, 2 queries, 1 probe"


@pytest.mark.slow
def test_a_head_s_history_says_what_each_clustering_clustered(browser: dict[str, Any], server: str) -> None:
    """A global-vector clustering is named as one, beside the attention-feature one; a joint one names its
    models as joint."""
    page = browser["page"]
    page.goto(f"{server}/#/model/{MEASURED}/head/0/1")
    page.wait_for_function("document.querySelector('#head-title')?.textContent.startsWith('Layer 0, head 1')")
    history = get(server, f"/models/{MEASURED}/heads/0/1")["history"]
    assert [h["vector"] for h in history] == ["local", "global"]
    rows = page.locator("#head-panel table.compact").last.locator("tr").all_inner_texts()
    assert [row.split("\t")[-1] for row in rows] == [
        "kmeans, k = 2, seed 0, on attention features; tiny-measured",
        "kmeans, k = 2, seed 0, on global vectors (attribution); tiny-measured",
    ]
    page.goto(f"{server}/#/model/{TINY}/head/0/1")
    page.wait_for_function("document.querySelector('#head-title')?.textContent.startsWith('Layer 0, head 1')")
    joint = page.locator("#head-panel table.compact").last.locator("tr").all_inner_texts()
    assert joint[0].split("\t")[-1] == f"kmeans, k = 4, seed 0, on attention features; joint: {TINY}, tiny-2"


@pytest.mark.slow
def test_the_syntax_heat_map_labels_its_rows_and_columns(browser: dict[str, Any], server: str) -> None:
    page = browser["page"]
    page.goto(f"{server}/#/model/{TINY}")
    page.wait_for_selector("figure.syntax-map canvas.heatmap")
    syntax = get(server, f"/models/{TINY}/syntax?min_count=5")
    assert syntax["best"]
    rows = page.locator("figure.syntax-map .matrix-row").all_inner_texts()
    assert rows == [b["relation"] for b in syntax["best"]]
    columns = page.locator("figure.syntax-map .matrix-column").all_inner_texts()
    assert columns == [f"L{layer}" for layer in range(syntax["layers"])]
    # each label stands beside (row) or above (column) its part of the plot
    canvas = page.locator("figure.syntax-map canvas.heatmap").bounding_box()
    last = page.locator("figure.syntax-map .matrix-row").last.bounding_box()
    assert canvas is not None
    assert last is not None
    assert last["y"] + last["height"] == pytest.approx(canvas["y"] + canvas["height"], abs=3)


@pytest.mark.slow
def test_everything_comes_from_headcat_and_nothing_failed(browser: dict[str, Any], server: str) -> None:
    assert browser["requests"]
    elsewhere = [url for url in browser["requests"] if not url.startswith(server + "/")]
    assert elsewhere == []
    assert browser["errors"] == []


# --- the page's endpoints, without a browser ---------------------------------------------------


@pytest.fixture(scope="module")
def api(tiny_catalog: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(tiny_catalog)) as client:
        yield client


def test_a_head_in_detail(api: TestClient) -> None:
    client = api
    head = client.get(f"/models/{TINY}/heads/1/2").json()
    listed = next(
        h for h in client.get("/heads", params={"model": TINY}).json()["items"] if (h["layer"], h["head"]) == (1, 2)
    )
    assert (head["model"], head["layer"], head["head"], head["num_layers"], head["num_heads"]) == (TINY, 1, 2, 2, 4)
    assert head["type"] == listed["type"]
    assert head["features"] == listed["features"]
    assert head["scalars"] == listed["scalars"]
    assert list(head["centroid"]) == list(head["features"])
    distance = client.get(f"/models/{TINY}/export", params={"format": "scores", "score": "centroid_distance"}).json()
    assert head["centroid_distance"] == pytest.approx(distance[1][2])
    assert [(h["clustering_id"], h["current"], h["models"]) for h in head["history"]] == [
        (head["clustering_id"], True, [TINY, "tiny-2"])
    ]
    example = head["example"]
    side = len(example["map"])
    assert 1 <= side <= 32
    assert all(len(row) == side for row in example["map"])
    assert len(example["labels"]) == side
    assert example["labels"] == bin_labels(example["tokens"], side)
    assert example["tokens"][0] == "[CLS]"


def test_type_examples_are_the_heads_nearest_their_centroid(api: TestClient) -> None:
    answer = api.get(f"/models/{TINY}/type-examples", params={"per_type": 2}).json()
    scores = api.get(f"/models/{TINY}/export", params={"format": "scores", "score": "centroid_distance"}).json()
    heads = api.get("/heads", params={"model": TINY}).json()["items"]
    for kind, picks in answer["types"].items():
        of_type = sorted(scores[h["layer"]][h["head"]] for h in heads if h["type"] == kind)
        assert [p["centroid_distance"] for p in picks] == pytest.approx(of_type[:2])
        assert all(p["map"] for p in picks)
    assert set(answer["types"]) == {h["type"] for h in heads}
    assert answer["labels"]
    assert api.get(f"/models/{TINY}/type-examples", params={"per_type": 0}).status_code == 422


def test_compare_lists_the_changed_heads_and_counts(api: TestClient) -> None:
    answer = api.get("/compare", params={"models": f"{TINY},tiny-2"}).json()
    assert answer["baseline"] == TINY
    assert answer["joint"] is True
    for name in (TINY, "tiny-2"):
        items = api.get("/heads", params={"model": name}).json()["items"]
        assert answer["types"][name] == [[h["type"] for h in items if h["layer"] == layer] for layer in range(2)]
    a, b = answer["types"][TINY], answer["types"]["tiny-2"]
    changed = [(la, h) for la in range(2) for h in range(4) if a[la][h] != b[la][h]]
    assert [(c["layer"], c["head"]) for c in answer["changed"]] == changed
    counts = answer["counts"][0]
    assert counts["model"] == "tiny-2"
    assert counts["changed"] == len(changed) == sum(counts["by_layer"])
    assert sum(n for row in counts["transitions"].values() for n in row.values()) == counts["total"] == 8
    repeated = api.get("/compare", params=[("models", TINY), ("models", "tiny-2")]).json()
    assert repeated == answer


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({}, 422, "models"),
        ({"models": TINY}, 422, "models"),
        ({"models": f"{TINY},{TINY}"}, 422, "models"),
        ({"models": f"{TINY},nope"}, 404, "models"),
        ({"models": f"{TINY},tiny-3"}, 422, "models"),  # 2 x 4 against 3 x 4
        ({"models": f"{TINY},tiny-2", "clustering": 999999}, 404, "clustering"),
        ({"models": f"{TINY},tiny-2", "clustering": "x"}, 422, "clustering"),
    ],
)
def test_compare_bad_input_is_4xx_naming_the_field(
    api: TestClient, params: dict[str, Any], status: int, field: str
) -> None:
    answer = api.get("/compare", params=params)
    assert answer.status_code == status, answer.text
    assert field in answer.text


def test_compare_needs_clustered_models_and_a_clustering_of_them(api: TestClient) -> None:
    answer = api.get("/compare", params={"models": f"{TINY},tiny-raw"})
    assert answer.status_code == 422
    assert "not been clustered" in answer.json()["detail"]
    alone = api.get("/models/tiny-3").json()["current_clustering_id"]
    answer = api.get("/compare", params={"models": f"{TINY},tiny-2", "clustering": alone})
    assert answer.status_code == 422
    assert answer.json()["field"] == "clustering"


@pytest.mark.parametrize(
    ("path", "status", "field"),
    [
        (f"/models/{TINY}/heads/2/0", 422, "layer"),
        (f"/models/{TINY}/heads/0/4", 422, "head"),
        (f"/models/{TINY}/heads/-1/0", 422, "layer"),
        (f"/models/{TINY}/heads/0/x", 422, "head"),
        ("/models/nope/heads/0/0", 404, "name"),
        (f"/models/{TINY}/heads/0/0?clustering=999999", 404, "clustering"),
        ("/models/nope/type-examples", 404, "name"),
    ],
)
def test_head_bad_input_is_4xx_naming_the_field(api: TestClient, path: str, status: int, field: str) -> None:
    answer = api.get(path)
    assert answer.status_code == status, answer.text
    assert field in answer.text


def test_an_unclustered_head_has_no_type_and_no_examples(api: TestClient) -> None:
    head = api.get(f"/models/{UNCLUSTERED}/heads/0/0").json()
    assert (head["type"], head["clustering_id"], head["centroid"], head["stable"], head["history"]) == (
        None, None, None, None, [],
    )  # fmt: skip
    assert head["example"]["map"]
    assert api.get(f"/models/{UNCLUSTERED}/type-examples").json()["types"] == {}


def test_the_page_and_its_assets_are_served_by_headcat(api: TestClient) -> None:
    client = api
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    sources = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
    assert sources
    for source in sources:
        assert source.startswith("/"), source  # nothing from another host
        answer = client.get(source)
        assert answer.status_code == 200, source
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    for bad in ("/static/nope.js", "/static/..%2Fendpoints.py", "/static/%2E%2E%2F__init__.py"):
        assert client.get(bad).status_code == 404, bad
    assert client.get("/palette.json").json() == palette()
    for asset in ("app.js", "plots.js", "app.css", "index.html"):
        text = client.get(f"/static/{asset}").text
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text


@pytest.mark.parametrize(
    ("tokens", "bins", "labels"),
    [
        (["a", "b", "c"], 3, ["a", "b", "c"]),
        (["a", "b", "c", "d"], 2, ["a b", "c d"]),
        (["a", "b", "c"], 2, ["a b", "b c"]),  # adaptive pooling: bins overlap when L is not a multiple
        ([], 0, []),
    ],
)
def test_bin_labels_follow_adaptive_pooling(tokens: list[str], bins: int, labels: list[str]) -> None:
    assert bin_labels(tokens, bins) == labels


def test_colours_are_fixed_for_the_four_types_and_stable_for_others() -> None:
    assert [color_for(t) for t in ("dense", "diagonal", "dense_vertical", "vertical")] == list(TYPE_COLORS.values())
    assert color_for(None) == UNTYPED_COLOR
    assert color_for("cluster_0") != color_for("cluster_1")
    assert color_for("cluster_5") == color_for("cluster_5")
    assert color_for("something") in FALLBACK_COLORS
