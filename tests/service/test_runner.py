"""The job runner in this process, against the test database: claim, compute, store the outcome with
``succeeded`` (or fail with the message), progress on the row, an outage waited out, a superseded attempt
dropped. The handlers are small ones registered for the test (the runner is the same for every kind),
so these tests take seconds, and mutmut can measure ``service/jobs/runner.py`` with them."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict, InvalidInput
from service.jobs import repository, runner
from service.orm import Job

KIND = "syntax"  # a kind the jobs table takes, its handler replaced by ``echo`` here
CALLS: list[tuple[str, Any]] = []  # what the test handlers saw, in order


def gone(message: str = "server closed the connection") -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception(message))


def echo(sessions: sessionmaker[Session], request: dict[str, Any], progress: runner.Progress) -> runner.Writer:
    """Reports progress 1/3 .. 3/3, then writes ``{"echo": request}``; ``request["fail"]`` raises instead."""
    with sessions() as session:  # a handler reads the catalog through the sessions it is given
        session.execute(text("SELECT 1"))
    CALLS.append(("running", sorted(runner.RUNNING)))
    if request.get("fail") == "headcat":
        raise InvalidInput("k: too many clusters", field="k")
    if request.get("fail") == "bug":
        raise KeyError("boom")
    if request.get("fail") == "database":
        raise gone()
    for done in range(1, 4):
        progress(done, 3)

    def write(session: Session) -> dict[str, Any]:
        CALLS.append(("write", request))
        session.execute(text("SELECT 1"))  # it writes through the job's transaction
        failures = request.get("write_failures", 0)
        if len([c for c in CALLS if c[0] == "write"]) <= failures:
            raise gone()
        return {"echo": request}

    return write


@pytest.fixture(autouse=True)
def echo_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    CALLS.clear()
    monkeypatch.setitem(runner.HANDLERS, KIND, f"{__name__}:echo")


def submit(sessions: sessionmaker[Session], request: dict[str, Any]) -> int:
    with sessions() as session, session.begin():
        job, created = repository.submit(session, KIND, "gpu", request, enqueue=False)
        assert created
        return job.id


def stored(sessions: sessionmaker[Session], job_id: int) -> Job:
    with sessions() as session:
        return session.get_one(Job, job_id)


def test_a_job_runs_once_claimed_and_stores_its_outcome_with_succeeded(sessions: sessionmaker[Session]) -> None:
    job_id = submit(sessions, {"n": 1})
    seen: list[tuple[int, int]] = []
    assert runner.execute(sessions, job_id, runner="w:7", progress=lambda d, t: seen.append((d, t))) == "succeeded"
    job = stored(sessions, job_id)
    assert (job.status, job.result, job.error, job.attempts, job.runner) == ("succeeded", {"echo": {"n": 1}}, None, 1,
                                                                            "w:7")  # fmt: skip
    assert (job.progress_done, job.progress_total) == (3, 3)  # the last report always reaches the row
    assert seen == [(1, 3), (2, 3), (3, 3)]  # and every one reaches the caller's progress
    assert CALLS == [("running", [job_id]), ("write", {"n": 1})]  # it counted as running here while it computed
    assert job_id not in runner.RUNNING
    assert runner.execute(sessions, job_id) is None  # finished: nothing runs again
    assert CALLS == [("running", [job_id]), ("write", {"n": 1})]


@pytest.mark.parametrize(("interval", "lines"), [("1e-9", ["2/3 (67 %)", "3/3 (100 %)"]), ("60", ["3/3 (100 %)"])])
def test_a_worker_without_a_progress_callback_logs_its_progress_at_the_configured_pace(
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    interval: str,
    lines: list[str],
) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("HEADCAT_PROGRESS_INTERVAL", interval)
    get_settings.cache_clear()
    try:
        job_id = submit(sessions, {"n": 2})
        with caplog.at_level(logging.INFO, logger="service.jobs.runner"):
            assert runner.execute(sessions, job_id) == "succeeded"
    finally:
        get_settings.cache_clear()
    prefix = f"Job {job_id} (syntax): "
    assert [m.split(",")[0].removeprefix(prefix) for m in caplog.messages if m.startswith(prefix)] == lines
    assert stored(sessions, job_id).runner == f"{socket.gethostname()}:{os.getpid()}"


def test_a_headcat_error_fails_the_job_with_its_message(sessions: sessionmaker[Session]) -> None:
    job_id = submit(sessions, {"fail": "headcat"})
    assert runner.execute(sessions, job_id) == "failed"
    job = stored(sessions, job_id)
    assert (job.status, job.error, job.result) == ("failed", "k: too many clusters", None)
    assert job.finished_at is not None
    again = submit(sessions, {"fail": "headcat", "n": 2})
    with pytest.raises(InvalidInput, match="^k: too many clusters$"):
        runner.execute(sessions, again, raise_errors=True)
    assert stored(sessions, again).status == "failed"
    assert again not in runner.RUNNING


def test_an_unexpected_error_fails_the_job_naming_it_and_is_raised(sessions: sessionmaker[Session]) -> None:
    job_id = submit(sessions, {"fail": "bug"})
    with pytest.raises(KeyError, match="boom"):
        runner.execute(sessions, job_id)
    job = stored(sessions, job_id)
    assert (job.status, job.error) == ("failed", "KeyError: 'boom'")
    assert job_id not in runner.RUNNING


def test_a_database_outage_while_computing_leaves_the_job_running_for_a_retry(sessions: sessionmaker[Session]) -> None:
    job_id = submit(sessions, {"fail": "database"})
    with pytest.raises(OperationalError):
        runner.execute(sessions, job_id)
    job = stored(sessions, job_id)
    assert (job.status, job.error, job.attempts) == ("running", None, 1)
    assert job_id not in runner.RUNNING


def test_the_outcome_waits_out_an_outage_with_a_growing_delay(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    delays: list[float] = []
    monkeypatch.setattr(runner.time, "sleep", delays.append)
    job_id = submit(sessions, {"write_failures": 5})
    assert runner.execute(sessions, job_id) == "succeeded"
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0]  # doubled, at most 5 s
    job = stored(sessions, job_id)
    assert (job.status, job.result) == ("succeeded", {"echo": {"write_failures": 5}})


def test_an_outage_past_the_patience_or_a_bad_statement_is_raised(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(runner, "WRITE_PATIENCE", -1.0)
    job_id = submit(sessions, {"write_failures": 1})
    with pytest.raises(OperationalError):
        runner.execute(sessions, job_id)
    assert stored(sessions, job_id).status == "running"  # not failed for the database's fault

    def bad_statement(session: Session) -> dict[str, Any]:
        raise ProgrammingError("SELECT nonsense", {}, Exception("syntax error"))

    monkeypatch.setattr(runner, "WRITE_PATIENCE", 300.0)
    other = submit(sessions, {"n": "bad statement"})
    with sessions() as session, session.begin():
        repository.claim(session, other, "w")
    with pytest.raises(ProgrammingError):
        runner._store(sessions, other, 1, bad_statement)


def test_the_outcome_is_tried_again_until_the_patience_is_past(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no time passing and no patience, the deadline is now: not yet past, so one more try."""
    from types import SimpleNamespace

    monkeypatch.setattr(runner, "time", SimpleNamespace(monotonic=lambda: 50.0, sleep=lambda seconds: None))
    monkeypatch.setattr(runner, "WRITE_PATIENCE", 0.0)
    job_id = submit(sessions, {"write_failures": 1, "n": "at the deadline"})
    assert runner.execute(sessions, job_id) == "succeeded"


