"""Run one job: claim it, compute outside any transaction, then write its outcome and its
``succeeded`` status in one transaction. A job killed halfway leaves only a ``running`` row
(retried by the worker's stall check) and nothing that looks finished.

A worker asked to stop (SIGTERM, SIGINT) releases the job it runs at the job's next progress step: the row goes
back to ``queued`` and the queue runs it again on the next worker (:class:`Released`). A job run in the CLI's own
process (no worker) and stopped there is marked failed, saying so: nothing of it is stored.

The database may go away while a job computes: progress is then not recorded (the job goes
on), the final write is retried until the server is back (up to ``WRITE_PATIENCE`` seconds),
and a job that still cannot write is left ``running`` for the stall check to retry, never
marked failed for the database's fault. Only the attempt that claimed the job last may write
its outcome, so a requeued job is never stored twice.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict, HeadcatError, stopped_by
from service.jobs import repository
from service.orm import Job

log = logging.getLogger(__name__)

WRITE_PATIENCE = 300.0  # seconds a finished job waits for the database to come back to store its outcome
RUNNING: set[int] = set()  # jobs computing in this process (the stall check leaves them alone)

Writer = Callable[[Session], dict[str, Any]]


class Progress(Protocol):
    def __call__(self, done: int, total: int) -> None: ...


class Handler(Protocol):
    def __call__(self, sessions: sessionmaker[Session], request: dict[str, Any], progress: Progress) -> Writer: ...


# kind -> "module:function" returning the writer; imported lazily (model-running jobs need torch).
HANDLERS: dict[str, str] = {
    "ingest": "service.ingests.service:prepare",
    "clustering": "service.clusterings.service:prepare",
    "stability": "service.clusterings.stability:prepare",
    "ablation": "service.ablations.service:prepare",
    "attribution": "service.attributions.service:prepare",
    "syntax": "service.syntax.service:prepare",
    "importance": "service.importance.service:prepare_importance",
    "pruning": "service.importance.service:prepare_curves",
    "detection": "service.detections.service:prepare",
    "catalog_import": "service.catalogs.service:prepare",
}
QUEUES = {
    "ingest": "gpu",
    "ablation": "gpu",
    "attribution": "gpu",
    "syntax": "gpu",
    "importance": "gpu",
    "pruning": "gpu",
    "detection": "gpu",
    "clustering": "cpu",
    "stability": "cpu",
    "catalog_import": "cpu",
}


class Released(Exception):
    """The job's worker is stopping: the job was put back on the queue, to run again on another worker."""


