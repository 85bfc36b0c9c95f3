"""``GET /models/{name}/export`` and ``headcat export``: the forms of SPEC section 5, the selection
rules, bad input, and a head_mask export applied to the real MiniLM."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

RAW = "tiny-unclustered"
MINILM = "minilm"


@pytest.fixture(scope="module")
def api(catalog_engine: Engine, tiny_bert_path: Path) -> Iterator[TestClient]:
    """The module's committed catalog: ``tiny`` clustered (conftest) and ``tiny-unclustered``."""
    sessions = sessionmaker(bind=catalog_engine, expire_on_commit=False)
    run_inline(sessions, "ingest", ingest_request(tiny_bert_path, RAW, samples=16))
    with TestClient(create_app(catalog_engine)) as client:
        yield client


@pytest.fixture(scope="module")
def minilm_api(api: TestClient, catalog_engine: Engine, minilm_path: Path) -> TestClient:
    """The same catalog with the real MiniLM ingested (32 samples) and clustered on its own."""
    sessions = sessionmaker(bind=catalog_engine, expire_on_commit=False)
    run_inline(sessions, "ingest", ingest_request(minilm_path, MINILM, samples=32))
    run_inline(sessions, "clustering", {"models": [MINILM], "k": 4, "seed": 0})
    return api


def heads_of(client: TestClient, model: str, **params: Any) -> list[dict[str, Any]]:
    answer = client.get("/heads", params={"model": model, "limit": 1000, **params})
    assert answer.status_code == 200, answer.text
    return answer.json()["items"]


def export(client: TestClient, model: str, fmt: str, **params: Any) -> Any:
    answer = client.get(f"/models/{model}/export", params={"format": fmt, **params})
    assert answer.status_code == 200, answer.text
    if fmt == "head_mask.npy":
        return np.load(io.BytesIO(answer.content), allow_pickle=False)
    return answer.text if fmt == "csv" else answer.json()


def test_every_form_describes_the_same_selection(api: TestClient) -> None:
    heads = heads_of(api, TINY)
    chosen = heads[-1]["type"]
    expected = sorted((h["layer"], h["head"]) for h in heads if h["type"] == chosen)

    prune = export(api, TINY, "prune_heads", type=chosen)
    mask = export(api, TINY, "head_mask", type=chosen)
    npy = export(api, TINY, "head_mask.npy", type=chosen)
    pairs = export(api, TINY, "pairs", type=chosen)
    table = export(api, TINY, "csv", type=chosen).splitlines()

    assert sorted((int(layer), h) for layer, hs in prune.items() for h in hs) == expected
    assert all(hs == sorted(hs) for hs in prune.values())
    assert [tuple(p) for p in pairs] == expected
    assert np.array(mask).shape == (2, 4)
    assert sorted(zip(*np.nonzero(np.array(mask) == 0), strict=True)) == expected  # 0 = pruned
    assert np.isin(np.array(mask), [0, 1]).all()
    assert npy.dtype == np.float32
    assert npy.shape == (2, 4)
    np.testing.assert_array_equal(npy, np.array(mask, dtype=np.float32))
    assert table[0].split(",")[:7] == ["model", "layer", "head", "type", "clustering_id", "feature_run_id",
                                       "score_special"]  # fmt: skip
    assert [(int(r.split(",")[1]), int(r.split(",")[2])) for r in table[1:]] == expected
    assert {r.split(",")[3] for r in table[1:]} == {chosen}


def test_the_csv_gives_every_head_its_scalars_as_get_heads_does(api: TestClient) -> None:
    """Each scalar column of the CSV holds the head's value (the same float as ``GET /heads``), empty only
    where the head has none."""
    import csv

    from ingest.types import SCALARS

    heads = {(h["stack"], h["layer"], h["head"]): h["scalars"] for h in heads_of(api, TINY)}
    rows = list(csv.DictReader(io.StringIO(export(api, TINY, "csv"))))
    assert len(rows) == len(heads) == 8
    assert any(value is not None for scalars in heads.values() for value in scalars.values())
    for row in rows:
        scalars = heads[(row["stack"], int(row["layer"]), int(row["head"]))]
        assert set(scalars) == set(SCALARS)
        for name in SCALARS:
            want = scalars[name]
            assert (row[name] == "") if want is None else (float(row[name]) == want), (name, row[name], want)


