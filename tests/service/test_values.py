"""What the catalog serves for a real model equals an independent computation for that exact head.

The packaged all-MiniLM-L6-v2 (6 layers x 12 heads) is ingested, clustered and ablated through the
service's own jobs on a few text pairs. Then, for every ``(layer, head)``:

- the features and scalars that ``GET /heads``, the ``current_head_types`` view and the head page
  serve equal the SPEC reduction, written here in plain numpy, of the probabilities that
  ``transformers`` itself returns with ``output_attentions=True`` in eager mode;
- the type they serve (and the exports select by) equals a clustering recomputed from the stored
  vectors with plain ``sklearn.cluster.KMeans`` and the SPEC naming rule written here;
- every row of the paper plan's ablation equals a hand-run of the same surgery: BERT's self-attention
  recomputed from its query/key/value projections (``tests/surgery.py``), the selected heads' probabilities edited
  (prune: 0; uniform: 1/L; drop_intra/drop_inter: 0 within/across segments), and the drift metric
  (mean cosine of the last hidden states over real tokens) computed against the unablated model.

A head's numbers stored under its neighbour's index, a head stored under the wrong cluster, or a
``uniform`` row running ``prune`` all fail here (each was planted once to check).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from service.app import create_app
from service.jobs.runner import run_inline
from tests.conftest import grant_key
from tests.service.conftest import ingest_request
from tests.surgery import hand_run

pytestmark = pytest.mark.slow

NAME = "minilm-values"
N = 16  # windows
LAYERS, HEADS = 6, 12
PAIRS = [
    ("The cat sat on the mat, purring.", "It was warm there."),
    ("Paris is the capital of France.", "Many tourists visit it, mostly in summer."),
    ("She plays the violin every evening.", "Her neighbours, oddly, like it."),
    ("The river flooded the valley after the storm.", "Farmers lost their crops."),
    ("He wrote a long letter.", "Nobody ever read it, not even his sister."),
    ("Prices rose sharply last year.", "Wages did not keep up."),
    ("The team won the final.", "Fans celebrated all night, singing."),
    ("A storm is coming tonight.", "Close the windows, please."),
]
TYPES = ("dense", "diagonal", "dense_vertical", "vertical")


# --- the catalog, built by the service's own jobs ---------------------------------------------------


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("values") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"text": a, "text_pair": b}) + "\n" for a, b in PAIRS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def catalog(committed_database_url: str, minilm_path: Path, pairs_file: Path) -> Iterator[dict[str, Any]]:
    """MiniLM ingested (batches of 3, so padding is exercised), clustered and ablated with the paper plan."""
    engine = create_engine(committed_database_url)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    request = ingest_request(minilm_path, name=NAME, corpus=str(pairs_file), samples=len(PAIRS), batch_size=3)
    ingested = run_inline(sessions, "ingest", request)
    clustered = run_inline(sessions, "clustering", {"models": [NAME], "k": 4, "seed": 0})
    ablated = run_inline(sessions, "ablation", {"model": NAME, "data": str(pairs_file), "task": "drift",
                                                "batch_size": 3, "device": "cpu"})  # fmt: skip
    for job in (ingested, clustered, ablated):
        assert job.status == "succeeded", job.error
    key = grant_key(sessionmaker(bind=engine))
    with TestClient(create_app(engine), headers={"Authorization": f"Bearer {key}"}) as api:
        yield {"engine": engine, "api": api, "ablation_run_id": ablated.result["ablation_run_id"]}  # type: ignore[index]
    engine.dispose()


@pytest.fixture(scope="module")
def api(catalog: dict[str, Any]) -> TestClient:
    return catalog["api"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def served(api: TestClient) -> dict[tuple[int, int], dict[str, Any]]:
    answer = api.get("/heads", params={"model": NAME, "limit": 100})
    assert answer.status_code == 200, answer.text
    assert answer.json()["total"] == LAYERS * HEADS
    return {(h["layer"], h["head"]): h for h in answer.json()["items"]}


# --- the independent references -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert(minilm_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(minilm_path)


def encode(tokenizer: Any, pair: tuple[str, str]) -> dict[str, torch.Tensor]:
    return dict(tokenizer(pair[0], pair[1], truncation=True, max_length=64, return_tensors="pt"))


def sample_features(probs: np.ndarray, tokens: list[str]) -> np.ndarray:
    """SPEC section 1 for one sample, every head: (layers, heads, N + 5 + 5) from (layers, heads, L, L).

    Every cell ``(s, t)`` gets one group: the key's special group, else self, else a window.
    """
    L = len(tokens)
    special = {"[CLS]": N + 1, "[SEP]": N + 2, ".": N + 3, ",": N + 4}
    group = np.empty((L, L), dtype=np.int64)
    for s in range(L):
        for t in range(L):
            if tokens[t] in special:
                group[s, t] = special[tokens[t]]
            elif s == t:
                group[s, t] = N
            else:
                group[s, t] = min(N - 1, (abs(s - t) * N) // L)
    out = np.zeros((*probs.shape[:2], N + 10))
    distance = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
    seps = [s for s in range(L) if tokens[s] == "[SEP]"]
    for layer in range(probs.shape[0]):
        for head in range(probs.shape[1]):
            A = probs[layer, head].astype(np.float64)
            out[layer, head, : N + 5] = np.bincount(group.ravel(), weights=A.ravel(), minlength=N + 5) / L
            with np.errstate(divide="ignore", invalid="ignore"):
                out[layer, head, N + 5] = -np.nansum(np.where(A > 0, A * np.log(A), 0.0)) / L  # entropy
            out[layer, head, N + 6] = np.diagonal(A, -1).sum() / (L - 1)  # previous token
            out[layer, head, N + 7] = np.diagonal(A, 1).sum() / (L - 1)  # next token
            out[layer, head, N + 8] = (A * distance).sum() / L  # mean distance
            out[layer, head, N + 9] = A[np.ix_(seps, seps)].sum() / len(seps)  # [SEP] -> [SEP]
    return out


@pytest.fixture(scope="module")
def reference_features(bert: tuple[Any, Any]) -> np.ndarray:
    """(layers, heads, N + 10): the mean over the samples, from ``output_attentions=True`` (eager)."""
    model, tokenizer = bert
    total = np.zeros((LAYERS, HEADS, N + 10))
    with torch.no_grad():
        for pair in PAIRS:
            inputs = encode(tokenizer, pair)
            attentions = model(**inputs, output_attentions=True).attentions
            probs = torch.stack(attentions)[:, 0].numpy()  # (layers, heads, L, L)
            total += sample_features(probs, tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]))
    return total / len(PAIRS)


def spec_names(centroids: np.ndarray) -> list[str]:
    """SPEC section 2: highest S -> vertical; of the rest highest D -> diagonal; of the last two,
    higher S -> dense_vertical, lower -> dense."""
    S = centroids[:, N + 1 :].sum(1)
    D = centroids[:, N] + centroids[:, 0] + centroids[:, 1]
    rest = list(range(4))
    names = [""] * 4
    vertical = max(rest, key=lambda i: S[i])
    names[vertical] = "vertical"
    rest.remove(vertical)
    diagonal = max(rest, key=lambda i: D[i])
    names[diagonal] = "diagonal"
    rest.remove(diagonal)
    a, b = sorted(rest, key=lambda i: S[i])
    names[a], names[b] = "dense", "dense_vertical"
    return names


@pytest.fixture(scope="module")
def reference_types(served: dict[tuple[int, int], dict[str, Any]]) -> dict[tuple[int, int], str]:
    """Plain scikit-learn K-means (k = 4, many restarts) on the stored vectors, named by the SPEC rule."""
    from sklearn.cluster import KMeans

    keys = sorted(served)
    X = np.array([list(served[key]["features"].values()) for key in keys])
    kmeans = KMeans(n_clusters=4, n_init=100, random_state=0).fit(X)
    names = spec_names(kmeans.cluster_centers_)
    return {key: names[label] for key, label in zip(keys, kmeans.labels_, strict=True)}


# --- features ---------------------------------------------------------------------------------------------


def test_served_features_and_scalars_are_those_of_output_attentions_for_each_head(
    served: dict[tuple[int, int], dict[str, Any]], reference_features: np.ndarray
) -> None:
    from ingest.types import SCALARS, feature_names

    assert len(served) == LAYERS * HEADS
    for (layer, head), item in served.items():
        assert list(item["features"]) == feature_names(N)
        assert list(item["features"].values()) == pytest.approx(reference_features[layer, head, : N + 5], abs=1e-6), (
            layer,
            head,
        )
        scalars = [item["scalars"][name] for name in SCALARS]
        assert scalars == pytest.approx(reference_features[layer, head, N + 5 :], abs=1e-5), (layer, head)
    # The heads really differ (a neighbour's vector would not pass for this one).
    vectors = reference_features[..., : N + 5].reshape(-1, N + 5)
    gaps = np.abs(vectors[1:] - vectors[:-1]).max(1)
    assert gaps.min() > 1e-3


def test_the_view_and_the_head_page_serve_the_same_reference_values(
    catalog: dict[str, Any], api: TestClient, reference_features: np.ndarray, bert: tuple[Any, Any]
) -> None:
    from ingest.types import SCALARS, feature_names

    with catalog["engine"].connect() as connection:
        rows = connection.execute(
            text("SELECT * FROM current_head_types WHERE model = :m ORDER BY layer, head"), {"m": NAME}
        ).mappings()
        found = {(r["layer"], r["head"]): r for r in rows}
    assert sorted(found) == [(la, h) for la in range(LAYERS) for h in range(HEADS)]
    for (layer, head), row in found.items():
        assert [row[name] for name in feature_names(N)] == pytest.approx(reference_features[layer, head, : N + 5],
                                                                          abs=1e-6)  # fmt: skip
        assert [row[name] for name in SCALARS] == pytest.approx(reference_features[layer, head, N + 5 :], abs=1e-5)

    model, tokenizer = bert
    inputs = encode(tokenizer, PAIRS[0])
    with torch.no_grad():
        attentions = torch.stack(model(**inputs, output_attentions=True).attentions)[:, 0]  # (layers, heads, L, L)
    for layer, head in [(0, 0), (0, 1), (2, 7), (5, 11)]:
        page = api.get(f"/models/{NAME}/heads/{layer}/{head}").json()
        assert list(page["features"].values()) == pytest.approx(reference_features[layer, head, : N + 5], abs=1e-6)
        side = len(page["example"]["map"])
        pooled = torch.nn.functional.adaptive_avg_pool2d(attentions[layer, head][None], (side, side))[0]
        assert np.array(page["example"]["map"]) == pytest.approx(pooled.numpy(), abs=1e-6)


# --- types ------------------------------------------------------------------------------------------------


def test_served_types_are_a_plain_kmeans_of_the_stored_vectors_named_by_the_spec_rule(
    catalog: dict[str, Any],
    api: TestClient,
    served: dict[tuple[int, int], dict[str, Any]],
    reference_types: dict[tuple[int, int], str],
) -> None:
    assert set(reference_types.values()) == set(TYPES)
    assert {key: item["type"] for key, item in served.items()} == reference_types

    with catalog["engine"].connect() as connection:
        rows = connection.execute(text("SELECT layer, head, type FROM head_types WHERE model = :m AND is_current"),
                                  {"m": NAME})  # fmt: skip
        assert {(r.layer, r.head): r.type for r in rows} == reference_types
    for key in [(0, 0), (3, 5), (5, 11)]:
        assert api.get(f"/models/{NAME}/heads/{key[0]}/{key[1]}").json()["type"] == reference_types[key]

    for head_type in TYPES:
        expected = sorted(key for key, name in reference_types.items() if name == head_type)
        prune = api.get(f"/models/{NAME}/export", params={"format": "prune_heads", "type": head_type}).json()
        assert sorted((int(layer), h) for layer, heads in prune.items() for h in heads) == expected
        mask = np.array(api.get(f"/models/{NAME}/export", params={"format": "head_mask", "type": head_type}).json())
        assert sorted(zip(*np.nonzero(mask == 0), strict=True)) == expected


def test_the_score_export_is_each_heads_reference_special_mass(api: TestClient, reference_features: np.ndarray) -> None:
    scores = np.array(api.get(f"/models/{NAME}/export", params={"format": "scores", "score": "special"}).json())
    assert scores.shape == (LAYERS, HEADS)
    assert scores == pytest.approx(reference_features[..., N + 1 : N + 5].sum(-1), abs=1e-6)


# --- ablations --------------------------------------------------------------------------------------------


def row_ops(row_id: str, types: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """The heads a paper-plan row ablates, read from its id (``prune.dense``, ``prune.dense+vertical``,
    ``drop_intra.all_but.diagonal``) against the reference types."""
    op, _, what = row_id.partition(".")
    if what.startswith("all_but."):
        excluded = what.removeprefix("all_but.")
        return {key: op for key, name in types.items() if name != excluded}
    chosen = set(what.split("+"))
    return {key: op for key, name in types.items() if name in chosen}


def test_every_paper_plan_row_equals_a_hand_run_of_the_same_surgery(
    catalog: dict[str, Any], api: TestClient, bert: tuple[Any, Any], reference_types: dict[tuple[int, int], str]
) -> None:
    model, tokenizer = bert
    run = api.get(f"/ablations/{catalog['ablation_run_id']}").json()
    outcomes = {o["row_id"]: o for o in run["outcomes"]}
    assert len(outcomes) == 1 + 27  # baseline; all four types: 4 prune, 3 pairs, 4 uniform, 8 drops, 8 all-but
    assert run["baseline"]["metrics"]["cosine"] == pytest.approx(1.0)

    encoded = [encode(tokenizer, pair) for pair in PAIRS]
    with torch.no_grad():
        baselines = [model(**inputs).last_hidden_state[0] for inputs in encoded]
    checked = set()
    for row_id, outcome in outcomes.items():
        if row_id == "baseline":
            continue
        ops = row_ops(row_id, reference_types)
        assert outcome["heads"] == len(ops), row_id
        cosines = [
            torch.nn.functional.cosine_similarity(
                hand_run(model, model.encoder.layer, inputs, ops).last_hidden_state[0], base, dim=-1
            )
            .mean()
            .item()
            for inputs, base in zip(encoded, baselines, strict=True)
        ]
        assert outcome["metrics"]["cosine"] == pytest.approx(float(np.mean(cosines)), abs=2e-5), row_id
        checked.add(row_id.partition(".")[0])
    assert checked == {"prune", "uniform", "drop_intra", "drop_inter"}
