"""Attribution runs: the job stores every head at once (or nothing), the API and the views serve them,
bad input is a 4xx / exit 2 before anything is queued or computed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.runner import run_inline
from service.orm import AttributionRun, CatalogModel, HeadAttribution, Job
from tests.service.conftest import TINY
from tests.waiting import PATIENCE

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