def test_margin_and_agreement_scores_of_a_clustered_model(api: TestClient, catalog_engine: Engine) -> None:
    """``score=margin`` of a clustered model gives each head's stored margin; ``score=agreement`` without a
    stability run is refused (422 naming ``score``), not a table of NaN."""
    from sqlalchemy import text

    with catalog_engine.connect() as connection:
        stored = connection.execute(text("SELECT stack, layer, head, margin FROM current_head_types WHERE model = :m"),
                                    {"m": TINY}).all()  # fmt: skip
    assert len(stored) == 8
    assert all(margin is not None for *_, margin in stored)
    margins = export(api, TINY, "scores", score="margin")
    for stack, layer, head, margin in stored:
        value = margins[stack][layer][head] if isinstance(margins, dict) and stack in margins else margins[layer][head]
        assert value == pytest.approx(margin, rel=1e-12)
    answer = api.get(f"/models/{TINY}/export", params={"format": "scores", "score": "agreement"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "score"
    assert "no stability run" in answer.json()["detail"]


def test_headers_say_what_was_exported(api: TestClient) -> None:
    answer = api.get(f"/models/{TINY}/export", params={"format": "head_mask.npy", "layer_ge": 1})
    current = api.get(f"/models/{TINY}").json()["current_clustering_id"]
    assert answer.headers["content-type"] == "application/x-npy"
    assert answer.headers["x-headcat-clustering"] == str(current)
    assert answer.headers["x-headcat-selected"] == "4"
    assert 'filename="tiny-head_mask.npy"' in answer.headers["content-disposition"]


SELECTIONS: list[tuple[dict[str, Any], Callable[[dict[str, Any], list[str]], bool]]] = [
    ({}, lambda h, t: True),
    ({"type": "T0"}, lambda h, t: h["type"] == t[0]),
    ({"type": "T0,T1"}, lambda h, t: h["type"] in t[:2]),
    ({"type": ["T0", "T1"]}, lambda h, t: h["type"] in t[:2]),
    ({"exclude_type": "T0"}, lambda h, t: h["type"] != t[0]),
    ({"type": "T0,T1", "exclude_type": "T1"}, lambda h, t: h["type"] == t[0]),
    ({"layer_ge": 1}, lambda h, t: h["layer"] >= 1),
    ({"layer_gt": 0, "head": 2}, lambda h, t: h["layer"] > 0 and h["head"] == 2),
    ({"layer_lt": 1}, lambda h, t: h["layer"] < 1),
    ({"layer_le": 0, "exclude_type": "T0"}, lambda h, t: h["layer"] <= 0 and h["type"] != t[0]),
    ({"layer_gt": -1, "layer_lt": 2}, lambda h, t: True),
    ({"heads": "1:3, 0:0,1:3"}, lambda h, t: (h["layer"], h["head"]) in {(1, 3), (0, 0)}),
    (
        {"heads": "0:0,0:1,1:1", "type": "T0"},
        lambda h, t: (h["layer"], h["head"]) in {(0, 0), (0, 1), (1, 1)} and h["type"] == t[0],
    ),  # fmt: skip
    ({"heads": ""}, lambda h, t: False),
]


@pytest.mark.parametrize(("params", "keep"), SELECTIONS)
def test_selection_is_every_filter_given(
    api: TestClient, params: dict[str, Any], keep: Callable[[dict[str, Any], list[str]], bool]
) -> None:
    heads = heads_of(api, TINY)
    types = sorted({h["type"] for h in heads}, key=lambda t: [h["type"] for h in heads].index(t))
    types += ["dense", "diagonal", "dense_vertical", "vertical"]  # a second type when tiny has just one
    types = list(dict.fromkeys(types))

    def named(value: Any) -> Any:
        if isinstance(value, list):
            return [named(v) for v in value]
        return value.replace("T0", types[0]).replace("T1", types[1]) if isinstance(value, str) else value

    real = {k: named(v) for k, v in params.items()}
    pairs = export(api, TINY, "pairs", **real)
    assert [tuple(p) for p in pairs] == [(h["layer"], h["head"]) for h in heads if keep(h, types)], real


def test_scores_default_to_special_mass_and_name_any_feature(api: TestClient) -> None:
    heads = {(h["layer"], h["head"]): h for h in heads_of(api, TINY)}
    special = np.array(export(api, TINY, "scores"), dtype=float)
    for (layer, head), h in heads.items():
        f = h["features"]
        assert special[layer, head] == pytest.approx(f["cls"] + f["sep"] + f["period"] + f["comma"])
    entropy = export(api, TINY, "scores", score="entropy", layer_ge=1)
    assert entropy[0] == [None] * 4  # outside the selection
    assert entropy[1] == pytest.approx([heads[1, h]["scalars"]["entropy"] for h in range(4)])
    local = export(api, TINY, "scores", score="local")
    assert local[0][0] == pytest.approx(sum(heads[0, 0]["features"][k] for k in ("self", "w0", "w1")))
    w3 = export(api, TINY, "scores", score="w3")
    assert w3[1][2] == pytest.approx(heads[1, 2]["features"]["w3"])


def test_centroid_distance_is_the_distance_to_the_heads_cluster_centroid(api: TestClient) -> None:
    detail = api.get(f"/models/{TINY}").json()
    clustering = api.get(f"/clusterings/{detail['current_clustering_id']}").json()
    centroids = {c["name"]: np.array(list(c["centroid"].values())) for c in clustering["clusters"]}
    distances = export(api, TINY, "scores", score="centroid_distance")
    for h in heads_of(api, TINY):
        expected = np.linalg.norm(np.array(list(h["features"].values())) - centroids[h["type"]])
        assert distances[h["layer"]][h["head"]] == pytest.approx(expected)


def test_an_older_clustering_can_be_exported(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int
) -> None:
    before = {(h["layer"], h["head"]): h["type"] for h in heads_of(client, TINY)}
    job = run_inline(sessions, "clustering", {"models": [TINY], "k": 2, "seed": 1})
    newer = job.result["clustering_id"] if job.result else None
    assert client.get(f"/models/{TINY}").json()["current_clustering_id"] == newer
    some = next(iter(before.values()))
    old = export(client, TINY, "pairs", type=some, clustering=tiny_clustered)
    assert [tuple(p) for p in old] == sorted(k for k, t in before.items() if t == some)
    answer = client.get(f"/models/{TINY}/export", params={"type": some})  # the k = 2 clustering names differ
    names = {c["name"] for c in client.get(f"/clusterings/{newer}").json()["clusters"]}
    assert answer.status_code == (200 if some in names else 422)


def test_an_unclustered_model_exports_by_position(api: TestClient) -> None:
    answer = api.get(f"/models/{RAW}/export", params={"format": "head_mask", "layer_ge": 1, "head": 0})
    assert answer.status_code == 200
    assert answer.json() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert answer.headers["x-headcat-clustering"] == "none"
    assert len(export(api, RAW, "scores")) == 2
    for params, field in (
        ({"type": "vertical"}, "type"),
        ({"format": "scores", "score": "centroid_distance"}, "score"),
    ):
        answer = api.get(f"/models/{RAW}/export", params=params)
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == field


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"format": "xml"}, 422, "format"),
        ({"format": "head_mask.npz"}, 422, "format"),
        ({"type": "sideways"}, 422, "type"),
        ({"type": "dense,sideways"}, 422, "type"),
        ({"exclude_type": "nope"}, 422, "exclude_type"),
        ({"layer_ge": 2}, 422, "layer_ge"),  # tiny has layers 0..1
        ({"layer_le": 7}, 422, "layer_le"),
        ({"layer_le": -1}, 422, "layer_le"),
        ({"layer_gt": 2}, 422, "layer_gt"),
        ({"layer_lt": 3}, 422, "layer_lt"),
        ({"layer_gt": "x"}, 422, "layer_gt"),
        ({"layer_ge": "99999999999"}, 422, "layer_ge"),
        ({"head": 4}, 422, "head"),
        ({"heads": "2:0"}, 422, "heads"),
        ({"heads": "0:4"}, 422, "heads"),
        ({"heads": "0-1"}, 422, "heads"),
        ({"heads": "a:b"}, 422, "heads"),
        ({"score": "loudness"}, 422, "score"),
        ({"clustering": 999999}, 404, "clustering"),
        ({"clustering": 0}, 422, "clustering"),
    ],
)
def test_bad_input_is_4xx_naming_the_field(api: TestClient, params: dict[str, Any], status: int, field: str) -> None:
    answer = api.get(f"/models/{TINY}/export", params=params)
    assert answer.status_code == status, answer.text
    assert field in answer.text
    body = answer.json()
    if "field" in body:
        assert body["field"] == field


