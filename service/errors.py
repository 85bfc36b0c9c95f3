"""Domain errors carry their HTTP status; one handler renders them. Expected failures are 4xx."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any


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


def load_refused(error: ValueError) -> InvalidInput:
    """A model that would not load (``ingest.loading.load_model``'s ``ValueError``) as the job's error: the device's
    when its message is about the device (``cuda:99`` on a machine without it), else the model's."""
    field = "device" if "device" in str(error) else "model"
    return InvalidInput(f"{field}: {error}", field=field)


def known(values: Iterable[object]) -> str:
    """``'a', 'b'`` for an error message listing the known values."""
    listed = ", ".join(repr(v) for v in values)
    return listed or "none"


# The body of every 4xx answer (and the 503), in OpenAPI form.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "description": "A 4xx answer: a message that starts with the field it is about, and that field "
    "(a query or path parameter, a body field as a dotted path, or null).",
    "properties": {
        "detail": {"type": "string", "title": "Detail", "description": "the message, naming the field"},
        "field": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Field"},
    },
    "required": ["detail"],
}


def validation_error(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Pydantic/FastAPI validation errors as one message naming each field, and the first field.

    ``loc`` is ``("query", "layer_gt")``, ``("body", "plan", 0, "prune")`` or ``("body",)``: the
    field is the parameter's or top-level body field's name (``body`` for the body itself), as in
    headcat's own errors; a nested place is spelled out in the message (``plan: at plan.0.ops: ...``).
    Pydantic's union-branch tags (``literal['paper']``, ``list[PlanRowCreate]``) are left out.
    """
    parts: list[str] = []
    fields: list[str] = []
    for error in errors:
        if error.get("type") == "json_invalid":  # loc is ("body", POSITION): the body itself is at fault
            position = error["loc"][-1] if len(error.get("loc", ())) > 1 else "?"
            reason = (error.get("ctx") or {}).get("error", "invalid JSON")
            parts.append(f"body: the JSON is malformed at character {position} (counting from 0): {reason}")
            fields.append("body")
            continue
        loc = [str(part) for part in error.get("loc", ())]
        where = loc[1:] if loc and loc[0] in ("query", "path", "header", "cookie", "body") else loc
        where = [part for part in where if not _UNION_TAG.fullmatch(part)]
        field = where[0] if where else (loc[0] if loc else "request")
        place = f"at {'.'.join(where)}: " if len(where) > 1 else ""
        got = error.get("input")
        shown = "" if error.get("type") == "missing" or isinstance(got, dict | list) else f" (got {got!r:.80})"
        parts.append(f"{field}: {place}{error.get('msg', 'invalid')}{shown}")
        fields.append(field)
    return "; ".join(parts) or "request: invalid", fields[0] if fields else None


# A pydantic union branch in a ``loc``: ``literal['paper']``, ``list[PlanRowCreate]``, ``function-after[...]``.
_UNION_TAG = re.compile(r"[a-z-]+\[.*\]")
