"""The job queue in this process: the stall check on procrastinate's in-memory connector, the worker's
reconnect loop with a stand-in for one connected spell, and one real worker spell (procrastinate on the
committed test database) that runs a deferred job and stops on SIGTERM. Seconds, no worker processes, so
mutmut can measure ``service/jobs/queue.py`` with them (``tests/service/test_jobs.py`` runs real workers)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import procrastinate
import psycopg
import pytest
from procrastinate.exceptions import ConnectorException
from procrastinate.testing import InMemoryConnector
from sqlalchemy import create_engine, text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import queue, repository, runner
from service.jobs.repository import TASK_NAME
from service.orm import Job
from tests.waiting import PATIENCE

KIND = "syntax"  # a kind the jobs table takes; its handler is replaced by ``done`` here


def done(sessions: sessionmaker[Session], request: dict[str, Any], progress: runner.Progress) -> runner.Writer:
    return lambda session: {"done": request}


@pytest.fixture(autouse=True)
def done_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(runner.HANDLERS, KIND, f"{__name__}:done")


def asyncio_with(**replaced: Any) -> ModuleType:
    """``asyncio`` as the queue module sees it, with some functions replaced (the event loop keeps the real ones)."""
    proxy = ModuleType("asyncio")
    proxy.__dict__.update(vars(asyncio), **replaced)
    return proxy


def timing_out(waits: list[float]) -> Any:
    """``asyncio.wait_for`` for the reconnect waits: records each timeout and times out at once."""

    async def wait_for(awaitable: Any, timeout: float) -> None:
        awaitable.close()
        waits.append(timeout)
        raise TimeoutError

    return wait_for


def test_conninfo_is_the_libpq_form_of_the_url_password_included() -> None:
    assert queue.conninfo("postgresql+psycopg://user:secret@db.local:5433/headcat") == (
        "postgresql://user:secret@db.local:5433/headcat"
    )
    assert queue.conninfo("postgresql://u@127.0.0.1/x?sslmode=disable") == "postgresql://u@127.0.0.1/x?sslmode=disable"


def test_the_queue_app_runs_our_task_and_retries_it_after_a_lost_database(sessions: sessionmaker[Session]) -> None:
    app = queue.create_queue_app("postgresql+psycopg://u:p@h:5/db", sessions)
    assert app.connector._pool_args["conninfo"] == "postgresql://u:p@h:5/db"  # type: ignore[attr-defined]
    task = app.tasks[TASK_NAME]
    assert (task.name, task.queue) == (TASK_NAME, "cpu")
    retry = task.retry_strategy
    assert isinstance(retry, procrastinate.RetryStrategy)
    assert (retry.max_attempts, retry.wait, retry.retry_exceptions) == (10, 5, {OperationalError, InterfaceError})
    job_10 = SimpleNamespace(attempts=10)  # past max_attempts: only a released job is run again, at once
    released = retry.get_retry_decision(exception=runner.Released("job 1"), job=job_10)  # type: ignore[arg-type]
    assert released is not None
    assert released.retry_at is None
    assert retry.get_retry_decision(exception=OperationalError("s", {}, Exception()), job=job_10) is None  # type: ignore[arg-type]
    with sessions() as session, session.begin():
        job, _ = repository.submit(session, KIND, "gpu", {"n": "task"}, enqueue=False)
    task(job_id=job.id)  # what a worker calls
    with sessions() as session:
        stored = session.get_one(Job, job.id)
        assert (stored.status, stored.result) == ("succeeded", {"done": {"n": "task"}})


# --- the stall check ------------------------------------------------------------------------------------


def in_memory_job(app: procrastinate.App, heartbeat_age: float) -> Any:
    """A procrastinate job taken by a worker whose last heartbeat was ``heartbeat_age`` seconds ago."""

    async def defer_and_fetch() -> Any:
        await app.configure_task(name=TASK_NAME, queue="cpu", allow_unknown=True).defer_async(job_id=0)
        worker = await app.job_manager.register_worker()
        fetched = await app.job_manager.fetch_job(queues=None, worker_id=worker)
        connector: Any = app.connector
        connector.workers[worker] = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=heartbeat_age)
        return fetched

    with app.open():
        return asyncio.run(defer_and_fetch())


def ours(sessions: sessionmaker[Session], procrastinate_job: Any, request: dict[str, Any], claims: int = 1) -> int:
    with sessions() as session, session.begin():
        job, _ = repository.submit(session, KIND, "gpu", request, enqueue=False)
        for _ in range(claims):
            repository.claim(session, job.id, "dead-worker:9")
        job.procrastinate_job_id = procrastinate_job.id
        return job.id


def status(app: procrastinate.App, job: Any) -> str:
    connector: Any = app.connector
    return str(connector.jobs[job.id]["status"])


def run(app: procrastinate.App, coroutine: Any) -> Any:
    with app.open():
        return asyncio.run(coroutine)


def test_the_stall_check_requeues_jobs_whose_worker_stopped_beating(sessions: sessionmaker[Session]) -> None:
    app = procrastinate.App(connector=InMemoryConnector())
    stalled, fresh = in_memory_job(app, heartbeat_age=40), in_memory_job(app, heartbeat_age=10)
    also = in_memory_job(app, heartbeat_age=50)
    stalled_id = ours(sessions, stalled, {"n": "stalled"})
    fresh_id = ours(sessions, fresh, {"n": "fresh"})
    ours(sessions, also, {"n": "also stalled"})
    assert run(app, queue.requeue_stalled(app, sessions, 30)) == 2  # counted, both
    with sessions() as session:
        requeued, untouched = session.get_one(Job, stalled_id), session.get_one(Job, fresh_id)
        assert (requeued.status, requeued.error) == ("queued", "worker dead-worker:9 stopped responding; requeued")
        assert (untouched.status, untouched.error) == ("running", None)
    assert (status(app, stalled), status(app, fresh)) == ("todo", "doing")
    assert run(app, queue.requeue_stalled(app, sessions, 5)) == 1  # a shorter patience: the other one too
    assert status(app, fresh) == "todo"


def test_the_stall_check_goes_on_past_a_job_it_cannot_requeue(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = procrastinate.App(connector=InMemoryConnector())
    first, second = in_memory_job(app, 60), in_memory_job(app, 60)
    seen: list[int] = []

    async def requeue_one(app: procrastinate.App, sessions: sessionmaker[Session], job: Any) -> int:
        seen.append(job.id)
        if job.id == first.id:
            raise ConnectorException("it finished meanwhile\nmore detail") from ValueError("job is not doing")
        return 1

    monkeypatch.setattr(queue, "_requeue_one", requeue_one)
    with caplog.at_level(logging.INFO, logger="service.jobs.queue"):
        assert run(app, queue.requeue_stalled(app, sessions, 30)) == 1
    assert sorted(seen) == sorted([first.id, second.id])
    assert f"Stalled job {first.id} was not requeued: job is not doing" in caplog.messages


@pytest.mark.parametrize("finished", ["succeeded", "failed"])
def test_a_stalled_job_that_finished_here_is_closed_as_it_ended(sessions: sessionmaker[Session], finished: str) -> None:
    app = procrastinate.App(connector=InMemoryConnector())
    job = in_memory_job(app, 60)
    job_id = ours(sessions, job, {"n": finished})
    with sessions() as session, session.begin():
        if finished == "succeeded":
            repository.succeed(session, job_id, {})
        else:
            repository.fail(session, job_id, "boom")
    assert run(app, queue._requeue_one(app, sessions, job)) == 0
    assert status(app, job) == finished
    with sessions() as session:
        assert session.get_one(Job, job_id).status == finished


def test_a_stalled_job_still_computing_in_this_process_is_left_alone(sessions: sessionmaker[Session]) -> None:
    app = procrastinate.App(connector=InMemoryConnector())
    job = in_memory_job(app, 60)
    job_id = ours(sessions, job, {"n": "here"})
    runner.RUNNING.add(job_id)
    try:
        assert run(app, queue._requeue_one(app, sessions, job)) == 0
    finally:
        runner.RUNNING.discard(job_id)
    assert status(app, job) == "doing"
    with sessions() as session:
        assert session.get_one(Job, job_id).status == "running"


def test_a_stalled_job_without_a_row_of_ours_is_retried(sessions: sessionmaker[Session]) -> None:
    app = procrastinate.App(connector=InMemoryConnector())
    job = in_memory_job(app, 60)
    assert run(app, queue._requeue_one(app, sessions, job)) == 1
    assert status(app, job) == "todo"


def test_the_reaper_checks_every_third_of_the_patience_and_survives_errors(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    waits: list[float] = []
    outcomes: Iterator[Any] = iter(
        [psycopg.OperationalError("connection refused\nis the server running?"), ValueError("bug"), 0]
    )

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) > 3:
            raise asyncio.CancelledError

    async def requeue_stalled(app: Any, sessions: Any, stalled_after: float) -> int:
        assert stalled_after in (12.0, 1.5)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(queue, "asyncio", asyncio_with(sleep=sleep))
    monkeypatch.setattr(queue, "requeue_stalled", requeue_stalled)
    with caplog.at_level(logging.INFO, logger="service.jobs.queue"), pytest.raises(asyncio.CancelledError):
        asyncio.run(queue.reap_stalled(None, sessions, 12.0))  # type: ignore[arg-type]
    assert waits == [4.0, 4.0, 4.0, 4.0]
    assert caplog.messages[:2] == [
        "The stall check could not reach the database (connection refused); trying again later",
        "The stall check failed; trying again later",
    ]
    assert caplog.records[1].exc_info is not None
    waits.clear()
    outcomes = iter([0, 0, 0])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(queue.reap_stalled(None, sessions, 1.5))  # type: ignore[arg-type]
    assert waits[0] == 1.0  # at least a second


# --- the worker -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("long", "after"), [(61.0, [1, 2, 4, 8, 16]), (60.0, [8, 16, 30, 30, 30])])
def test_the_worker_reconnects_with_a_doubling_delay_until_stopped(
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    long: float,
    after: list[int],
) -> None:
    """Each spell ends by a connection error or a lost database; the waits double up to 30 s, start again
    at 1 s after a spell that lasted over a minute (not one of exactly a minute), and SIGTERM ends the loop."""
    spells = iter(["refused", "empty", "lost", "long", "refused", "refused", "refused", "refused", "stop"])
    clock = [1000.0]
    waits: list[float] = []
    seen: list[dict[str, Any]] = []

    async def spell(url: str, sessions: Any, stop: asyncio.Event, **kwargs: Any) -> None:
        seen.append({"url": url, **kwargs})
        kind = next(spells)
        if kind == "refused":
            raise psycopg.OperationalError("connection refused\nis the server running?")
        if kind == "empty":
            raise OSError()  # no message: its type is named
        if kind == "long":
            clock[0] += long
            raise OSError("network unreachable")
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGTERM)
            while not stop.is_set():  # the loop runs the handler run_worker installed
                await asyncio.sleep(0.01)

    monkeypatch.setattr(queue, "_work_until_stopped_or_disconnected", spell)
    monkeypatch.setattr(queue, "asyncio", asyncio_with(wait_for=timing_out(waits)))
    monkeypatch.setattr(queue, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="service.jobs.queue"):
        stopped_by = asyncio.run(queue.run_worker("postgresql://x", sessions, queues=["gpu", "cpu"], concurrency=2,
                                                  stalled_after=9.0))  # fmt: skip
    assert stopped_by == "SIGTERM"
    assert waits == [1.0, 2.0, 4.0, *after]
    assert seen[0] == {"url": "postgresql://x", "queues": ["gpu", "cpu"], "concurrency": 2, "stalled_after": 9.0}
    assert len(seen) == 9
    unavailable = "The catalog database is unavailable ({}); reconnecting in {} s"
    assert (
        caplog.messages
        == [
            unavailable.format("connection refused", 1),
            unavailable.format("OSError", 2),
            "The worker lost the catalog database; reconnecting",
            unavailable.format("network unreachable", 8),  # over a minute: the next wait is 1 s
            *(unavailable.format("connection refused", delay) for delay in after[1:]),
            "SIGTERM: the worker stops (a job it runs is released for another worker)",
        ]
    )
    assert signal.getsignal(signal.SIGTERM) == before  # its handlers are removed again


def test_the_reconnect_delay_is_capped(sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    spells = iter(["refused"] * 7 + ["stop"])
    waits: list[float] = []

    async def spell(url: str, sessions: Any, stop: asyncio.Event, **kwargs: Any) -> None:
        if next(spells) == "refused":
            raise psycopg.OperationalError("connection refused")
        os.kill(os.getpid(), signal.SIGINT)
        while not stop.is_set():
            await asyncio.sleep(0.01)

    monkeypatch.setattr(queue, "_work_until_stopped_or_disconnected", spell)
    monkeypatch.setattr(queue, "asyncio", asyncio_with(wait_for=timing_out(waits)))
    asyncio.run(queue.run_worker("postgresql://x", sessions, queues=["cpu"], concurrency=1))
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert queue.RECONNECT_MAX_DELAY == 30.0


@pytest.fixture(scope="module")
def committed(committed_database_url: str) -> Iterator[tuple[str, sessionmaker[Session]]]:
    engine = create_engine(committed_database_url)
    yield committed_database_url, sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


def test_a_worker_in_this_process_runs_its_queues_requeues_a_stalled_job_and_stops_on_sigterm(
    committed: tuple[str, sessionmaker[Session]],
) -> None:
    """One real spell (procrastinate on the committed test database, patience 3 s): it prunes workers silent
    for longer, runs the jobs of its queue, and its stall check requeues a job left ``doing`` by a dead worker,
    which it then runs; a job of another queue is left alone."""
    url, sessions = committed

    def defer(queue_name: str, request: dict[str, Any]) -> tuple[int, int]:
        with sessions() as session, session.begin():
            job, _ = repository.submit(session, KIND, queue_name, request, enqueue=True)
            assert job.procrastinate_job_id is not None
            return job.id, job.procrastinate_job_id

    plain, plain_p = defer("gpu", {"n": "plain"})
    stalled, stalled_p = defer("gpu", {"n": "stalled"})
    other, other_p = defer("cpu", {"n": "other queue"})
    with sessions() as session, session.begin():
        repository.claim(session, stalled, "dead:1")
        session.execute(text("UPDATE procrastinate_jobs SET status = 'doing' WHERE id = :i"), {"i": stalled_p})
        silent = session.execute(text("INSERT INTO procrastinate_workers (last_heartbeat) VALUES"
                                      " (now() - interval '10 seconds') RETURNING id")).scalar_one()  # fmt: skip

    def status(job_id: int) -> str:
        with sessions() as session:
            return session.get_one(Job, job_id).status

    async def main() -> None:
        worker = asyncio.create_task(queue.run_worker(url, sessions, queues=["gpu"], concurrency=1, stalled_after=3))
        deadline = time.monotonic() + PATIENCE  # a hang, not a slow machine (tests.waiting)
        while status(plain) != "succeeded" or status(stalled) != "succeeded":
            assert time.monotonic() < deadline, (status(plain), status(stalled))
            assert not worker.done(), worker
            await asyncio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(worker, PATIENCE)

    asyncio.run(main())
    with sessions() as session:
        jobs = {job_id: session.get_one(Job, job_id) for job_id in (plain, stalled, other)}
        assert (jobs[plain].status, jobs[plain].result, jobs[plain].attempts) == (
            "succeeded", {"done": {"n": "plain"}}, 1,
        )  # fmt: skip
        assert (jobs[stalled].status, jobs[stalled].attempts) == ("succeeded", 2)  # requeued, then run here
        assert (jobs[other].status, jobs[other].attempts) == ("queued", 0)
        query = text("SELECT id, status FROM procrastinate_jobs WHERE id = ANY(:i)")
        states: dict[int, str] = dict(session.execute(query, {"i": [plain_p, stalled_p, other_p]}).all())
        assert states == {plain_p: "succeeded", stalled_p: "succeeded", other_p: "todo"}
        workers = session.execute(text("SELECT count(*) FROM procrastinate_workers WHERE id = :i"), {"i": silent})
        assert workers.scalar_one() == 0  # silent for longer than the patience: pruned


MEETING = threading.Barrier(2, timeout=PATIENCE)
HOLD_SECONDS = 3.0


def rendezvous(sessions: sessionmaker[Session], request: dict[str, Any], progress: runner.Progress) -> runner.Writer:
    """A job that only ends once another job is running beside it, and then runs on for a while."""
    MEETING.wait()
    time.sleep(HOLD_SECONDS)
    return lambda session: {"met": request}


def test_a_worker_runs_concurrency_jobs_at_once_and_beats_well_within_its_patience(
    committed: tuple[str, sessionmaker[Session]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``concurrency=2``: two jobs that wait for each other both succeed (one at a time, the first would wait at the
    barrier until it gave up). While they run, the worker's heartbeat is never older than two thirds of its patience
    (3 s): a slower heartbeat would let any live worker's stall check take it for dead and requeue its jobs."""
    url, sessions = committed
    monkeypatch.setitem(runner.HANDLERS, KIND, f"{__name__}:rendezvous")
    MEETING.reset()
    with sessions() as session, session.begin():
        ids = [repository.submit(session, KIND, "gpu", {"n": n}, enqueue=True)[0].id for n in ("a", "b")]

    def statuses() -> list[str]:
        with sessions() as session:
            return [session.get_one(Job, job_id).status for job_id in ids]

    def heartbeat_age() -> float:
        query = text("SELECT extract(epoch FROM now() - max(last_heartbeat)) FROM procrastinate_workers")
        with sessions() as session:
            return float(session.execute(query).scalar_one())

    ages: list[float] = []

    async def main() -> None:
        worker = asyncio.create_task(queue.run_worker(url, sessions, queues=["gpu"], concurrency=2, stalled_after=3))
        deadline = time.monotonic() + PATIENCE  # a hang, not a slow machine (tests.waiting)
        while statuses() != ["succeeded", "succeeded"]:
            assert time.monotonic() < deadline, statuses()
            assert "failed" not in statuses(), statuses()
            assert not worker.done(), worker
            if statuses() == ["running", "running"]:
                ages.append(heartbeat_age())
            await asyncio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(worker, PATIENCE)

    asyncio.run(main())
    with sessions() as session:
        assert [session.get_one(Job, job_id).result for job_id in ids] == [{"met": {"n": "a"}}, {"met": {"n": "b"}}]
    assert len(ages) >= 10  # sampled through the 3 s both jobs ran together
    assert max(ages) < 2.0, ages
