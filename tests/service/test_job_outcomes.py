"""How jobs end: a job whose worker keeps dying fails for good after ``MAX_ATTEMPTS``; a clustering or
stability job that fails while writing leaves nothing behind (its outcome and its ``succeeded``
status are one transaction, and the model's current clustering does not move)."""

from __future__ import annotations

import asyncio
from typing import Any

import procrastinate
import pytest
from procrastinate.testing import InMemoryConnector
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import queue, repository
from service.jobs.repository import TASK_NAME
from service.jobs.runner import run_inline
from service.orm import CatalogModel, Cluster, Clustering, HeadAssignment, Job, StabilityHead, StabilityRun
from tests.service.conftest import TINY

# --- a worker that keeps dying ---------------------------------------------------------------------------


def stalled_job(sessions: sessionmaker[Session], attempts: int) -> tuple[procrastinate.App, Any, int]:
    """A procrastinate job taken by a worker (in memory) and our job row, claimed ``attempts`` times."""
    app = procrastinate.App(connector=InMemoryConnector())

    async def defer_and_fetch() -> Any:
        await app.configure_task(name=TASK_NAME, queue="cpu", allow_unknown=True).defer_async(job_id=0)
        worker = await app.job_manager.register_worker()
        return await app.job_manager.fetch_job(queues=None, worker_id=worker)

    with app.open():
        job = asyncio.run(defer_and_fetch())
    with sessions() as session, session.begin():
        ours, _ = repository.submit(session, "clustering", "cpu", {"models": [TINY], "attempts": attempts},
                                    enqueue=False)  # fmt: skip
        for _ in range(attempts):
            repository.claim(session, ours.id, "a-dead-worker:1")
        ours.procrastinate_job_id = job.id
        return app, job, ours.id


def requeue(app: procrastinate.App, sessions: sessionmaker[Session], job: Any) -> int:
    with app.open():
        return asyncio.run(queue._requeue_one(app, sessions, job))


def procrastinate_status(app: procrastinate.App, job: Any) -> str:
    return str(app.connector.jobs[job.id]["status"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("attempts", range(1, queue.MAX_ATTEMPTS))
def test_a_stalled_job_below_the_attempt_limit_is_requeued(sessions: sessionmaker[Session], attempts: int) -> None:
    app, job, job_id = stalled_job(sessions, attempts)
    assert requeue(app, sessions, job) == 1
    with sessions() as session:
        ours = session.get_one(Job, job_id)
        assert (ours.status, ours.attempts, ours.finished_at) == ("queued", attempts, None)
        assert "stopped responding" in (ours.error or "")
    assert procrastinate_status(app, job) == "todo"


def test_a_job_whose_worker_died_in_each_of_3_attempts_fails_for_good(sessions: sessionmaker[Session]) -> None:
    """Caught: a limit off by one (giving up after 2 or 4 attempts) or a failure that is not final."""
    assert queue.MAX_ATTEMPTS == 3
    app, job, job_id = stalled_job(sessions, 3)
    assert requeue(app, sessions, job) == 1
    with sessions() as session:
        ours = session.get_one(Job, job_id)
        assert (ours.status, ours.attempts) == ("failed", 3)
        assert ours.error == "its worker died in each of 3 attempts"
        assert ours.finished_at is not None
    assert procrastinate_status(app, job) == "failed"
    with sessions() as session, session.begin():  # a failed job is never claimed again
        assert repository.claim(session, job_id, "another-worker:2") is None


# --- a job that fails while writing ----------------------------------------------------------------------


def counts(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as session:
        tables = {"clusterings": Clustering, "clusters": Cluster, "assignments": HeadAssignment,
                  "stability_runs": StabilityRun, "stability_heads": StabilityHead}  # fmt: skip
        found = {name: session.scalar(select(func.count()).select_from(table)) or 0 for name, table in tables.items()}
        found["clustering_runs"] = session.scalar(text("SELECT count(*) FROM clustering_feature_runs")) or 0
        return found


def current_clustering(sessions: sessionmaker[Session]) -> int | None:
    with sessions() as session:
        return session.scalars(select(CatalogModel.current_clustering_id).where(CatalogModel.name == TINY)).one()


def last_job(sessions: sessionmaker[Session]) -> Job:
    with sessions() as session:
        return session.scalars(select(Job).order_by(Job.id.desc()).limit(1)).one()


def test_a_clustering_that_fails_while_writing_leaves_nothing_and_keeps_the_current_one(
    sessions: sessionmaker[Session], tiny_clustered: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: a writer that commits (or flushes outside the job's transaction) part of its rows."""
    import service.clusterings.service as clusterings

    before = counts(sessions)
    assert before["clusterings"] == 1
    assert current_clustering(sessions) == tiny_clustered

    def fail(value: float) -> float | None:  # called for the assignment rows, after the clusters are flushed
        raise RuntimeError("the disk filled up")

    monkeypatch.setattr(clusterings, "_finite_or_none", fail)
    with pytest.raises(RuntimeError, match="disk filled up"):
        run_inline(sessions, "clustering", {"models": [TINY], "k": 3, "seed": 1})
    assert counts(sessions) == before
    assert current_clustering(sessions) == tiny_clustered
    job = last_job(sessions)
    assert (job.kind, job.status, job.result) == ("clustering", "failed", None)
    assert "disk filled up" in (job.error or "")


def test_a_stability_run_that_fails_while_writing_leaves_nothing(
    sessions: sessionmaker[Session], tiny_clustered: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.clusterings.stability as stability

    before = counts(sessions)

    def fail(*args: Any, **kwargs: Any) -> Any:  # the per-head rows, after the run's row is flushed
        raise RuntimeError("the connection broke mid-insert")

    monkeypatch.setattr(stability, "insert", fail)
    with pytest.raises(RuntimeError, match="mid-insert"):
        run_inline(sessions, "stability", {"clustering_id": tiny_clustered, "n_runs": 2, "fraction": 0.5, "seed": 0})
    assert counts(sessions) == before
    job = last_job(sessions)
    assert (job.kind, job.status, job.result) == ("stability", "failed", None)

    monkeypatch.undo()  # and the same job, written normally, stores the run and a flag per head
    run_inline(sessions, "stability", {"clustering_id": tiny_clustered, "n_runs": 2, "fraction": 0.5, "seed": 5})
    after = counts(sessions)
    assert after["stability_runs"] == before["stability_runs"] + 1
    assert after["stability_heads"] == before["stability_heads"] + 8