def test_an_attempt_superseded_while_computing_drops_its_outcome(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit(sessions, {"n": "superseded"})
    original = runner.handler

    def requeued_meanwhile(kind: str) -> Any:
        def prepare(s: sessionmaker[Session], request: dict[str, Any], progress: runner.Progress) -> runner.Writer:
            writer = original(kind)(s, request, progress)
            with sessions() as session, session.begin():  # the stall check gave the job to another worker
                repository.claim(session, job_id, "another:1")
            return writer

        return prepare

    monkeypatch.setattr(runner, "handler", requeued_meanwhile)
    assert runner.execute(sessions, job_id) is None
    job = stored(sessions, job_id)
    assert (job.status, job.attempts, job.runner, job.result) == ("running", 2, "another:1", None)
    assert [c for c in CALLS if c[0] == "write"] == []


def test_progress_reaches_the_row_at_most_every_interval_and_at_the_end(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit(sessions, {"n": "progress"})
    now = [100.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])
    reporter = runner.ProgressReporter(sessions, job_id, interval=2.0)

    def row() -> tuple[int | None, int | None]:
        job = stored(sessions, job_id)
        return job.progress_done, job.progress_total

    reporter(1, 10)
    assert row() == (1, 10)
    now[0] += 1.9
    reporter(2, 10)
    assert row() == (1, 10)  # within the interval: not written
    now[0] += 0.1
    reporter(3, 10)
    assert row() == (3, 10)  # the interval is counted from the last write
    reporter(10, 10)
    assert row() == (10, 10)  # the end is always written
    assert runner.ProgressReporter(sessions, job_id).interval == 0.5


def test_progress_is_skipped_while_the_database_is_gone_but_a_bad_statement_is_raised(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit(sessions, {"n": "progress outage"})
    reporter = runner.ProgressReporter(sessions, job_id)
    errors = iter([gone(), ProgrammingError("UPDATE", {}, Exception("syntax error"))])

    def fail(*args: Any) -> None:
        raise next(errors)

    monkeypatch.setattr(runner.repository, "progress", fail)
    reporter(5, 5)  # not raised: the job goes on
    with pytest.raises(ProgrammingError):
        reporter(5, 5)


def test_what_counts_as_the_database_being_gone() -> None:
    assert runner.database_gone(gone())
    assert runner.database_gone(InterfaceError("SELECT 1", {}, Exception("connection already closed")))
    assert runner.database_gone(DBAPIError("SELECT 1", {}, Exception("reset"), connection_invalidated=True))
    assert not runner.database_gone(DBAPIError("SELECT 1", {}, Exception("x"), connection_invalidated=False))
    assert not runner.database_gone(ProgrammingError("SELECT nonsense", {}, Exception("syntax error")))
    assert not runner.database_gone(ValueError("no"))


def test_every_kind_has_its_handler_and_queue() -> None:
    import service.attributions.service
    import service.clusterings.service
    import service.clusterings.stability
    import service.ingests.service

    assert runner.handler("ingest") is service.ingests.service.prepare
    assert runner.handler("clustering") is service.clusterings.service.prepare
    assert runner.handler("stability") is service.clusterings.stability.prepare
    assert runner.handler("attribution") is service.attributions.service.prepare
    assert set(runner.QUEUES) == set(runner.HANDLERS)


def test_run_inline_refuses_an_identical_active_job_and_returns_the_finished_one(
    sessions: sessionmaker[Session],
) -> None:
    job = runner.run_inline(sessions, KIND, {"n": "inline"})
    assert job.procrastinate_job_id is None  # run here: not deferred to the workers as well
    assert (job.status, job.result, job.runner) == (
        "succeeded", {"echo": {"n": "inline"}}, f"in-process {socket.gethostname()}:{os.getpid()}",
    )  # fmt: skip
    seen: list[tuple[int, int]] = []
    runner.run_inline(sessions, KIND, {"n": "with progress"}, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    queued = submit(sessions, {"n": "queued"})
    with pytest.raises(Conflict) as refused:
        runner.run_inline(sessions, KIND, {"n": "queued"})
    assert refused.value.message == (f"an identical syntax job ({queued}) is already queued; see `GET /jobs/{queued}`")
    with pytest.raises(InvalidInput):
        runner.run_inline(sessions, KIND, {"fail": "headcat"})  # failures are raised


@pytest.mark.parametrize(
    ("setting", "off"), [(None, True), ("1", True), (" TRUE ", True), ("Yes", True), ("on", True), ("0", False)]
)
def test_jobs_turn_model_loading_progress_bars_off_unless_asked(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, off: bool
) -> None:
    """The switch of each library already imported is flipped (stand-ins record it; the real switches are
    process-wide)."""
    from types import SimpleNamespace

    flipped: list[str] = []
    hub = SimpleNamespace(utils=SimpleNamespace(disable_progress_bars=lambda: flipped.append("hub")))
    transformers = SimpleNamespace(
        utils=SimpleNamespace(logging=SimpleNamespace(disable_progress_bar=lambda: flipped.append("transformers")))
    )
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    if setting is None:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", setting)
    runner.quiet_model_loading()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == (setting or "1")
    assert flipped == (["hub", "transformers"] if off else [])
    monkeypatch.delitem(sys.modules, "huggingface_hub")
    monkeypatch.delitem(sys.modules, "transformers")
    flipped.clear()
    runner.quiet_model_loading()  # neither imported: nothing to flip (importing them reads the variable)
    assert flipped == []
    assert "huggingface_hub" not in sys.modules
