"""Typed FastAPI dependencies, in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

READS = frozenset({"GET", "HEAD"})


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session owns the transaction: commit on success, roll back on error.

    A read (GET, HEAD) gets a session on an autocommit connection instead: under PostgreSQL's
    READ COMMITTED every statement takes its own snapshot inside a transaction too, so a read loses
    nothing, and it is spared the BEGIN and COMMIT round trips. A session does no I/O until its
    first statement, and a read's ends with none (an idle autocommit connection has nothing to
    roll back when it goes back to the pool), so both are made and closed here, on the event loop;
    only a write's commit or rollback goes to a thread. Its endpoint's thread is the only hop a
    read makes.
    """
    state = request.app.state
    if request.method in READS:
        with state.read_session_factory() as session:
            yield session
        return
    session = state.session_factory()
    try:
        yield session
    except BaseException:
        await run_in_threadpool(session.close)  # rolls back whatever the request began
        raise
    await run_in_threadpool(_commit_and_close, session)


def _commit_and_close(session: Session) -> None:
    try:
        session.commit()
    finally:
        session.close()


# scope="function": the session ends (a write commits) after the endpoint and its response's serialization, before
# the response is sent. FastAPI's default scope ends it after the response is sent: a client told 201 or 202 could
# read before the commit (a job polled at once answered 404), and a commit that failed had already answered success.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
