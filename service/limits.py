"""Limits on requests: the body size cap (413, before or while the body is read), JSON bodies only (415),
and NUL bytes."""

from __future__ import annotations

import json

from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import InvalidInput


class BodyTooLarge(HTTPException):
    field = "body"

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"body: the request body is larger than {limit} bytes")


class BodyLimit:
    """Pure ASGI middleware: a declared ``Content-Length`` over ``limit`` is refused without reading
    the body; a streamed (chunked) body is counted and refused as soon as it passes ``limit``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send, self.limit if declared.isdigit() else None)
            return
        received, started = 0, False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(send, self.limit)

    async def _refuse(self, send: Send, limit: int | None) -> None:
        detail = (
            f"body: the request body is larger than {limit} bytes" if limit is not None
            else "body: Content-Length is not a number"
        )  # fmt: skip
        payload = json.dumps({"detail": detail, "field": "body"}).encode()
        await send({"type": "http.response.start", "status": 413 if limit is not None else 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})


JSON_ONLY = (
    "body: send the body as JSON with the header Content-Type: application/json (this request's is {got}); "
    "with curl: --json '{{...}}', or -H 'Content-Type: application/json' -d '{{...}}'"
)


class JsonBodies:
    """Pure ASGI middleware: every body headcat takes is JSON, so a body sent as anything else (curl's
    ``-d`` sends ``application/x-www-form-urlencoded``) is refused with 415 and a message that says what
    to send, before any endpoint parses it as something it is not. A request without a body passes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower().decode("latin-1")
        if not has_body or media == "application/json" or media.endswith("+json"):
            await self.app(scope, receive, send)
            return
        payload = json.dumps({"detail": JSON_ONLY.format(got=media or "not given"), "field": "body"}).encode()
        await send({"type": "http.response.start", "status": 415,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"accept", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})


async def reject_nul(request: Request) -> None:
    """PostgreSQL text cannot hold NUL (0x00): a path or query value with one is refused, named.

    ``async``: it does no I/O, so it runs on the event loop instead of costing a thread hop."""
    for where, params in (("path", request.path_params), ("query", request.query_params)):
        for name, value in params.items():
            if isinstance(value, str) and "\x00" in value:
                raise InvalidInput(f"{name}: the {where} parameter contains a NUL (0x00) character", field=name)
