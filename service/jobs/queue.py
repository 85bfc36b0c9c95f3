"""The job queue: procrastinate on the catalog's own PostgreSQL.

Jobs are deferred by :func:`service.jobs.repository.submit`, in the same transaction as the
job's row. Workers run :func:`service.jobs.runner.execute` for each. A worker killed while
running a job stops sending heartbeats; any live worker's stall check then puts the job back
on the queue (or fails it for good after ``MAX_ATTEMPTS``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import procrastinate
from procrastinate.jobs import Status
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import repository
from service.jobs.repository import TASK_NAME
from service.jobs.runner import execute

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


def conninfo(url: str) -> str:
    """A libpq connection string (psycopg) from a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def create_queue_app(url: str, sessions: sessionmaker[Session]) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo(url)))

    @app.task(name=TASK_NAME, queue="cpu")
    def run_job(job_id: int) -> None:
        execute(sessions, job_id)

    return app


async def reap_stalled(app: procrastinate.App, sessions: sessionmaker[Session], stalled_after: float) -> None:
    """Forever: requeue jobs whose worker stopped sending heartbeats (killed, lost its machine)."""
    while True:
        await asyncio.sleep(max(1.0, stalled_after / 3))
        try:
            await requeue_stalled(app, sessions, stalled_after)
        except Exception:
            log.exception("The stall check failed; trying again later")


async def requeue_stalled(app: procrastinate.App, sessions: sessionmaker[Session], stalled_after: float) -> int:
    stalled = await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=stalled_after)
    for job in stalled:
        assert job.id is not None
        with sessions() as session, session.begin():
            ours = repository.by_procrastinate_id(session, job.id)
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
    return len(stalled)


async def run_worker(
    url: str,
    sessions: sessionmaker[Session],
    *,
    queues: Sequence[str],
    concurrency: int,
    stalled_after: float = 30.0,
) -> None:
    app = create_queue_app(url, sessions)
    async with app.open_async():
        reaper = asyncio.create_task(reap_stalled(app, sessions, stalled_after))
        try:
            log.info("Worker listening on queue(s) %s, concurrency %d", ", ".join(queues), concurrency)
            await app.run_worker_async(
                queues=list(queues),
                concurrency=concurrency,
                update_heartbeat_interval=max(0.5, stalled_after / 3),
                stalled_worker_timeout=stalled_after,
                install_signal_handlers=True,
            )
        finally:
            reaper.cancel()
