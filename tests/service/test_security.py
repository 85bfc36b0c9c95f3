"""Who may change the catalog (API keys), and what hostile input gets: paths outside the data and
model roots, hub ids when hub access is off, remote code, oversized bodies and pages, SQL in strings."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.app import create_app
from service.auth import repository as keys
from service.deps import get_session
from service.orm import ApiKey, CatalogModel, Job
from service.settings import Settings, get_settings
from tests.conftest import grant_key
from tests.service.conftest import TINY, ingest_request
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]

WRITES = [
    ("POST", "/ingests", {"model": "org/model", "name": "x"}),
    ("POST", "/clusterings", {"models": [TINY]}),
    ("POST", "/clusterings/1/stability", {}),
    ("POST", "/ablations", {"model": TINY, "data": "builtin:wiki", "task": "drift"}),
    ("DELETE", f"/models/{TINY}", None),
    ("PUT", f"/models/{TINY}/current/clustering", {"run_id": 1}),
    ("PUT", "/clusterings/1/current", None),
]


def api(engine: Engine, sessions: sessionmaker[Session], key: str | None = None, **settings: Any) -> TestClient:
    """The API inside the test's transaction, with these settings (else the test session's)."""
    app = create_app(engine, get_settings().model_copy(update=settings) if settings else None)

    def session_in_test_transaction() -> Iterator[Session]:
        with sessions() as session, session.begin():
            yield session

    app.dependency_overrides[get_session] = session_in_test_transaction
    return TestClient(app, headers={"Authorization": f"Bearer {key}"} if key else None)


def job_count(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


# --- keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_every_write_needs_a_key_401_without_403_revoked(
    engine: Engine, sessions: sessionmaker[Session], tiny_clustered: int, method: str, path: str, body: Any
) -> None:
    before = job_count(sessions)
    for header in (None, "Bearer", "Bearer nonsense", "Basic dXNlcjpwYXNz", "Bearer hc_" + "A" * 43):
        client = TestClient(api(engine, sessions).app, headers={"Authorization": header} if header else None)
        answer = client.request(method, path, json=body)
        assert answer.status_code == 401, (header, answer.text)
        assert answer.headers["WWW-Authenticate"] == "Bearer"
        assert answer.json()["field"] == "authorization"

    secret = grant_key(sessions, "revoked")
    with sessions() as session, session.begin():
        keys.revoke(session, keys.find(session, secret[:11]))
    answer = api(engine, sessions, secret).request(method, path, json=body)
    assert answer.status_code == 403, answer.text
    assert "revoked" in answer.json()["detail"]
    assert job_count(sessions) == before
    with sessions() as session:
        assert session.scalar(select(CatalogModel).where(CatalogModel.name == TINY)) is not None

    answer = api(engine, sessions, grant_key(sessions)).request(method, path, json=body)
    assert answer.status_code not in (401, 403), answer.text
    assert answer.status_code < 500, answer.text


def test_keys_are_stored_only_as_hashes_and_record_their_use(
    client: TestClient, sessions: sessionmaker[Session], tiny_ingested: int
) -> None:
    secret = grant_key(sessions, "hash check")
    assert re.fullmatch(r"hc_[A-Za-z0-9_\-]{43}", secret)
    with sessions() as session:
        key = session.scalars(select(ApiKey).where(ApiKey.name == "hash check")).one()
        assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert key.prefix == secret[:11]
        assert key.last_used_at is None
        row = session.execute(text("SELECT * FROM api_keys WHERE id = :id"), {"id": key.id}).one()
        assert not any(secret in str(value) for value in row)
    answer = TestClient(client.app, headers={"Authorization": f"Bearer {secret}"}).post(
        "/clusterings", json={"models": [TINY], "k": 2}
    )
    assert answer.status_code == 202, answer.text
    with sessions() as session:
        assert session.get_one(ApiKey, key.id).last_used_at is not None


def test_reads_are_open_by_default_and_closed_by_the_setting(
    engine: Engine, sessions: sessionmaker[Session], tiny_clustered: int
) -> None:
    open_reads = api(engine, sessions)
    for path in ("/models", "/heads", f"/models/{TINY}", "/jobs", "/clusterings", "/", "/health"):
        assert open_reads.get(path).status_code == 200, path

    closed = api(engine, sessions, reads_require_key=True)
    for path in ("/models", "/heads", f"/models/{TINY}", "/jobs", "/clusterings", f"/models/{TINY}/export"):
        assert closed.get(path).status_code == 401, path
    # The page, its files, the health check and the API description stay open.
    for path in ("/", "/static/app.js", "/palette.json", "/health", "/openapi.json"):
        assert closed.get(path).status_code == 200, path
    with_key = api(engine, sessions, grant_key(sessions), reads_require_key=True)
    assert with_key.get("/heads", params={"model": TINY}).json()["total"] == 8


def test_the_cli_creates_lists_and_revokes_keys(committed_database_url: str) -> None:
    from sqlalchemy import create_engine

    env = {**os.environ, "DATABASE_URL": committed_database_url}

    def headcat(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service.cli", "keys", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip

    made = headcat("create", "ci robot")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("hc_")
    listed = headcat("list")
    assert "ci robot" in listed.stdout
    assert secret[:11] in listed.stdout
    assert secret not in listed.stdout + listed.stderr

    engine = create_engine(committed_database_url)
    client = TestClient(create_app(engine), headers={"Authorization": f"Bearer {secret}"})
    body = {"models": ["nope"]}
    assert client.post("/clusterings", json=body).status_code == 404  # authenticated; the model is unknown
    revoked = headcat("revoke", secret[:11])
    assert revoked.returncode == 0, revoked.stderr
    assert client.post("/clusterings", json=body).status_code == 403
    assert headcat("revoke", "hc_zzzzzzzz").returncode == 2
    engine.dispose()


def test_delete_model_removes_it_and_its_data_in_one_transaction(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int
) -> None:
    assert client.delete("/models/nope").status_code == 404
    queued = client.post("/clusterings", json={"models": [TINY], "k": 3})
    assert queued.status_code == 202
    busy = client.delete(f"/models/{TINY}")
    assert busy.status_code == 409, busy.text
    with sessions() as session, session.begin():
        session.execute(text("UPDATE jobs SET status = 'failed'"))
    answer = client.delete(f"/models/{TINY}")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"name": TINY, "heads": 8, "clusterings": 1}
    assert client.get(f"/models/{TINY}").status_code == 404
    with sessions() as session:
        for table in ("heads", "head_features", "feature_runs", "head_assignments", "clusterings"):
            assert session.scalar(text(f"SELECT count(*) FROM {table}")) == 0, table


# --- hostile input ------------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path: Path, tiny_bert_path: Path) -> dict[str, Path]:
    """A data root with a corpus, a model root with the tiny model, and files outside both."""
    data, models, outside = tmp_path / "data", tmp_path / "models", tmp_path / "outside"
    for folder in (data, models, outside):
        folder.mkdir()
    (data / "ok.txt").write_text("A sentence.\nAnother one.\n")
    (outside / "secret.txt").write_text("not for you\n")
    (data / "link.txt").symlink_to(outside / "secret.txt")
    (data / "linkdir").symlink_to(outside, target_is_directory=True)
    shutil.copytree(tiny_bert_path, models / "tiny")
    shutil.copytree(tiny_bert_path, outside / "tiny")
    return {"data": data, "models": models, "outside": outside}


def rooted(engine: Engine, sessions: sessionmaker[Session], roots: dict[str, Path], **settings: Any) -> TestClient:
    options = {"data_roots": [roots["data"]], "model_roots": [roots["models"]], **settings}
    return api(engine, sessions, grant_key(sessions), **options)


def test_ingest_paths_are_resolved_and_must_lie_under_the_roots(
    engine: Engine, sessions: sessionmaker[Session], roots: dict[str, Path]
) -> None:
    client = rooted(engine, sessions, roots)
    data, models, outside = roots["data"], roots["models"], roots["outside"]
    before = job_count(sessions)
    refused = {
        "corpus": [
            str(outside / "secret.txt"),
            f"{data}/../outside/secret.txt",
            str(data / "link.txt"),
            str(data / "linkdir" / "secret.txt"),
            "/etc/passwd.txt",
            "~/.bash_history.txt",
        ],
        # and names huggingface_hub refuses as repo ids: not sent to the hub, no server error
        "model": [str(outside / "tiny"), f"{models}/../outside/tiny", "/", "../../etc", "a/../../b", "T2.",
                  "org/name-", "org--x/name"],
    }  # fmt: skip
    for field, specs in refused.items():
        for spec in specs:
            body = ingest_request(models / "tiny", name="evil", **{field: spec})
            answer = client.post("/ingests", json=body)
            assert answer.status_code == 422, (spec, answer.text)
            assert answer.json()["field"] == field, (spec, answer.text)
    assert job_count(sessions) == before

    body = ingest_request(f"{models}/./tiny", name="fine", corpus=f"{data}/sub/../ok.txt")
    answer = client.post("/ingests", json=body)
    assert answer.status_code == 202, answer.text
    with sessions() as session:
        request = session.get_one(Job, answer.json()["job_id"]).request
    assert request["model"] == str((models / "tiny").resolve())  # the worker opens what was checked
    assert request["corpus"] == str((data / "ok.txt").resolve())


def test_without_roots_no_file_or_local_model_is_read_and_hub_access_can_be_turned_off(
    engine: Engine, sessions: sessionmaker[Session], roots: dict[str, Path], minilm_path: Path
) -> None:
    client = rooted(engine, sessions, roots, data_roots=[], model_roots=[], allow_hub=False)
    packaged = str(minilm_path)  # the quickstart's model is always allowed
    for overrides, field in [
        ({"corpus": str(roots["data"] / "ok.txt")}, "corpus"),
        ({"model": str(roots["models"] / "tiny")}, "model"),
        ({"model": "bert-base-uncased"}, "model"),
        ({"model": "google-bert/bert-base-uncased"}, "model"),
        ({"corpus": "hub:glue:mrpc"}, "corpus"),
    ]:
        answer = client.post("/ingests", json={"name": "x", "model": packaged, "corpus": "builtin:wiki", **overrides})
        assert answer.status_code == 422, (overrides, answer.text)
        assert answer.json()["field"] == field
    answer = client.post("/ablations", json={"model": TINY, "data": "hub:squad", "task": "drift"})
    assert (answer.status_code, answer.json()["field"]) == (422, "data")
    assert "hub access is off" in answer.json()["detail"]
    answer = client.post("/ingests", json={"name": "x", "model": packaged, "corpus": "builtin:lee", "samples": 8})
    assert answer.status_code == 202, answer.text


def test_ablation_data_must_lie_under_the_data_roots(
    engine: Engine, sessions: sessionmaker[Session], roots: dict[str, Path], tiny_clustered: int
) -> None:
    client = rooted(engine, sessions, roots)
    for spec in (str(roots["outside"] / "secret.txt"), str(roots["data"] / "link.txt"), "/etc/hostname"):
        answer = client.post("/ablations", json={"model": TINY, "data": spec, "task": "drift", "device": "cpu"})
        assert (answer.status_code, answer.json()["field"]) == (422, "data"), answer.text
    answer = client.post("/ablations", json={"model": TINY, "data": str(roots["data"] / "ok.txt"), "task": "drift",
                                             "plan": [{"prune": "0:1"}], "device": "cpu"})  # fmt: skip
    assert answer.status_code == 202, answer.text


def test_remote_code_is_never_run(client: TestClient, sessions: sessionmaker[Session], tmp_path: Path,
                                  tiny_bert_path: Path) -> None:  # fmt: skip
    from ingest.loading import ModelLoadError, load_model

    evil = tmp_path / "evil-model"
    shutil.copytree(tiny_bert_path, evil)
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import BertConfig as EvilConfig\n"
    (evil / "configuration_evil.py").write_text(code)
    (evil / "modeling_evil.py").write_text(code + "from transformers import BertModel as EvilModel\n")
    config = json.loads((evil / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"}
    (evil / "config.json").write_text(json.dumps(config))
    try:
        load_model(str(evil), device="cpu")
    except ModelLoadError:
        pass  # refusing is fine too; running the code is not
    assert not marker.exists()

    # The request schema has no switch for it: the field is refused, named, and no job is written.
    body = {**ingest_request(tiny_bert_path, name="remote"), "trust_remote_code": True}
    before = job_count(sessions)
    answer = client.post("/ingests", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "trust_remote_code"
    assert answer.json()["detail"].startswith(
        "trust_remote_code: unknown field (allowed: model, name, revision, series, step, corpus, "
    )
    assert job_count(sessions) == before
    assert "trust_remote_code" not in json.dumps(client.get("/openapi.json").json())


def test_oversized_bodies_are_refused_before_they_are_read(
    engine: Engine, sessions: sessionmaker[Session], tiny_clustered: int
) -> None:
    client = api(engine, sessions, grant_key(sessions), max_body_bytes=4096)
    before = job_count(sessions)
    big = {"models": [TINY], "k": 2, "pad": "x" * 10_000}
    answer = client.post("/clusterings", json=big)
    assert answer.status_code == 413, answer.text
    assert answer.json()["field"] == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"models": ["tiny"], "k": 2, "pad": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    answer = client.post("/clusterings", content=chunks(), headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, answer.text
    assert job_count(sessions) == before
    assert client.post("/clusterings", json={"models": [TINY], "k": 2}).status_code == 202


@pytest.mark.parametrize(
    "path",
    ["/heads?limit=1001", "/clusterings?limit=1001", "/jobs?limit=1001", f"/models/{TINY}/ablations?limit=101",
     "/heads?offset=-1", "/heads?limit=0"],
)  # fmt: skip
def test_page_sizes_are_capped(client: TestClient, path: str) -> None:
    answer = client.get(path)
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize(
    "evil", ["x' OR '1'='1", "tiny'; DROP TABLE models; --", 'tiny" OR 1=1 --', "%", "tiny\\", "_iny"]
)
def test_strings_reach_sql_only_as_bound_parameters(
    client: TestClient, sessions: sessionmaker[Session], tiny_clustered: int, evil: str
) -> None:
    assert client.get("/heads", params={"model": evil}).status_code == 404
    assert client.get("/heads", params={"model": TINY, "type": evil}).status_code == 422
    assert client.get(f"/models/{evil}").status_code in (404, 422)
    assert client.get("/compare", params={"models": f"{TINY},{evil}"}).status_code == 404
    assert client.post("/clusterings", json={"models": [evil]}).status_code == 404
    assert client.delete(f"/models/{evil}").status_code in (404, 405, 422)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(CatalogModel)) == 1
    assert client.get("/heads", params={"model": TINY}).json()["total"] == 8


def test_nul_bytes_are_refused_as_bad_input(client: TestClient, tiny_clustered: int) -> None:
    for answer in (
        client.get("/heads", params={"model": "ti\x00ny"}),
        client.get("/models/ti%00ny"),
        client.post("/clusterings", json={"models": ["ti\x00ny"]}),
    ):
        assert answer.status_code == 422, answer.text


def test_no_sql_is_built_from_strings_in_the_service() -> None:
    """Every query is SQLAlchemy Core/ORM or text() with bound parameters: no f-string or % SQL.

    One module is exempt: the catalog importer composes its staging statements from the identifiers of
    ``service/catalogs/tables.py`` (table, column and run-kind names written in code); an archive's rows reach
    PostgreSQL only through COPY, and only the columns ``tables.py`` names are read from its files
    (``importer._batches``), so nothing of an archive is ever part of a statement's text."""
    pattern = re.compile(r"(text|exec_driver_sql|execute)\(\s*(f[\"']|[\"'][^\"']*[\"']\s*(%|\.format))")
    exempt = {ROOT / "service" / "catalogs" / "importer.py"}
    offenders = [
        f"{path}:{number}"
        for path in (ROOT / "service").rglob("*.py")
        if path not in exempt
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders
    assert all(path.is_file() for path in exempt)  # an exemption that names nothing is stale


def test_settings_read_roots_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADCAT_DATA_ROOTS", f"/srv/data{os.pathsep}/srv/more")
    monkeypatch.setenv("HEADCAT_MODEL_ROOTS", '["/srv/models"]')
    monkeypatch.setenv("HEADCAT_ALLOW_HUB", "false")
    monkeypatch.setenv("HEADCAT_READS_REQUIRE_KEY", "true")
    settings = Settings()
    assert settings.data_roots == [Path("/srv/data"), Path("/srv/more")]
    assert settings.model_roots == [Path("/srv/models")]
    assert settings.allow_hub is False
    assert settings.reads_require_key is True
