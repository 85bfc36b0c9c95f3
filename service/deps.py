"""Typed FastAPI dependencies, in one place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session


def get_session(request: Request) -> Iterator[Session]:
    """The request's session owns the transaction: commit on success, roll back on error."""
    factory = request.app.state.session_factory
    with factory() as session, session.begin():
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
