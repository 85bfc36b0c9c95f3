"""``/jobs``: the state of ingest and analysis work."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy import select

from service.deps import SessionDep
from service.errors import NotFound
from service.jobs import repository
from service.jobs.runner import QUEUES
from service.jobs.schemas import NO_WORKER, JobAccepted, JobRead
from service.orm import Job

router = APIRouter(prefix="/jobs", tags=["jobs"])


def accept(session: SessionDep, request: Request, kind: str, payload: dict[str, Any]) -> JobAccepted:
    """Queue a job for the workers (or hand back the identical one already queued or running)."""
    job, created = repository.submit(session, kind, QUEUES[kind], payload, enqueue=True)
    workers = repository.live_workers(session)
    return JobAccepted(
        job_id=job.id, status=job.status, duplicate=not created, url=str(request.url_for("get_job", job_id=job.id)),
        workers=workers, warning=None if workers else NO_WORKER,
    )  # fmt: skip


@router.get("/{job_id}", response_model=JobRead)
def get_job(session: SessionDep, job_id: Annotated[int, Path(ge=1, le=2**31 - 1)]) -> JobRead:
    """State, progress (ingest: samples done of total), timings, result ids, or the error."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job_id: no job with id {job_id}", field="job_id")
    return JobRead.model_validate(job)


@router.get("", response_model=list[JobRead])
def list_jobs(
    session: SessionDep,
    status: Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed)$")] = None,
    kind: Annotated[
        str | None,
        Query(
            pattern="^(ingest|clustering|stability|ablation|attribution|syntax|importance|pruning|detection"
            "|catalog_import)$"
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> list[JobRead]:
    """Jobs, newest first."""
    stmt = select(Job).order_by(Job.id.desc()).limit(limit).offset(offset)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if kind is not None:
        stmt = stmt.where(Job.kind == kind)
    return [JobRead.model_validate(job) for job in session.scalars(stmt)]
