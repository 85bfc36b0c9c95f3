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
from tests.service.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]


def request(**overrides: Any) -> dict[str, Any]:
    base = {"model": TINY, "corpus": "builtin:wiki", "samples": 2, "max_length": 16, "queries": 4, "probes": 2,
            "rows_per_pass": 64, "device": "cpu"}  # fmt: skip
    return {**base, **overrides}


def jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def test_the_job_stores_every_head_and_the_api_serves_it(
    sessions: sessionmaker[Session], tiny_ingested: int, client: TestClient
) -> None:
    job = run_inline(sessions, "attribution", request())
    assert job.status == "succeeded", job.error
    assert job.progress_done == job.progress_total == 2 * 4 * 4 * 2 * 2  # layers x heads x queries x probes x samples
    assert job.result is not None
    run_id = job.result["attribution_run_id"]
    assert job.result["triples"] == job.progress_total
    assert len(job.result["layer_discrepancy"]) == 2

    served = client.get(f"/attributions/{run_id}").json()
    assert served["model"] == TINY
    assert served["stack"] == "encoder"
    assert len(served["heads"]) == 8
    first = served["heads"][0]
    assert sum(first["global_features"].values()) == pytest.approx(1, abs=1e-9)
    assert 0 <= first["discrepancy"] <= 1
    layer_means = [sum(h["discrepancy"] for h in served["heads"] if h["layer"] == layer) / 4 for layer in (0, 1)]
    assert served["layer_discrepancy"] == pytest.approx(layer_means)
    assert [r["id"] for r in client.get(f"/models/{TINY}/attributions").json()] == [run_id]

    maps = client.get(f"/models/{TINY}/attribution-maps", params={"layer": 1, "head": 2}).json()
    assert len(maps["attention"]) == len(maps["attribution"]) == len(maps["queries"]) == 4
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
        run_inline(sessions, "attribution", request())
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


@pytest.mark.parametrize("overrides", [{"queries": 0}, {"probes": 0}, {"samples": 0}, {"device": "tpu"}])
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
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
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
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
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

    settings = {"samples": 3, "max_length": 16, "queries": 4, "probes": 2, "rows_per_pass": 8, "num_windows": 8,
                "seed": 7}  # fmt: skip
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
