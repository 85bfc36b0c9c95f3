"""Run one job: claim it, compute outside any transaction, then write its outcome and its
``succeeded`` status in one transaction. A job killed halfway leaves only a ``running`` row
(retried by the worker's stall check) and nothing that looks finished.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict, HeadcatError
from service.jobs import repository
from service.orm import Job

log = logging.getLogger(__name__)

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
}
QUEUES = {"ingest": "gpu", "ablation": "gpu", "clustering": "cpu", "stability": "cpu"}


def handler(kind: str) -> Handler:
    module, function = HANDLERS[kind].split(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


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
        with self.sessions() as session, session.begin():
            repository.progress(session, self.job_id, done, total)


def execute(
    sessions: sessionmaker[Session],
    job_id: int,
    *,
    runner: str | None = None,
    progress: Progress | None = None,
    raise_errors: bool = False,
) -> str | None:
    """Run job ``job_id``; returns its final status (None when it had already finished)."""
    with sessions() as session, session.begin():
        job = repository.claim(session, job_id, runner or runner_name())
        if job is None:
            log.info("Job %d already finished; nothing to do", job_id)
            return None
        kind, request, attempt = job.kind, dict(job.request), job.attempts
    log.info("Job %d (%s) started, attempt %d", job_id, kind, attempt)
    reporter = ProgressReporter(sessions, job_id)

    def report(done: int, total: int) -> None:
        reporter(done, total)
        if progress is not None:
            progress(done, total)

    try:
        writer = handler(kind)(sessions, request, report)
        with sessions() as session, session.begin():
            result = writer(session)
            repository.succeed(session, job_id, result)
    except HeadcatError as error:
        _fail(sessions, job_id, error.message)
        if raise_errors:
            raise
        return "failed"
    except Exception as error:
        log.exception("Job %d failed", job_id)
        _fail(sessions, job_id, f"{type(error).__name__}: {error}")
        raise
    log.info("Job %d (%s) succeeded: %s", job_id, kind, result)
    return "succeeded"


def _fail(sessions: sessionmaker[Session], job_id: int, message: str) -> None:
    with sessions() as session, session.begin():
        repository.fail(session, job_id, message)
    log.warning("Job %d failed: %s", job_id, message)


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