# lowest= at its bounds over 4 heads with distinct values: the text -> how many of them it chooses (None: refused)
LOWEST_BOUNDS = [("0%", 0), ("100%", 4), ("100.0%", 4), ("100.5%", None), ("50%", 2), ("0", 0), ("4", 4),
                 ("9", 4), ("2.0", None)]  # fmt: skip


@pytest.mark.parametrize(("text", "count"), LOWEST_BOUNDS)
def test_lowest_takes_a_share_from_0_to_100_percent_and_a_whole_count(text: str, count: int | None) -> None:
    """``lowest=``'s share is valid from 0 % to 100 % inclusive and its count a whole number; the heads chosen
    are the ``count`` lowest (a count above the heads chooses them all)."""
    from service.errors import InvalidInput
    from service.exports.service import HeadTable, lowest

    values = np.array([[0.4, 0.1], [0.3, 0.2]])
    table = HeadTable(model=None, clustering_id=None, rows=[], shapes={"encoder": (2, 2)},  # type: ignore[arg-type]
                      selected={"encoder": np.ones((2, 2), dtype=bool)})  # fmt: skip
    if count is None:
        with pytest.raises(InvalidInput, match="lowest"):
            lowest(table, {"encoder": values}, text)
        return
    chosen = lowest(table, {"encoder": values}, text)["encoder"]
    assert chosen.sum() == count
    assert set(values[chosen]) == set(sorted(values.ravel())[:count])


