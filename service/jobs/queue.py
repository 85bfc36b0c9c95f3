"""The job queue: procrastinate on the catalog's own PostgreSQL.

Jobs are deferred by :func:`service.jobs.repository.submit`, in the same transaction as the
job's row. Workers run :func:`service.jobs.runner.execute` for each. A worker killed while
running a job stops sending heartbeats; any live worker's stall check then puts the job back
on the queue (or fails it for good after ``MAX_ATTEMPTS``).

The database may go away under a worker. procrastinate then stops the worker (its heartbeat
fails) after the running job is done; :func:`run_worker` reconnects, with backoff, until the
server is back, and logs each try. A job whose outcome could not be stored is retried.

SIGTERM or SIGINT stops a worker: the job it runs is released at its next progress step (its row back to
``queued``, procrastinate's job retried at once) for another worker, and :func:`run_worker` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Sequence

import procrastinate
import psycopg
from procrastinate.exceptions import ConnectorException
from procrastinate.jobs import Status
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import repository
from service.jobs.repository import TASK_NAME
from service.jobs.runner import RUNNING, Released, execute

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
RECONNECT_MAX_DELAY = 30.0
# What a worker treats as "the database is unavailable": reconnect, do not crash.
CONNECTION_ERRORS = (ConnectorException, psycopg.OperationalError, psycopg.InterfaceError, DBAPIError, OSError)


def conninfo(url: str) -> str:
    """A libpq connection string (psycopg) from a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class _ReleasedWithoutTraceback(logging.Filter):
    """procrastinate logs a retried job with its traceback: a released job's is no error (runner logs the release)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Released):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("procrastinate.worker").addFilter(_ReleasedWithoutTraceback())


class Retry(procrastinate.RetryStrategy):
    """procrastinate's strategy, and a job released by a stopping worker (:class:`Released`) is retried at once."""

    def get_retry_decision(
        self, *, exception: BaseException, job: procrastinate.jobs.Job
    ) -> procrastinate.RetryDecision | None:
        if isinstance(exception, Released):
            return procrastinate.RetryDecision()
        return super().get_retry_decision(exception=exception, job=job)


def create_queue_app(
    url: str, sessions: sessionmaker[Session], stopping: threading.Event | None = None
) -> procrastinate.App:
    """The queue's app; once ``stopping`` is set, a running job is released at its next progress step."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo(url)))

    # A job that could not store its outcome because the database was gone is run again.
    retry = Retry(max_attempts=10, wait=5, retry_exceptions={OperationalError, InterfaceError})

    @app.task(name=TASK_NAME, queue="cpu", retry=retry)
    def run_job(job_id: int) -> None:
        execute(sessions, job_id, stopping=stopping)

    return app


async def reap_stalled(app: procrastinate.App, sessions: sessionmaker[Session], stalled_after: float) -> None:
    """Forever: requeue jobs whose worker stopped sending heartbeats (killed, lost its machine)."""
    while True:
        await asyncio.sleep(max(1.0, stalled_after / 3))
        try:
            await requeue_stalled(app, sessions, stalled_after)
        except CONNECTION_ERRORS as error:
            log.warning("The stall check could not reach the database (%s); trying again later",
                        str(error.__cause__ or error).splitlines()[0])  # fmt: skip
        except Exception:
            log.exception("The stall check failed; trying again later")


async def requeue_stalled(app: procrastinate.App, sessions: sessionmaker[Session], stalled_after: float) -> int:
    stalled = await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=stalled_after)
    handled = 0
    for job in stalled:
        try:
            handled += await _requeue_one(app, sessions, job)
        except ConnectorException as error:  # it finished (or was retried) meanwhile, or the database went away
            log.info("Stalled job %s was not requeued: %s", job.id, str(error.__cause__ or error).splitlines()[0])
    return handled


async def _requeue_one(app: procrastinate.App, sessions: sessionmaker[Session], job: procrastinate.jobs.Job) -> int:
    assert job.id is not None
    with sessions() as session, session.begin():
        ours = repository.by_procrastinate_id(session, job.id)
        if ours is not None and ours.id in RUNNING:
            return 0  # computing here, in this live process: only its heartbeat lapsed (a database outage)
        if ours is not None and ours.status in ("succeeded", "failed"):
            finished = Status.SUCCEEDED if ours.status == "succeeded" else Status.FAILED
            await app.job_manager.finish_job(job, status=finished, delete_job=False)
            return 0
        give_up = ours is not None and ours.attempts >= MAX_ATTEMPTS
        if ours is not None:
            if give_up:
                repository.fail(session, ours.id, f"its worker died in each of {ours.attempts} attempts")
            else:
                repository.requeue(session, ours.id, f"worker {ours.runner} stopped responding; requeued")
    if give_up:
        await app.job_manager.finish_job(job, status=Status.FAILED, delete_job=False)
    else:
        await app.job_manager.retry_job(job)
    log.warning("Job %s was stalled (worker gone): %s", job.id, "failed" if give_up else "requeued")
    return 1


async def run_worker(
    url: str,
    sessions: sessionmaker[Session],
    *,
    queues: Sequence[str],
    concurrency: int,
    stalled_after: float = 30.0,
) -> str:
    """Take jobs until SIGINT/SIGTERM, and return that signal's name; reconnect with backoff whenever the
    database goes away. The handlers the process had before are put back."""
    stop = asyncio.Event()
    stopped_by: list[str] = []

    def on_signal(signum: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: the worker stops (a job it runs is released for another worker)", signum.name)
        stopped_by.append(signum.name)
        stop.set()

    loop = asyncio.get_running_loop()
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in before:
        loop.add_signal_handler(signum, on_signal, signum)
    delay = 1.0
    try:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await _work_until_stopped_or_disconnected(
                    url, sessions, stop, queues=queues, concurrency=concurrency, stalled_after=stalled_after
                )
                if stop.is_set():
                    break
                log.warning("The worker lost the catalog database; reconnecting")
            except CONNECTION_ERRORS as error:
                log.warning("The catalog database is unavailable (%s); reconnecting in %.0f s",
                            str(error).splitlines()[0] if str(error) else type(error).__name__, delay)  # fmt: skip
            if time.monotonic() - started > 60:
                delay = 1.0  # it ran a while: start the backoff afresh
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)
    finally:
        for signum, handler in before.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, handler)
    return stopped_by[0]


async def _work_until_stopped_or_disconnected(
    url: str,
    sessions: sessionmaker[Session],
    stop: asyncio.Event,
    *,
    queues: Sequence[str],
    concurrency: int,
    stalled_after: float,
) -> None:
    releasing = threading.Event()  # seen by the job threads: a running job is released at its next step
    app = create_queue_app(url, sessions, releasing)
    async with app.open_async():
        reaper = asyncio.create_task(reap_stalled(app, sessions, stalled_after))
        worker = asyncio.create_task(
            app.run_worker_async(
                queues=list(queues),
                concurrency=concurrency,
                # Often enough for the stall check, and for GET /health to see this worker alive.
                update_heartbeat_interval=min(repository.WORKER_ALIVE_SECONDS / 3, max(0.5, stalled_after / 3)),
                stalled_worker_timeout=stalled_after,
                install_signal_handlers=False,
            )
        )
        stopping = asyncio.create_task(stop.wait())
        try:
            log.info("Worker listening on queue(s) %s, concurrency %d", ", ".join(queues), concurrency)
            await asyncio.wait({worker, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not worker.done():
                releasing.set()
                worker.cancel()  # procrastinate waits for the running job: it is released at its next step
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
                return
            worker.result()  # raises what stopped it
        finally:
            stopping.cancel()
            reaper.cancel()
