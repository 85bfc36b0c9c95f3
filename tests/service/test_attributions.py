"""Attribution runs: the job stores every head at once (or nothing), the API and the views serve them,
bad input is a 4xx / exit 2 before anything is queued or computed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from service.orm import AttributionRun, CatalogModel, HeadAttribution, Job
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]


def request(**overrides: Any) -> dict[str, Any]:
    base = {"model": TINY, "corpus": "builtin:wiki", "samples": 2, "max_length": 16, "probes": 2, "device": "cpu"}
    return {**base, **overrides}


def jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def test_the_job_stores_every_head_and_the_api_serves_it(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient
) -> None:
    job = run_inline(sessions, "attribution", request())
    assert job.status == "succeeded", job.error
    assert job.result is not None
    run_id = job.result["attribution_run_id"]
    with sessions() as session:
        run = session.get_one(AttributionRun, run_id)
        tokens, columns = run.num_tokens, (run.queries, run.probes, run.passes, run.triples, run.config)
    assert job.progress_done == job.progress_total == tokens * 2  # a pass per token and probe
    assert job.result["passes"] == job.progress_total
    assert job.result["rows"] == 2 * 4 * tokens  # every query: layers x heads x tokens
    assert job.result["triples"] == job.result["rows"] * 2
    assert job.result["scheme"] == "forward"
    assert len(job.result["layer_discrepancy"]) == 2
    assert columns[:4] == (16, 2, tokens * 2, 2 * 4 * tokens * 2)  # queries: max_length, every query of every sample
    assert (columns[4]["scheme"], columns[4]["probes"], columns[4]["queries"]) == ("forward", 2, None)

    served = client.get(f"/attributions/{run_id}").json()
    assert served["model"] == TINY
    assert (served["scheme"], served["queries"], served["probes"], served["passes"]) == ("forward", None, 2, tokens * 2)
    assert served["rows_per_second"] == pytest.approx(2 * 4 * tokens / served["seconds"])
    assert served["stack"] == "encoder"
    assert len(served["heads"]) == 8
    first = served["heads"][0]
    assert sum(first["global_features"].values()) == pytest.approx(1, abs=1e-9)
    assert 0 <= first["discrepancy"] <= 1
    layer_means = [sum(h["discrepancy"] for h in served["heads"] if h["layer"] == layer) / 4 for layer in (0, 1)]
    assert served["layer_discrepancy"] == pytest.approx(layer_means)
    assert [r["id"] for r in client.get(f"/models/{TINY}/attributions").json()] == [run_id]

    maps = client.get(f"/models/{TINY}/attribution-maps", params={"layer": 1, "head": 2}).json()
    assert len(maps["attention"]) == len(maps["attribution"]) == len(maps["queries"]) == len(maps["tokens"])
    assert all(sum(row) > 0 for row in maps["attribution"])
    assert client.get(f"/attributions/{run_id}/maps", params={"layer": 5, "head": 0}).status_code == 404

    with sessions() as session:
        rows = session.execute(
            text("SELECT layer, head, discrepancy, sep, global_vector FROM head_attribution WHERE model = :m"),
            {"m": TINY},
        ).all()
        assert len(rows) == 8
        stored = {(h["layer"], h["head"]): h for h in served["heads"]}
        for layer, head, discrepancy, sep, vector in rows:
            assert discrepancy == pytest.approx(stored[layer, head]["discrepancy"])
            assert sep == pytest.approx(stored[layer, head]["global_features"]["sep"])
            assert len(vector) == 21


def test_an_interrupted_run_stores_nothing(
    sessions: sessionmaker[Session], tiny_ingested: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.attribution

    original = ingest.attribution.attribute_sample
    calls = {"n": 0}

    def fails_on_the_second_sample(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(ingest.attribution, "attribute_sample", fails_on_the_second_sample)
    with pytest.raises(RuntimeError, match="simulated"):
        run_inline(sessions, "attribution", request(queries=4))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(AttributionRun)) == 0
        assert session.scalar(select(func.count()).select_from(HeadAttribution)) == 0
        assert session.scalars(select(Job.status).where(Job.kind == "attribution")).one() == "failed"


@pytest.mark.parametrize(
    ("overrides", "status", "field", "says"),
    [
        ({"model": "nosuch"}, 404, "model", "nosuch"),
        ({"model": "seq2seq"}, 422, "model", "encoder-decoder"),
        ({"corpus": "missing.txt"}, 422, "corpus", "missing.txt"),
    ],
)
def test_bad_input_is_4xx_naming_the_field_and_queues_nothing(
    client: TestClient,
    sessions: sessionmaker[Session],
    tiny_ingested: int,
    overrides: dict[str, Any],
    status: int,
    field: str,
    says: str,
) -> None:
    with sessions() as session, session.begin():  # an encoder-decoder in the catalog: three stacks
        shape = {"layers": 1, "heads": 2, "kv_heads": 2}
        session.add(CatalogModel(name="seq2seq", source="/nowhere", architecture="t5", num_layers=1, num_heads=2,
                                 stacks={"encoder": shape, "decoder": shape, "cross": shape}))  # fmt: skip
    before = jobs(sessions)
    if field == "corpus":
        overrides = {"corpus": str(ROOT.parent / "shared" / "data" / "missing.txt")}
    answer = client.post("/attributions", json=request(**overrides))
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field
    assert says in answer.json()["detail"]
    assert jobs(sessions) == before


@pytest.mark.parametrize(
    "overrides", [{"queries": 0}, {"probes": 0}, {"samples": 0}, {"device": "tpu"}, {"scheme": "vjp"}]
)
def test_out_of_range_numbers_are_422(
    client: TestClient, sessions: sessionmaker[Session], overrides: dict[str, Any]
) -> None:
    before = jobs(sessions)
    answer = client.post("/attributions", json=request(**overrides))
    assert answer.status_code == 422
    assert answer.json()["field"] == next(iter(overrides))
    assert jobs(sessions) == before


def test_the_cli_refuses_bad_input_with_exit_2(committed_database_url: str, catalog_engine: Engine) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "service.cli", "attribute", TINY, "--queries", "0", "--device", "cpu"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 2, done.stderr
    assert "queries" in done.stderr
    with Session(catalog_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.kind == "attribution")) == 0


def test_a_global_clustering_fits_the_attribution_vectors_and_leaves_the_types_alone(
    sessions: sessionmaker[Session], tiny_clustered: int, client: TestClient
) -> None:
    import numpy as np

    from service.orm import Cluster, Clustering, HeadAssignment

    refused = client.post("/clusterings", json={"models": [TINY], "k": 2, "vector": "global"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["field"] == "vector"
    assert "headcat attribute" in refused.json()["detail"]

    assert run_inline(sessions, "attribution", request()).status == "succeeded"
    job = run_inline(sessions, "clustering", {"models": [TINY], "k": 2, "seed": 0, "vector": "global"})
    assert job.status == "succeeded", job.error
    assert job.result is not None
    clustering_id = job.result["clustering_id"]
    with sessions() as session:
        clustering = session.get_one(Clustering, clustering_id)
        assert clustering.vector == "global"
        model = session.scalars(select(CatalogModel).where(CatalogModel.name == TINY)).one()
        assert model.current_clustering_id == tiny_clustered  # the attention types stay current
        members: dict[int, list[list[float]]] = {}
        for cluster_id, vector in session.execute(
            select(HeadAssignment.cluster_id, HeadAttribution.vector)
            .join(HeadAttribution, HeadAttribution.head_id == HeadAssignment.head_id)
            .where(HeadAssignment.clustering_id == clustering_id)
        ):
            members.setdefault(cluster_id, []).append(vector)
        assert sum(len(v) for v in members.values()) == 8
        for cluster in session.scalars(select(Cluster).where(Cluster.clustering_id == clustering_id)):
            np.testing.assert_allclose(cluster.centroid, np.mean(members[cluster.id], axis=0), atol=1e-9)
    stability = run_inline(sessions, "stability", {"clustering_id": clustering_id, "n_runs": 3, "seed": 0})
    assert stability.status == "succeeded", stability.error


def test_the_page_loads_the_attribution_script(client: TestClient) -> None:
    page = client.get("/").text
    assert '<script src="/static/attribution.js"></script>' in page
    script = client.get("/static/attribution.js")
    assert script.status_code == 200
    assert "window.headcatExtras" in script.text


def test_get_heads_serves_the_discrepancy_and_the_global_vector(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient
) -> None:
    """Each head's discrepancy and global features in ``GET /heads`` are its stored attribution row's."""
    assert run_inline(sessions, "attribution", request()).status == "succeeded"
    with sessions() as session:
        rows = session.execute(
            text("SELECT h.layer, h.head, a.discrepancy, a.vector FROM head_attributions a "
                 "JOIN heads h ON h.id = a.head_id")
        ).all()  # fmt: skip
    stored = {(r.layer, r.head): (r.discrepancy, r.vector) for r in rows}
    answer = client.get("/heads", params={"model": TINY, "order": "-discrepancy"})
    assert answer.status_code == 200, answer.text
    heads = answer.json()["items"]
    assert len(heads) == len(stored) == 8
    names = [*(f"w{i}" for i in range(16)), "self", "cls", "sep", "period", "comma"]
    for head in heads:
        discrepancy, vector = stored[head["layer"], head["head"]]
        assert head["discrepancy"] == discrepancy
        assert head["global_features"] == dict(zip(names, vector, strict=True))
    values = [h["discrepancy"] for h in heads]
    assert values == sorted(values, reverse=True)
    low = client.get("/heads", params={"model": TINY, "discrepancy_lt": sorted(values)[3]}).json()["items"]
    assert {(h["layer"], h["head"]) for h in low} == {k for k, (d, _) in stored.items() if d < sorted(values)[3]}


def test_the_cli_clusters_global_vectors_only_after_an_attribution_run(
    committed_database_url: str, catalog_engine: Engine
) -> None:
    """``headcat cluster NAME --vector global`` asks for the same clustering as ``POST /clusterings``:
    refused (exit 2, naming ``vector``) while the model has no attribution run, nothing stored."""
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "WARNING"}
    with Session(catalog_engine) as session:
        before = session.scalar(select(func.count()).select_from(Job).where(Job.kind == "clustering"))
    command = [sys.executable, "-m", "service.cli", "cluster", TINY, "--k", "2", "--vector", "global"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 2, done.stderr
    assert "vector:" in done.stderr
    assert "headcat attribute" in done.stderr
    with Session(catalog_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.kind == "clustering")) == before


def test_every_stored_field_is_what_attribute_computes_head_by_head(
    sessions: sessionmaker[Session], tiny_ingested: int, tiny_bert_path: Path
) -> None:
    """Every head's global and local vectors, global scalars (by name), discrepancy and example maps, and the
    run's layer discrepancy and counts, read back by plain SQL, equal ``attribute`` called here with the
    request's settings (none a default: the seed draws the queries and probes). The global and local vectors
    differ and the heads differ (checked first), so a swap of the two vectors or of two heads' rows fails."""
    from ingest.attribution import AttributionConfig, attribute
    from ingest.corpora import load_corpus
    from ingest.loading import load_model
    from ingest.types import SCALARS

    settings = {"samples": 3, "max_length": 16, "queries": 4, "probes": 2, "num_windows": 8, "seed": 7}
    job = run_inline(sessions, "attribution", request(**settings))
    assert job.status == "succeeded", job.error
    assert job.result is not None
    run_id = job.result["attribution_run_id"]
    loaded = load_model(str(tiny_bert_path), device="cpu")
    config = AttributionConfig(**settings, device="cpu", dtype="float32")  # type: ignore[arg-type]
    expected = attribute(loaded, None, load_corpus("builtin:wiki").samples(3), config)
    assert np.abs(expected.global_vectors - expected.local_vectors).max() > 1e-4  # 100 x the tolerance below
    assert np.abs(expected.global_vectors[0, 0] - expected.global_vectors[0, 1]).max() > 1e-3
    assert np.abs(expected.discrepancy - expected.discrepancy[::-1, ::-1]).max() > 1e-3

    with sessions() as session:
        run = session.execute(text("SELECT * FROM attribution_runs WHERE id = :r"), {"r": run_id}).mappings().one()
        rows = session.execute(
            text("SELECT h.stack, h.layer, h.head, a.* FROM head_attributions a JOIN heads h"
                 " ON h.model_id = a.model_id AND h.id = a.head_id WHERE a.attribution_run_id = :r"), {"r": run_id}
        ).mappings().all()  # fmt: skip
    assert (run["status"], run["stack"], run["num_windows"], run["seed"], run["queries"], run["probes"]) == (
        "complete", expected.stack, 8, 7, 4, 2,
    )  # fmt: skip
    assert (run["num_samples"], run["num_tokens"], run["triples"], run["passes"]) == (
        expected.num_samples, expected.num_tokens, expected.triples, expected.passes,
    )  # fmt: skip
    np.testing.assert_allclose(run["layer_discrepancy"], expected.layer_discrepancy(), rtol=1e-6)
    assert run["config"] == config.to_json()
    assert (run["example_tokens"], run["example_queries"]) == (expected.example_tokens, expected.example_queries)
    stored = {(r["stack"], r["layer"], r["head"]): r for r in rows}
    assert sorted(stored) == [("encoder", layer, head) for layer in range(2) for head in range(4)]
    for (_, layer, head), row in stored.items():
        where = f"head {layer, head}"
        np.testing.assert_allclose(row["vector"], expected.global_vectors[layer, head], rtol=1e-6, err_msg=where)
        np.testing.assert_allclose(row["local_vector"], expected.local_vectors[layer, head], rtol=1e-6, err_msg=where)
        assert len(row["vector"]) == 13
        for name in SCALARS:
            value = expected.global_scalars[name][layer, head]
            assert row[name] == (pytest.approx(value, rel=1e-6) if np.isfinite(value) else None), (where, name)
        assert row["discrepancy"] == pytest.approx(expected.discrepancy[layer, head], rel=1e-6), where
        np.testing.assert_allclose(row["example_attention"], expected.example_attention[layer, head], rtol=1e-6,
                                   err_msg=where)  # fmt: skip
        np.testing.assert_allclose(row["example_attribution"], expected.example_attribution[layer, head], rtol=1e-6,
                                   err_msg=where)  # fmt: skip
    scalars = np.array([[stored["encoder", 0, h][name] for h in range(4)] for name in ("entropy", "mean_distance")])
    assert np.abs(scalars[0] - scalars[1]).max() > 1e-3  # two scalars swapped would show


