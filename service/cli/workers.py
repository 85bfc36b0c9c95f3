"""``headcat worker`` and ``headcat jobs``: the job queue's workers, and the jobs they run."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from service import db
from service.cli.app import app, catalog, log, make_console
from service.errors import InvalidInput


@app.command()
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated queues: gpu runs models, cpu runs analysis")] = "gpu,cpu",
    concurrency: Annotated[int, typer.Option(help="jobs run at once by this worker")] = 1,
    stalled_after: Annotated[
        float, typer.Option(help="seconds without a heartbeat after which a worker's jobs are requeued")
    ] = 30.0,
) -> None:
    """Run a worker: take jobs from the catalog's queue until stopped (Ctrl-C, SIGTERM)."""
    import asyncio

    from service.jobs.queue import run_worker

    with catalog() as engine:
        names = [q.strip() for q in queues.split(",") if q.strip()]
        unknown = set(names) - {"gpu", "cpu"}
        if unknown or not names:
            raise InvalidInput(f"queues: unknown queue(s) {sorted(unknown)}; known: gpu, cpu")
        stopped_by = asyncio.run(run_worker(engine.url.render_as_string(hide_password=False),
                                            db.session_factory(engine), queues=names, concurrency=concurrency,
                                            stalled_after=stalled_after))  # fmt: skip
        log.info("The worker has stopped (%s)", stopped_by)


@app.command()
def jobs(job_id: Annotated[int | None, typer.Argument(help="one job's id; default: the latest jobs")] = None) -> None:
    """Show jobs: state, progress, timings, results and errors."""
    from sqlalchemy import select

    from service.jobs.schemas import JobRead
    from service.orm import Job

    with catalog() as engine, db.session_scope(engine) as session:
        stmt = select(Job).order_by(Job.id.desc()).limit(20)
        if job_id is not None:
            stmt = select(Job).where(Job.id == job_id)
        table = Table("id", "kind", "status", "progress", "attempts", "seconds", "result / error")
        for job in session.scalars(stmt):
            read = JobRead.model_validate(job)
            done = f"{job.progress_done}/{job.progress_total}" if job.progress_total else "-"
            table.add_row(str(job.id), job.kind, job.status, done, str(job.attempts),
                          f"{read.seconds:.1f}" if read.seconds is not None else "-",
                          job.error or str(job.result or ""))  # fmt: skip
        make_console().print(table)