def test_unknown_model_and_a_clustering_without_the_model(minilm_api: TestClient) -> None:
    answer = minilm_api.get("/models/nope/export")
    assert answer.status_code == 404
    assert answer.json()["field"] == "name"
    assert "'tiny'" in answer.json()["detail"]
    other = minilm_api.get(f"/models/{MINILM}").json()["current_clustering_id"]
    answer = minilm_api.get(f"/models/{TINY}/export", params={"clustering": other})
    assert answer.status_code == 422
    assert answer.json()["field"] == "clustering"


def test_openapi_documents_the_export(api: TestClient) -> None:
    spec = api.get("/openapi.json").json()
    operation = spec["paths"]["/models/{name}/export"]["get"]
    assert "prune" in operation["description"]
    params = {p["name"]: p for p in operation["parameters"]}
    assert set(params) >= {"format", "type", "exclude_type", "layer_ge", "layer_le", "heads", "clustering", "score"}
    assert "1 = keep" in params["format"]["description"]
    assert "centroid_distance" in params["score"]["description"]
    assert set(operation["responses"]["200"]["content"]) >= {"application/json", "application/x-npy", "text/csv"}


@pytest.mark.slow
def test_the_cli_writes_what_the_api_serves(
    api: TestClient, committed_database_url: str, tmp_path: Path, catalog_engine: Engine
) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}

    def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        command = [sys.executable, "-m", "service.cli", "export", TINY, *args]
        return subprocess.run(command, env=env, capture_output=True, timeout=PATIENCE, check=False)

    chosen = heads_of(api, TINY)[0]["type"]
    done = cli("--type", chosen, "--layer-le", "1")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == export(api, TINY, "prune_heads", type=chosen, layer_le=1)
    done = cli("--format", "head_mask.npy", "--heads", "0:1,1:2", "--output", str(tmp_path / "mask.npy"))
    assert done.returncode == 0, done.stderr.decode()
    np.testing.assert_array_equal(np.load(tmp_path / "mask.npy"), [[1, 0, 1, 1], [1, 1, 0, 1]])
    done = cli("--layer-ge", "5")
    assert done.returncode == 2
    assert b"layer_ge" in done.stderr
    done = cli("--format", "pairs", "--min-margin", "0.3")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == export(api, TINY, "pairs", min_margin=0.3)
    done = cli("--min-agreement", "0.9")  # the catalog's clustering has no stability run
    assert done.returncode == 2
    assert b"min_agreement" in done.stderr