@pytest.fixture
def sharp_ingested(sessions: sessionmaker[Session], tiny_bert_path: Path, tmp_path: Path) -> Path:
    """A random 2 x 4 BERT whose heads really differ (``initializer_range=0.5``) ingested as ``sharp``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(5)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=32, max_position_embeddings=64, initializer_range=0.5)  # fmt: skip
    BertModel(config).eval().save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_bert_path).save_pretrained(tmp_path)
    job = run_inline(sessions, "ingest", ingest_request(tmp_path, name="sharp", samples=4, max_length=16))
    assert job.status == "succeeded", job.error
    return tmp_path


def recompute(path: Path, samples: int, max_length: int, draws: int) -> dict[str, Any]:
    """From the exact Jacobian of ``torch.autograd.functional.jacobian`` (no forward mode): the run's discrepancy
    and global vectors of the exact G, and the same of ``draws`` independent 4-tangent estimates of G^2 made
    from that Jacobian (``mean_v ||J_t v||^2``, fresh Rademacher tangents each): the estimator's distribution."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertModel

    from ingest.attribution import row_features, total_variation
    from ingest.corpora import load_corpus
    from ingest.features import encode_samples, resolve_special_tokens
    from tests.ingest.test_attribution_contract import context_jacobian

    model = BertModel.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    table = resolve_special_tokens(tokenizer).group_table(len(tokenizer))
    generator = torch.Generator().manual_seed(11)
    exact: list[tuple[np.ndarray, np.ndarray]] = []
    estimated: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for encoded in encode_samples(tokenizer, list(load_corpus("builtin:wiki").samples(samples)), max_length):
        ids = torch.tensor([encoded.input_ids])
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "token_type_ids": torch.tensor([encoded.token_type_ids])}  # fmt: skip
        length, queries = ids.shape[1], torch.arange(ids.shape[1])
        jacobian = context_jacobian(model, batch, queries.tolist()).double()  # (L, H, T, d, T, D)
        with torch.no_grad():
            attention = torch.stack([m[0] for m in model(**batch, output_attentions=True).attentions]).double()

        def reduce(squares: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
            norms = squares.sqrt()
            rows = norms / norms.sum(-1, keepdim=True)  # noqa: B023 (used at once)
            glob = row_features(rows, queries, table[ids[0]], 16)[..., :21].numpy()  # noqa: B023
            return glob, total_variation(attention, rows).mean(-1).numpy()  # noqa: B023

        exact.append(reduce(jacobian.pow(2).sum((3, 5))))
        runs = []
        for _ in range(draws):
            tangents = torch.randint(0, 2, (length, 4, jacobian.shape[-1]), generator=generator).double() * 2 - 1
            runs.append(reduce(torch.einsum("lhsitd,tpd->lhstpi", jacobian, tangents).pow(2).sum(-1).mean(-1)))
        estimated.append(runs)

    def run_means(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        return np.mean([g for g, _ in pairs], 0), np.mean([d for _, d in pairs], 0)

    draws_of_runs = [run_means([sample[k] for sample in estimated]) for k in range(draws)]
    return {
        "exact": run_means(exact),
        "global": np.stack([g for g, _ in draws_of_runs]),  # (draws, layers, heads, 21)
        "discrepancy": np.stack([d for _, d in draws_of_runs]),  # (draws, layers, heads)
    }


def stored_heads(sessions: sessionmaker[Session], run_id: int) -> tuple[Any, Any]:
    import numpy as np

    with sessions() as session:
        found = session.execute(
            text("SELECT h.layer, h.head, a.discrepancy, a.vector FROM head_attributions a "
                 "JOIN heads h ON h.id = a.head_id AND h.model_id = a.model_id "
                 "WHERE a.attribution_run_id = :r ORDER BY h.layer, h.head"), {"r": run_id}
        ).all()  # fmt: skip
    assert len(found) == 8
    return np.array([r.discrepancy for r in found]).reshape(2, 4), np.array([r.vector for r in found]).reshape(2, 4, 21)


def test_stored_discrepancy_and_global_vectors_are_the_exact_gs_within_the_estimators_error(
    sessions: sessionmaker[Session], sharp_ingested: Path
) -> None:
    """The exact scheme stores what the exact G gives (to float32 rounding). The default 4-probe estimate stores
    values within the estimator's error of it: within 5 standard deviations (plus the bias the square root and
    the normalisation give) of the exact value, the estimator's distribution drawn from the exact Jacobian."""
    import numpy as np

    expected = recompute(sharp_ingested, 2, 16, draws=200)
    exact_global, exact_discrepancy = expected["exact"]
    exact = run_inline(sessions, "attribution", request(model="sharp", scheme="exact"))
    assert exact.result is not None
    discrepancy, vectors = stored_heads(sessions, exact.result["attribution_run_id"])
    np.testing.assert_allclose(discrepancy, exact_discrepancy, rtol=0, atol=1e-5)
    np.testing.assert_allclose(vectors, exact_global, rtol=0, atol=1e-5)
    assert float(np.abs(vectors[1, 0] - vectors[1, 1]).sum()) > 0.05  # heads that really differ

    estimate = run_inline(sessions, "attribution", request(model="sharp", probes=4))
    assert estimate.result is not None
    discrepancy, vectors = stored_heads(sessions, estimate.result["attribution_run_id"])
    for found, truth, draws in ((discrepancy, exact_discrepancy, expected["discrepancy"]),
                                (vectors, exact_global, expected["global"])):  # fmt: skip
        bias, spread = np.abs(draws.mean(0) - truth), draws.std(0)
        assert (np.abs(found - truth) <= bias + 5 * spread + 1e-9).all()
        assert (np.abs(found - draws.mean(0)) <= 5 * spread + 1e-9).all()
    assert float(np.abs(vectors - exact_global).max()) > 1e-4  # an estimate, not the exact value
    assert float(expected["global"].std(0).max()) < 0.05  # and the estimator's error is small enough to mean something


def test_the_cli_attributes_exactly_and_reports_passes(committed_database_url: str, catalog_engine: Engine) -> None:
    """``headcat attribute tiny --exact``: the hidden size's unit vectors at each token (32 passes a token), the
    scheme stored; its progress lines count passes."""
    env = {**os.environ, "DATABASE_URL": committed_database_url, "HEADCAT_LOG_LEVEL": "INFO",
           "HEADCAT_PROGRESS_INTERVAL": "0.001"}  # fmt: skip
    command = [sys.executable, "-m", "service.cli", "attribute", TINY, "--exact", "--samples", "1", "--max-length",
               "8", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 0, done.stderr
    with Session(catalog_engine) as session:
        run = session.scalars(select(AttributionRun).order_by(AttributionRun.id.desc())).first()
        assert run is not None
        assert (run.config["scheme"], run.probes, run.passes) == ("exact", 32, run.num_tokens * 32)
    assert f"passes {run.passes}/{run.passes} (100 %)" in done.stderr + done.stdout