def handler(kind: str) -> Handler:
    module, function = HANDLERS[kind].split(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def quiet_model_loading() -> None:
    """No progress bars from transformers or the hub (``Loading weights``, downloads) in jobs: a
    job reports its own progress. ``HF_HUB_DISABLE_PROGRESS_BARS=0`` keeps them."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].strip().lower() not in ("1", "true", "yes", "on"):
        return
    if "huggingface_hub" in sys.modules:  # already imported: its switch was read then; flip it now
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def database_gone(error: BaseException) -> bool:
    """The server is down, restarting or unreachable (as opposed to a bad statement)."""
    return isinstance(error, OperationalError | InterfaceError) or (
        isinstance(error, DBAPIError) and error.connection_invalidated
    )


def runner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ProgressReporter:
    """Writes progress to the job row, at most every ``interval`` seconds (and at the end)."""

    def __init__(self, sessions: sessionmaker[Session], job_id: int, interval: float = 0.5) -> None:
        self.sessions, self.job_id, self.interval = sessions, job_id, interval
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        try:
            with self.sessions() as session, session.begin():
                repository.progress(session, self.job_id, done, total)
        except DBAPIError as error:
            if not database_gone(error):
                raise
            log.warning("Job %d: progress %d/%d not recorded, the database is unavailable", self.job_id, done, total)


def execute(
    sessions: sessionmaker[Session],
    job_id: int,
    *,
    runner: str | None = None,
    progress: Progress | None = None,
    raise_errors: bool = False,
    stopping: threading.Event | None = None,
) -> str | None:
    """Run job ``job_id``; returns its final status (None when it had already finished).

    Once ``stopping`` is set (its worker is stopping), the job's next progress step releases it: the row is
    ``queued`` again and :class:`Released` is raised for the queue to run it again.
    """
    with sessions() as session, session.begin():
        job = repository.claim(session, job_id, runner or runner_name())
        if job is None:
            log.info("Job %d already finished; nothing to do", job_id)
            return None
        kind, request, attempt = job.kind, dict(job.request), job.attempts
    log.info("Job %d (%s) started, attempt %d", job_id, kind, attempt)
    reporter = ProgressReporter(sessions, job_id)
    if progress is None:  # a worker: its log shows the job's progress at a steady pace
        from service.jobs.progress import SteadyLog
        from service.settings import get_settings

        progress = SteadyLog(f"Job {job_id} ({kind}):", get_settings().progress_interval, logger=log)
    quiet_model_loading()

    def report(done: int, total: int) -> None:
        if stopping is not None and stopping.is_set():
            raise Released(f"job {job_id}")
        reporter(done, total)
        if progress is not None:
            progress(done, total)

    RUNNING.add(job_id)
    try:
        writer = handler(kind)(sessions, request, report)
        result = _store(sessions, job_id, attempt, writer)
    except Released:
        with sessions() as session, session.begin():
            repository.requeue(session, job_id, "its worker was stopped before it finished; queued for another")
        log.info("Job %d released: its worker is stopping; it runs again on the next worker", job_id)
        raise
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM in the CLI's own process (service.errors.Stopped)
        message = f"stopped by {stopped_by(interrupt)} before it finished; nothing of it was stored"
        with sessions() as session, session.begin():
            repository.interrupt(session, job_id, message)
        log.warning("Job %d %s", job_id, message)
        raise
    except HeadcatError as error:
        # Raised to a caller (the CLI), which says it: logged here too, the error would print twice.
        _fail(sessions, job_id, error.message, level=logging.DEBUG if raise_errors else logging.WARNING)
        if raise_errors:
            raise
        return "failed"
    except Exception as error:
        if database_gone(error):
            log.warning("Job %d: the database is unavailable; left running for the stall check to retry", job_id)
            raise
        log.exception("Job %d failed", job_id)
        _fail(sessions, job_id, f"{type(error).__name__}: {error}")
        raise
    finally:
        RUNNING.discard(job_id)
    if result is None:
        log.warning("Job %d attempt %d was superseded by a later attempt; its outcome is dropped", job_id, attempt)
        return None
    log.info("Job %d (%s) succeeded: %s", job_id, kind, result)
    return "succeeded"


def _store(sessions: sessionmaker[Session], job_id: int, attempt: int, writer: Writer) -> dict[str, Any] | None:
    """Write the outcome and ``succeeded`` in one transaction, waiting out a database outage.

    None when a later attempt owns the job now (it was requeued while this one computed).
    """
    deadline, delay = time.monotonic() + WRITE_PATIENCE, 0.5
    while True:
        try:
            with sessions() as session, session.begin():
                if not repository.owns(session, job_id, attempt):
                    return None
                result = writer(session)
                repository.succeed(session, job_id, result)
                return result
        except DBAPIError as error:
            if not database_gone(error) or time.monotonic() > deadline:
                raise
            log.warning("Job %d: the database is unavailable; storing its outcome again in %.1f s", job_id, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _fail(sessions: sessionmaker[Session], job_id: int, message: str, level: int = logging.WARNING) -> None:
    with sessions() as session, session.begin():
        repository.fail(session, job_id, message)
    log.log(level, "Job %d failed: %s", job_id, message)


def run_inline(
    sessions: sessionmaker[Session], kind: str, request: dict[str, Any], *, progress: Progress | None = None
) -> Job:
    """Submit and run a job in this process (the CLI without a worker). Raises on failure."""
    with sessions() as session, session.begin():
        job, created = repository.submit(session, kind, QUEUES[kind], request, enqueue=False)
        job_id = job.id
    if not created:
        raise Conflict(f"an identical {kind} job ({job_id}) is already {job.status}; see `GET /jobs/{job_id}`")
    execute(sessions, job_id, runner=f"in-process {runner_name()}", progress=progress, raise_errors=True)
    with sessions() as session:
        finished = session.get(Job, job_id)
        assert finished is not None
        return finished
