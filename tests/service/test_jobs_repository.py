"""The job table's SQL, one statement at a time, on the migrated schema: every state change touches
the one job it names and only in the states the docstrings allow (mutants of ``service/jobs/repository.py``
that changed a WHERE clause or a value survived the end-to-end job tests)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, cast

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.jobs import repository
from service.orm import Job
from tests.waiting import PATIENCE, wait_until


def job(session: Session, request: dict[str, Any] | None = None, kind: str = "clustering") -> Job:
    created, fresh = repository.submit(session, kind, "cpu", request or {"models": ["m"]}, enqueue=False)
    assert fresh
    return created


def row(session: Session, job_id: int) -> Job:
    session.expire_all()
    return session.get_one(Job, job_id)


def test_dedupe_key_is_the_kind_and_the_sha256_of_the_canonical_request() -> None:
    canonical = b'{"a":[1,2],"b":{"c":"x","d":null}}'  # keys sorted, no spaces: written by hand
    expected = "ingest:" + hashlib.sha256(canonical).hexdigest()
    assert repository.dedupe_key("ingest", {"b": {"d": None, "c": "x"}, "a": [1, 2]}) == expected
    assert repository.dedupe_key("clustering", {"a": [1, 2], "b": {"c": "x", "d": None}}).startswith("clustering:")
    assert repository.dedupe_key("ingest", {"a": [2, 1], "b": {"c": "x", "d": None}}) != expected


def test_submit_writes_a_queued_job_and_an_identical_active_request_gets_it_back(session: Session) -> None:
    request = {"models": ["m"], "k": 4}
    first, created = repository.submit(session, "clustering", "cpu", request, enqueue=False)
    assert created
    stored = row(session, first.id)
    assert (stored.kind, stored.queue, stored.status, stored.request, stored.attempts) == (
        "clustering", "cpu", "queued", request, 0,
    )  # fmt: skip
    assert stored.dedupe_key == repository.dedupe_key("clustering", request)
    assert stored.procrastinate_job_id is None  # not enqueued

    again, created = repository.submit(session, "clustering", "cpu", dict(reversed(request.items())), enqueue=False)
    assert (again.id, created) == (first.id, False)
    other, created = repository.submit(session, "clustering", "cpu", {**request, "k": 5}, enqueue=False)
    assert created
    assert other.id != first.id

    repository.claim(session, first.id, "w:1")  # running is still active: the same job
    assert repository.submit(session, "clustering", "cpu", request, enqueue=False) == (row(session, first.id), False)
    repository.succeed(session, first.id, {"clustering_id": 1})  # finished: a new job
    fresh, created = repository.submit(session, "clustering", "cpu", request, enqueue=False)
    assert created
    assert fresh.id != first.id


def test_submit_with_enqueue_defers_one_procrastinate_job_naming_ours(session: Session) -> None:
    ours, _ = repository.submit(session, "ingest", "gpu", {"model": "x"}, enqueue=True)
    stored = row(session, ours.id)
    assert stored.procrastinate_job_id is not None
    deferred = session.execute(
        text("SELECT queue_name, task_name, args, status FROM procrastinate_jobs WHERE id = :id"),
        {"id": stored.procrastinate_job_id},
    ).one()
    assert tuple(deferred) == ("gpu", "headcat.run_job", {"job_id": ours.id}, "todo")


def test_claim_marks_the_job_running_for_this_attempt_and_never_revives_a_finished_one(session: Session) -> None:
    first, second = job(session, {"n": 1}), job(session, {"n": 2})
    repository.fail(session, first.id, "boom")
    assert repository.claim(session, first.id, "w:1") is None
    assert (row(session, first.id).status, row(session, first.id).attempts) == ("failed", 0)

    session.execute(text("UPDATE jobs SET error = 'stale' WHERE id = :id"), {"id": second.id})  # a requeue's reason
    session.expire_all()  # as a worker's fresh session sees the row
    for attempt in (1, 2):
        claimed = repository.claim(session, second.id, f"w:{attempt}")
        assert claimed is not None
        stored = row(session, second.id)
        assert (stored.status, stored.attempts, stored.runner, stored.error) == (
            "running",
            attempt,
            f"w:{attempt}",
            None,
        )
        assert stored.started_at is not None
    repository.succeed(session, second.id, {})
    assert repository.claim(session, second.id, "w:3") is None
    assert row(session, second.id).status == "succeeded"
    assert repository.claim(session, 10**9, "w:1") is None


def test_owns_only_the_latest_attempt_of_an_unfinished_job(session: Session) -> None:
    ours = job(session)
    assert repository.owns(session, ours.id, 0)  # queued, never claimed
    repository.claim(session, ours.id, "w:1")
    repository.claim(session, ours.id, "w:2")
    assert repository.owns(session, ours.id, 2)
    assert not repository.owns(session, ours.id, 1)
    assert not repository.owns(session, ours.id, 3)
    repository.fail(session, ours.id, "gone")
    assert not repository.owns(session, ours.id, 2)
    assert not repository.owns(session, 10**9, 0)


@pytest.mark.parametrize("finish", ["progress", "succeed", "fail", "requeue"])
def test_each_state_change_touches_only_the_job_it_names(session: Session, finish: str) -> None:
    ours, bystander = job(session, {"n": 1}), job(session, {"n": 2})
    for claimed in (ours, bystander):
        repository.claim(session, claimed.id, "w:1")
    before = {c: getattr(row(session, bystander.id), c) for c in ("status", "error", "result", "progress_done")}
    if finish == "progress":
        repository.progress(session, ours.id, 3, 7)
        assert (row(session, ours.id).progress_done, row(session, ours.id).progress_total) == (3, 7)
    elif finish == "succeed":
        repository.succeed(session, ours.id, {"feature_run_id": 5})
        stored = row(session, ours.id)
        assert (stored.status, stored.result, stored.error) == ("succeeded", {"feature_run_id": 5}, None)
        assert stored.finished_at is not None
    elif finish == "fail":
        repository.fail(session, ours.id, "out of memory")
        stored = row(session, ours.id)
        assert (stored.status, stored.error) == ("failed", "out of memory")
        assert stored.finished_at is not None
    else:
        repository.requeue(session, ours.id, "worker lost")
        stored = row(session, ours.id)
        assert (stored.status, stored.error, stored.finished_at) == ("queued", "worker lost", None)
    after = {c: getattr(row(session, bystander.id), c) for c in before}
    assert after == before == {"status": "running", "error": None, "result": None, "progress_done": None}


@pytest.mark.parametrize("status", ["succeeded", "failed", "queued"])
def test_requeue_leaves_a_job_that_is_not_running_as_it_is(session: Session, status: str) -> None:
    ours = job(session)
    repository.claim(session, ours.id, "w:1")
    if status == "succeeded":
        repository.succeed(session, ours.id, {"x": 1})
    elif status == "failed":
        repository.fail(session, ours.id, "boom")
    else:
        repository.requeue(session, ours.id, "first")
    before = row(session, ours.id)
    snapshot = (before.status, before.error, before.result)
    repository.requeue(session, ours.id, "worker lost")
    after = row(session, ours.id)
    assert (after.status, after.error, after.result) == snapshot


def test_by_procrastinate_id_finds_the_job_deferred_under_that_id(session: Session) -> None:
    first, _ = repository.submit(session, "ingest", "gpu", {"model": "a"}, enqueue=True)
    second, _ = repository.submit(session, "ingest", "gpu", {"model": "b"}, enqueue=True)
    ids = cast(
        dict[int, int],  # enqueued, so each job has its procrastinate id
        dict(session.execute(select(Job.id, Job.procrastinate_job_id).where(Job.id.in_([first.id, second.id]))).all()),
    )
    assert repository.by_procrastinate_id(session, ids[second.id]).id == second.id  # type: ignore[union-attr]
    assert repository.by_procrastinate_id(session, ids[first.id]).id == first.id  # type: ignore[union-attr]
    assert repository.by_procrastinate_id(session, max(ids.values()) + 1000) is None


def test_requests_are_stored_as_given(session: Session) -> None:
    request = {"models": ["a", "b"], "nested": {"k": [1, 2.5, None]}, "text": "ü"}
    ours = job(session, request)
    stored = session.execute(text("SELECT request::text FROM jobs WHERE id = :id"), {"id": ours.id}).scalar_one()
    assert json.loads(stored) == request


def test_a_succeeded_job_carries_no_error(session: Session) -> None:
    ours = job(session)
    repository.claim(session, ours.id, "w:1")
    session.execute(text("UPDATE jobs SET error = 'from an earlier attempt' WHERE id = :id"), {"id": ours.id})
    repository.succeed(session, ours.id, {})
    assert row(session, ours.id).error is None


def test_owns_sees_a_claim_made_by_another_session(sessions: Any) -> None:
    with sessions() as mine, sessions() as theirs:
        ours = job(mine)
        repository.claim(mine, ours.id, "w:1")
        mine.flush()
        assert repository.owns(mine, ours.id, 1)  # the job is now in this session's identity map
        repository.claim(theirs, ours.id, "w:2")  # a later attempt, by another worker
        theirs.flush()
        assert not repository.owns(mine, ours.id, 1)  # read from the row, not from the stale object


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo"])
def test_times_are_the_real_time_whatever_the_session_time_zone(session: Session, zone: str) -> None:
    session.execute(text(f"SET LOCAL TIME ZONE '{zone}'"))
    ours = job(session)
    repository.claim(session, ours.id, "w:1")
    repository.succeed(session, ours.id, {})
    other = job(session, {"n": "failing"})
    repository.fail(session, other.id, "boom")
    now = session.execute(text("SELECT now()")).scalar_one()  # the transaction's start, a moment before
    for stamp in (
        row(session, ours.id).started_at,
        row(session, ours.id).finished_at,
        row(session, other.id).finished_at,
    ):
        assert stamp is not None
        assert abs((stamp - now).total_seconds()) < 600  # a naive local time would be hours off


@pytest.fixture(scope="module")
def committed(committed_database_url: str) -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    engine = create_engine(committed_database_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


@pytest.mark.parametrize("holder", ["claim", "owns"])
@pytest.mark.parametrize("waiter", ["claim", "owns"])
def test_claim_and_owns_lock_the_row_against_each_other(committed: Any, holder: str, waiter: str) -> None:
    """Between a worker's claim and its outcome, no other attempt may claim or pass ``owns``: both lock the row."""
    from sqlalchemy.exc import OperationalError

    with committed() as setup, setup.begin():
        job_id = job(setup, {"lock": [holder, waiter]}).id
    calls = {"claim": lambda s: repository.claim(s, job_id, "w"), "owns": lambda s: repository.owns(s, job_id, 0)}
    with committed() as first, first.begin():
        calls[holder](first)  # holds the row lock until this transaction ends
        with committed() as second, second.begin():
            second.execute(text("SET LOCAL lock_timeout = '200ms'"))
            with pytest.raises(OperationalError, match="lock timeout"):
                calls[waiter](second)


