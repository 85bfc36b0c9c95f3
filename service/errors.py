"""Domain errors carry their HTTP status; one handler renders them. Expected failures are 4xx."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict


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


class Stopped(KeyboardInterrupt):
    """SIGTERM (or SIGINT), raised in the main thread the way Ctrl-C raises ``KeyboardInterrupt``, so that a
    command stopped by ``kill``, a supervisor or ``docker stop`` takes the same clean way out as Ctrl-C."""

    def __init__(self, signal_name: str = "SIGINT") -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def stopped_by(interrupt: KeyboardInterrupt) -> str:
    """The signal that raised ``interrupt``: a :class:`Stopped`'s, else Ctrl-C's SIGINT."""
    return interrupt.signal_name if isinstance(interrupt, Stopped) else "SIGINT"


class RequestBody(BaseModel):
    """The base of every request body (REST and the CLI's requests): a field it does not know is refused,
    named, with the allowed ones (:func:`validation_error`), never silently dropped."""

    model_config = ConfigDict(extra="forbid")


def load_refused(error: ValueError) -> InvalidInput:
    """A model that would not load (``ingest.loading.load_model``'s ``ValueError``) as the job's error: the device's
    when its message is about the device (``cuda:99`` on a machine without it), else the model's."""
    field = "device" if "device" in str(error) else "model"
    return InvalidInput(f"{field}: {error}", field=field)


# A message or log line names at most this many values of a list, then says how many more there are: a catalog
# of thousands of models keeps its lines readable.
SHOWN = 20


def listed(values: Iterable[object], show: Callable[[object], str] = str) -> str:
    """``a, b, c`` for a message or a log line; past :data:`SHOWN` values, the first ones and ``and N more``."""
    values = list(values)
    named = ", ".join(show(v) for v in values[:SHOWN])
    return f"{named} and {len(values) - SHOWN} more" if len(values) > SHOWN else named


def known(values: Iterable[object]) -> str:
    """``'a', 'b'`` for an error message listing the known values (:func:`listed`)."""
    return listed(values, repr) or "none"


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


def validation_error(
    errors: Sequence[Any], body: type[BaseModel] | None = None, names: Mapping[str, str] | None = None
) -> tuple[str, str | None]:
    """Pydantic/FastAPI validation errors as one message naming each field, and the first field.

    An unknown field (``extra_forbidden``) is ``kk: unknown field (allowed: models, k, ...)``, the allowed ones
    those of the model ``body`` has at that place. ``names`` renames fields as the user spelt them (the CLI's
    ``--options``).

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
        field = (names or {}).get(field, field)
        place = f"at {'.'.join(where)}: " if len(where) > 1 else ""
        got = error.get("input")
        shown = "" if error.get("type") == "missing" or isinstance(got, dict | list) else f" (got {got!r:.80})"
        message = error.get("msg", "invalid")
        if error.get("type") == "extra_forbidden":
            allowed = fields_at(body, where[:-1]) if body is not None else None
            message, shown = "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else ""), ""
        parts.append(f"{field}: {place}{message}{shown}")
        fields.append(field)
    return "; ".join(parts) or "request: invalid", fields[0] if fields else None


def fields_at(model: type[BaseModel], path: Sequence[str]) -> list[str] | None:
    """The fields (as sent: aliases) of the model found at ``path`` inside ``model`` (list indexes and dict keys
    passed over), or None where no model is there."""
    current: Any = model
    for part in path:
        if part.isdigit():  # a list's index: the same model goes on
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part) or next(
            (f for f in current.model_fields.values() if f.alias == part), None
        )
        if field is None:
            return None
        current = _inner_model(field.annotation)
    if not (isinstance(current, type) and issubclass(current, BaseModel)):
        return None
    return [field.alias or name for name, field in current.model_fields.items()]


def _inner_model(annotation: Any) -> Any:
    """The first pydantic model inside ``annotation`` (``list[Row] | None`` -> ``Row``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


# A pydantic union branch in a ``loc``: ``literal['paper']``, ``list[PlanRowCreate]``, ``function-after[...]``.
_UNION_TAG = re.compile(r"[a-z-]+\[.*\]")
