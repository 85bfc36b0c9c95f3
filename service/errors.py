"""Domain errors carry their HTTP status; one handler renders them. Expected failures are 4xx."""

from __future__ import annotations

from collections.abc import Iterable


class HeadcatError(Exception):
    """An expected failure with a message meant for the user."""

    status_code = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class Unauthorized(HeadcatError):
    """No API key, or one headcat does not know (answers with ``WWW-Authenticate: Bearer``)."""

    status_code = 401


class Forbidden(HeadcatError):
    """A known API key that may not do this (it was revoked)."""

    status_code = 403


class NotFound(HeadcatError):
    status_code = 404


class Conflict(HeadcatError):
    status_code = 409


class InvalidInput(HeadcatError):
    status_code = 422


class TooLarge(HeadcatError):
    status_code = 413


def known(values: Iterable[object]) -> str:
    """``'a', 'b'`` for an error message listing the known values."""
    listed = ", ".join(repr(v) for v in values)
    return listed or "none"