# --- the export applied to the real MiniLM ---------------------------------------------------------


class HeadMasker:
    """Multiplies each self-attention's output, per head, by a ``head_mask`` export (1 = keep).

    In transformers 5 ``BertSelfAttention`` returns ``(attn_output (batch, seq, hidden), weights)``;
    the hidden axis is ``heads x head_dim``, so a head's output is zeroed by zeroing its slice.
    """

    def __init__(self, model: Any, head_mask: list[list[int]]) -> None:
        import torch

        self.model = model
        self.mask = torch.tensor(head_mask, dtype=torch.float32)  # (layers, heads)
        self.outputs: dict[int, Any] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> HeadMasker:
        for index, layer in enumerate(self.model.encoder.layer):
            self.handles.append(layer.attention.self.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, index: int) -> Callable[..., Any]:
        def hook(module: Any, inputs: Any, output: tuple[Any, ...]) -> tuple[Any, ...]:
            context = output[0]  # (batch, seq, heads * head_dim)
            batch, seq, _ = context.shape
            heads = context.view(batch, seq, len(self.mask[index]), -1)  # (batch, seq, heads, head_dim)
            masked = (heads * self.mask[index][None, None, :, None]).view(batch, seq, -1)
            self.outputs[index] = masked
            return (masked, *output[1:])

        return hook


def prune_heads(model: Any, heads_to_prune: dict[int, list[int]]) -> None:
    """Remove the listed heads from a BERT in place: their rows of Q, K and V, their columns of
    the attention output projection (what ``transformers`` 4's ``model.prune_heads`` did)."""
    import torch

    for layer, heads in heads_to_prune.items():
        attention = model.encoder.layer[layer].attention
        size = attention.self.attention_head_size
        keep = [h for h in range(attention.self.num_attention_heads) if h not in set(heads)]
        index = torch.cat([torch.arange(h * size, (h + 1) * size) for h in keep])
        for name in ("query", "key", "value"):
            linear = getattr(attention.self, name)
            linear.weight = torch.nn.Parameter(linear.weight[index].clone())
            linear.bias = torch.nn.Parameter(linear.bias[index].clone())
            linear.out_features = len(index)
        dense = attention.output.dense
        dense.weight = torch.nn.Parameter(dense.weight[:, index].clone())
        dense.in_features = len(index)
        attention.self.num_attention_heads = len(keep)
        attention.self.all_head_size = len(index)


@pytest.fixture(scope="module")
def minilm_model(minilm_path: Path) -> Any:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()
    batch = tokenizer(
        ["The cat sat on the mat, and then it slept.", "Attention heads can often be pruned."],
        padding=True,
        return_tensors="pt",
    )
    return model, batch