def test_two_workers_claiming_at_once_count_two_attempts(committed: Any) -> None:
    """The second claim waits for the first and then reads its attempt (no lost update of ``attempts``)."""
    import threading

    with committed() as setup, setup.begin():
        job_id = job(setup, {"race": True}).id
    outcome: dict[str, Any] = {}

    def second_worker() -> None:
        try:
            with committed() as second, second.begin():
                claimed = repository.claim(second, job_id, "w:2")
                outcome["attempts"] = claimed.attempts if claimed else None
        except Exception as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    with committed() as first, first.begin():
        repository.claim(first, job_id, "w:1")
        first.flush()
        thread = threading.Thread(target=second_worker)
        thread.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )

        def blocked() -> bool:
            """Whether the second claim waits on our row lock. pg_stat_activity is read once per transaction
            and then kept: clear that snapshot, or a first look before the second claim got there holds."""
            first.execute(text("SELECT pg_stat_clear_snapshot()"))
            return bool(first.execute(text(waiting)).scalar_one() > 0)

        wait_until(blocked, "the second claim waiting for the first", poll=0.01)
    thread.join(PATIENCE)
    assert "error" not in outcome, outcome
    assert outcome["attempts"] == 2
    with committed() as check:
        assert (check.get_one(Job, job_id).attempts, check.get_one(Job, job_id).runner) == (2, "w:2")


