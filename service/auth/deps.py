"""The key check: ``Authorization: Bearer <key>`` on every write, and on reads when they are closed.

No header, a malformed one or an unknown key answers 401; a revoked key answers 403.
"""

from __future__ import annotations

import hmac
import re
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.auth import repository
from service.deps import SessionDep
from service.errors import Forbidden, Unauthorized
from service.orm import ApiKey

SECRET = re.compile(r"^hc_[A-Za-z0-9_\-]{20,100}$")

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="apiKey",
    description="an API key from `headcat keys create NAME`, sent as `Authorization: Bearer hc_...`",
)


def authenticate(session: SessionDep, secret: str | None) -> ApiKey:
    if not secret:
        raise Unauthorized("authorization: this needs an API key (Authorization: Bearer <key>)", field="authorization")
    if not SECRET.match(secret):
        raise Unauthorized("authorization: that is not a headcat API key (hc_...)", field="authorization")
    key = repository.by_secret(session, secret)
    if key is None or not hmac.compare_digest(key.key_hash, repository.digest(secret)):
        raise Unauthorized("authorization: unknown API key", field="authorization")
    if key.revoked_at is not None:
        raise Forbidden(f"authorization: API key {key.prefix}... ({key.name}) was revoked", field="authorization")
    repository.touch(session, key)
    return key


def require_key(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> ApiKey:
    """Every endpoint that changes the catalog or starts work depends on this."""
    return authenticate(session, credentials.credentials if credentials is not None else None)


async def read_access(request: Request, session: SessionDep) -> None:
    """Reads are open unless ``HEADCAT_READS_REQUIRE_KEY=true``; then they need a key too.

    ``async`` so that an open read decides on the event loop; only the key's lookup goes to a thread."""
    if not request.app.state.settings.reads_require_key:
        return
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    await run_in_threadpool(authenticate, session, secret.strip() if scheme.lower() == "bearer" else None)


RequireKey = Depends(require_key)
ReadAccess = Depends(read_access)

KEY_RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "no API key, or an unknown one (`Authorization: Bearer <key>`)"},
    403: {"description": "the API key was revoked"},
}
