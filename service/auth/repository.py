"""SQL for API keys. Only the SHA-256 of a secret is stored; the secret is shown once."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.errors import InvalidInput, NotFound
from service.orm import ApiKey

PREFIX = "hc_"
DISPLAY_CHARS = 11  # "hc_" and 8 characters of the secret: enough to tell keys apart, useless to an attacker
TOUCH_EVERY = timedelta(minutes=1)  # last_used_at is written at most this often per key


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create(session: Session, name: str) -> tuple[ApiKey, str]:
    """A new key named ``name``: (the stored row, the secret). The secret is not stored."""
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidInput("name: a key's name is 1 to 200 characters", field="name")
    secret = PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(name=name, prefix=secret[:DISPLAY_CHARS], key_hash=digest(secret))
    session.add(key)
    session.flush()
    return key, secret


def list_all(session: Session) -> Sequence[ApiKey]:
    return session.scalars(select(ApiKey).order_by(ApiKey.id)).all()


def find(session: Session, id_or_prefix: str) -> ApiKey:
    """The key with this id, or the one key whose secret starts with this prefix (at least ``hc_`` + 4)."""
    text = id_or_prefix.strip()
    if text.isdigit():
        key = session.get(ApiKey, int(text))
        if key is None:
            raise NotFound(f"key: no key with id {text}", field="key")
        return key
    if not text.startswith(PREFIX) or len(text) < len(PREFIX) + 4:
        raise InvalidInput(f"key: give a key's id or the start of its secret ({PREFIX}xxxx...)", field="key")
    shown = text[:DISPLAY_CHARS]
    matches = list(session.scalars(select(ApiKey).where(ApiKey.prefix.startswith(shown, autoescape=True))))
    if len(text) > DISPLAY_CHARS:  # a whole secret (or more than the shown prefix): match its hash
        matches = [k for k in matches if k.key_hash == digest(text)]
    if not matches:
        raise NotFound(f"key: no key starts with {shown!r}", field="key")
    if len(matches) > 1:
        raise InvalidInput(f"key: {len(matches)} keys start with {shown!r}; give the id", field="key")
    return matches[0]


def revoke(session: Session, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
        session.flush()
    return key


def by_secret(session: Session, secret: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == digest(secret)))


def touch(session: Session, key: ApiKey) -> None:
    """Record the key's use, at most once a minute (a write per request would serialise its users)."""
    now = datetime.now(UTC)
    if key.last_used_at is None or now - key.last_used_at > TOUCH_EVERY:
        session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