def hidden_states(model: Any, batch: Any, head_mask: list[list[int]] | None = None) -> tuple[Any, dict[int, Any]]:
    import torch

    with torch.inference_mode():
        if head_mask is None:
            return model(**batch, output_hidden_states=True).hidden_states, {}
        with HeadMasker(model, head_mask) as masker:
            return model(**batch, output_hidden_states=True).hidden_states, masker.outputs


@pytest.mark.slow
def test_a_head_mask_export_zeroes_exactly_the_selected_heads_of_the_real_minilm(
    minilm_api: TestClient, minilm_model: Any
) -> None:
    import torch

    model, batch = minilm_model
    real = batch["attention_mask"].bool()  # (batch, seq)
    heads = heads_of(minilm_api, MINILM)
    last = model.config.num_hidden_layers - 1
    chosen = heads[-1]["type"]  # a type of the last layer, among its first half of heads (so some heads stay)
    first_half = ",".join(f"{last}:{h}" for h in range(model.config.num_attention_heads // 2))
    params = {"type": chosen, "layer_ge": last, "heads": first_half}
    mask = export(minilm_api, MINILM, "head_mask", **params)
    selected = {(h["layer"], h["head"]) for h in heads if h["type"] == chosen and h["layer"] == last and h["head"] < 6}
    assert selected
    assert {(la, h) for la, row in enumerate(mask) for h, v in enumerate(row) if v == 0} == selected

    base, _ = hidden_states(model, batch)
    masked, outputs = hidden_states(model, batch, mask)
    assert len(base) == last + 2  # embeddings, then one per layer
    for index in range(last + 1):  # embeddings and layers 0..last-1: bit-identical
        assert torch.equal(base[index], masked[index]), index
    change = (masked[-1] - base[-1]).abs().amax(-1)  # (batch, seq)
    assert bool((change[real] > 1e-4).all())  # the last layer changes at every real token

    # inside the last layer: the selected heads' outputs are 0, the others untouched
    _, unmasked = hidden_states(model, batch, [[1] * model.config.num_attention_heads] * (last + 1))
    size = model.config.hidden_size // model.config.num_attention_heads
    for head in range(model.config.num_attention_heads):
        part = slice(head * size, (head + 1) * size)
        if (last, head) in selected:
            assert bool((outputs[last][..., part] == 0).all())
        else:
            assert torch.equal(outputs[last][..., part], unmasked[last][..., part])

    # the prune_heads export of the same selection, applied by removing the heads, gives the same model output
    pruned_heads = {int(layer): hs for layer, hs in export(minilm_api, MINILM, "prune_heads", **params).items()}
    assert pruned_heads == {last: sorted(h for _, h in selected)}
    import copy

    pruned = copy.deepcopy(model)
    prune_heads(pruned, pruned_heads)
    assert pruned.encoder.layer[last].attention.self.query.out_features == size * (12 - len(selected))
    after, _ = hidden_states(pruned, batch)
    torch.testing.assert_close(after[-1], masked[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_masking_nothing_changes_nothing_and_a_middle_layer_changes_only_what_follows(
    minilm_api: TestClient, minilm_model: Any
) -> None:
    import torch

    model, batch = minilm_model
    heads = heads_of(minilm_api, MINILM)
    every_type = ",".join(sorted({h["type"] for h in heads}))
    nothing = export(minilm_api, MINILM, "head_mask", exclude_type=every_type)
    assert np.array(nothing).min() == 1
    assert export(minilm_api, MINILM, "prune_heads", exclude_type=every_type) == {}
    base, _ = hidden_states(model, batch)
    same, _ = hidden_states(model, batch, nothing)
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))

    middle = export(minilm_api, MINILM, "head_mask", heads="2:0,2:5,2:11")
    masked, _ = hidden_states(model, batch, middle)
    for index in range(len(base)):  # hidden_states[i + 1] is layer i's output
        assert torch.equal(base[index], masked[index]) == (index <= 2), index
