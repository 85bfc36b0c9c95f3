"""SQL for jobs: submission with de-duplication and transactional enqueueing, state changes."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from service.orm import Job

TASK_NAME = "headcat.run_job"
ACTIVE = ("queued", "running")
# A worker is alive while its heartbeat is this recent; workers beat at most a third of it apart (service.jobs.queue).
WORKER_ALIVE_SECONDS = 30.0


def dedupe_key(kind: str, request: dict[str, Any]) -> str:
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return f"{kind}:{hashlib.sha256(canonical.encode()).hexdigest()}"


def submit(session: Session, kind: str, queue: str, request: dict[str, Any], *, enqueue: bool) -> tuple[Job, bool]:
    """The job for ``request``: a new one, or the identical one already queued or running.

    With ``enqueue`` the procrastinate job is deferred in the same transaction as our row, so a
    committed job is always on the queue and a rolled-back one never is. Returns (job, created).
    """
    key = dedupe_key(kind, request)
    job_id = session.scalar(
        pg_insert(Job)
        .values(kind=kind, queue=queue, status="queued", request=request, dedupe_key=key)
        .on_conflict_do_nothing(index_elements=[Job.dedupe_key], index_where=Job.status.in_(ACTIVE))
        .returning(Job.id)
    )
    if job_id is None:
        existing = session.scalar(select(Job).where(Job.dedupe_key == key, Job.status.in_(ACTIVE)))
        if existing is not None:
            return existing, False
        # The identical job finished between our insert and select: submit afresh.
        return submit(session, kind, queue, request, enqueue=enqueue)
    if enqueue:
        procrastinate_id = session.scalar(
            text(
                "SELECT (procrastinate_defer_jobs_v1(ARRAY[ROW(:queue, :task, 0, NULL, NULL, "
                "CAST(:args AS jsonb), NULL)::procrastinate_job_to_defer_v1]))[1]"
            ),
            {"queue": queue, "task": TASK_NAME, "args": json.dumps({"job_id": job_id})},
        )
        session.execute(update(Job).where(Job.id == job_id).values(procrastinate_job_id=procrastinate_id))
    job = session.get(Job, job_id)
    assert job is not None
    return job, True


def claim(session: Session, job_id: int, runner: str) -> Job | None:
    """Mark the job running (again, after a retry); None when it already finished."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.status in ("succeeded", "failed"):
        return None
    job.status = "running"
    job.attempts += 1
    job.runner = runner
    job.started_at = datetime.now(UTC)
    job.error = None
    session.flush()
    return job


def owns(session: Session, job_id: int, attempt: int) -> bool:
    """Lock the job's row; True while ``attempt`` is its latest claim and it has not finished."""
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    return job is not None and job.attempts == attempt and job.status in ACTIVE


def progress(session: Session, job_id: int, done: int, total: int) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(progress_done=done, progress_total=total))


def succeed(session: Session, job_id: int, result: dict[str, Any]) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(status="succeeded", result=result, error=None, finished_at=datetime.now(UTC))
    )


def fail(session: Session, job_id: int, error: str) -> None:
    session.execute(
        update(Job).where(Job.id == job_id).values(status="failed", error=error, finished_at=datetime.now(UTC))
    )


def interrupt(session: Session, job_id: int, error: str) -> None:
    """Failed with ``error``, unless it finished meanwhile (a stop that came just after the outcome's commit)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE))
        .values(status="failed", error=error, finished_at=datetime.now(UTC))
    )


def requeue(session: Session, job_id: int, reason: str) -> None:
    """Back to ``queued`` (only a job still marked running: a finished one stays finished)."""
    session.execute(update(Job).where(Job.id == job_id, Job.status == "running").values(status="queued", error=reason))


def by_procrastinate_id(session: Session, procrastinate_job_id: int) -> Job | None:
    return session.scalar(select(Job).where(Job.procrastinate_job_id == procrastinate_job_id))


def live_workers(session: Session, within: float = WORKER_ALIVE_SECONDS) -> int:
    """How many workers sent a heartbeat in the last ``within`` seconds (procrastinate's worker table)."""
    query = text("SELECT count(*) FROM procrastinate_workers WHERE last_heartbeat > now() - make_interval(secs => :s)")
    return int(session.execute(query, {"s": within}).scalar_one())
