"""API keys: random bearer tokens, stored as SHA-256 hashes (they carry 256 bits of entropy)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.tables import ApiKey, now

PREFIX_LEN = 8
USED_RESOLUTION = timedelta(minutes=1)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, name: str) -> str:
    """Store a new key and return it (the only time it is visible)."""
    key = "rh_" + secrets.token_urlsafe(32)
    session.add(ApiKey(name=name, prefix=key[:PREFIX_LEN], hash=_hash(key)))
    session.commit()
    return key


def ensure_first_key(session: Session) -> str | None:
    """Create the first key when there is none; return it then, else None."""
    if session.scalar(select(func.count()).select_from(ApiKey)):
        return None
    return create_key(session, name="first")


def check_key(session: Session, *, key: str) -> ApiKey | None:
    """The stored key matching ``key``, or None.

    ``last_used_at`` is written at most once a minute per key: a read must not turn into a write
    (on SQLite every write queues behind the others).
    """
    digest = _hash(key)
    for row in session.scalars(select(ApiKey).where(ApiKey.prefix == key[:PREFIX_LEN])):
        if hmac.compare_digest(row.hash, digest):
            stamp = now()
            if row.last_used_at is None or stamp - row.last_used_at > USED_RESOLUTION:
                row.last_used_at = stamp
                session.commit()
            return row
    return None