def test_values_json_has_no_type_for_are_keyed_by_their_text() -> None:
    """A path or a date in a request is keyed as its ``str`` (the REST and CLI requests are JSON already)."""
    from datetime import date
    from pathlib import PurePosixPath

    canonical = b'{"model":"/models/tiny","since":"2026-11-24"}'
    expected = "ingest:" + hashlib.sha256(canonical).hexdigest()
    assert repository.dedupe_key("ingest", {"since": date(2026, 11, 24), "model": PurePosixPath("/models/tiny")}) == (
        expected
    )


def test_an_identical_job_finishing_between_our_insert_and_our_select_gets_a_new_job(committed: Any) -> None:
    """The race ``submit`` handles: our insert meets the identical active job, which finishes (in another
    transaction) before we look it up; the request is then submitted afresh, as a new queued and deferred job."""
    from sqlalchemy import event

    request = {"race": "finished meanwhile"}
    with committed() as setup, setup.begin():
        first = job(setup, request)
    engine = committed.kw["bind"]
    staged: list[int] = []

    def finish_the_other(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO jobs") and cursor.rowcount == 0 and not staged:
            staged.append(1)  # our insert did nothing: the other worker's job succeeds and commits now
            with engine.begin() as other:
                other.execute(text("UPDATE jobs SET status = 'succeeded' WHERE id = :id"), {"id": first.id})

    event.listen(engine, "after_cursor_execute", finish_the_other)
    try:
        with committed() as session, session.begin():
            again, created = repository.submit(session, "clustering", "cpu", request, enqueue=True)
            again_id = again.id
    finally:
        event.remove(engine, "after_cursor_execute", finish_the_other)
    assert staged == [1]
    assert created
    assert again_id != first.id
    with committed() as check:
        stored = check.get_one(Job, again_id)
        assert (stored.kind, stored.queue, stored.status, stored.request, stored.dedupe_key) == (
            "clustering", "cpu", "queued", request, first.dedupe_key,
        )  # fmt: skip
        assert check.get_one(Job, first.id).status == "succeeded"
        deferred = check.execute(
            text("SELECT queue_name, task_name, args FROM procrastinate_jobs WHERE id = :id"),
            {"id": stored.procrastinate_job_id},
        ).one()
        assert tuple(deferred) == ("cpu", "headcat.run_job", {"job_id": again_id})
