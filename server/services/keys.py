"""API keys and browser sessions.

A key is a random bearer token for scripts. A browser logs in with a one-time link that expires
within minutes; using it starts a session bound to a key (the cookie holds the session's own
secret, never the key), and revoking the key ends its sessions. Keys, link tokens and session
secrets carry 256 bits of entropy and are stored as SHA-256 hashes only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, or_, select, update
from sqlalchemy.orm import Session

from server.tables import ApiKey, BrowserSession, now

PREFIX_LEN = 8
USED_RESOLUTION = timedelta(minutes=1)
KEY, LINK, SESSION = "rh_", "rhl_", "rhs_"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _secret(kind: str) -> str:
    return kind + secrets.token_urlsafe(32)


def create_key(session: Session, *, name: str) -> tuple[ApiKey, str]:
    """Store a new key; return its row and the key (the only time it is visible)."""
    key = _secret(KEY)
    row = ApiKey(name=name, prefix=key[:PREFIX_LEN], hash=_hash(key))
    session.add(row)
    session.commit()
    return row, key


def ensure_first_key(session: Session) -> str | None:
    """Create the first key when there is none; return it then, else None."""
    if session.scalar(select(func.count()).select_from(ApiKey)):
        return None
    return create_key(session, name="first")[1]


def list_keys(session: Session) -> list[tuple[ApiKey, int]]:
    """Every key, oldest first, with its number of live browser sessions."""
    live = (
        select(BrowserSession.key_id, func.count().label("n"))
        .where(BrowserSession.expires_at > now())
        .group_by(BrowserSession.key_id)
        .subquery()
    )
    joined = select(ApiKey, func.coalesce(live.c.n, 0)).outerjoin(live, live.c.key_id == ApiKey.id)
    rows = session.execute(joined.order_by(ApiKey.id))
    return [(key, int(n)) for key, n in rows]


def find_keys(session: Session, *, ref: str) -> list[ApiKey]:
    """The keys ``ref`` names: an id (digits) or a prefix as ``keys list`` shows it (``rh_AbCdE``)."""
    where = ApiKey.id == int(ref) if ref.isdigit() else ApiKey.prefix == ref
    return list(session.scalars(select(ApiKey).where(where).order_by(ApiKey.id)))


def revoke_key(session: Session, *, key_id: int) -> int:
    """Delete a key and every login link and browser session bound to it; return how many live
    sessions that ended."""
    ended = session.scalar(
        select(func.count())
        .select_from(BrowserSession)
        .where(BrowserSession.key_id == key_id, BrowserSession.expires_at > now())
    )
    session.execute(delete(BrowserSession).where(BrowserSession.key_id == key_id))
    session.execute(delete(ApiKey).where(ApiKey.id == key_id))
    session.commit()
    return int(ended or 0)


def _touch(session: Session, row: ApiKey) -> ApiKey:
    """Record a use of ``row``: ``last_used_at`` is written at most once a minute per key, so a
    read does not turn into a write (on SQLite every write queues behind the others)."""
    stamp = now()
    if row.last_used_at is None or stamp - row.last_used_at > USED_RESOLUTION:
        row.last_used_at = stamp
        session.commit()
    return row


def check_key(session: Session, *, key: str) -> ApiKey | None:
    """The stored key matching ``key``, or None."""
    digest = _hash(key)
    for row in session.scalars(select(ApiKey).where(ApiKey.prefix == key[:PREFIX_LEN])):
        if hmac.compare_digest(row.hash, digest):
            return _touch(session, row)
    return None


def create_login(session: Session, *, key_id: int | None, lifetime: timedelta) -> str:
    """Store a one-time login link's token for the key ``key_id`` (None: the oldest key, created
    when there is none) and return the token. Expired links and sessions are cleared here."""
    stamp = now()
    session.execute(
        delete(BrowserSession).where(
            or_(
                BrowserSession.expires_at <= stamp,
                BrowserSession.used_at.is_(None) & (BrowserSession.link_expires_at <= stamp),
            )
        )
    )
    if key_id is None:
        key_id = session.scalar(select(ApiKey.id).order_by(ApiKey.id).limit(1))
        if key_id is None:
            key_id = create_key(session, name="first")[0].id
    token = _secret(LINK)
    session.add(BrowserSession(key_id=key_id, link_hash=_hash(token), link_expires_at=stamp + lifetime))
    session.commit()
    return token


def redeem_login(session: Session, *, token: str, lifetime: timedelta) -> str | None:
    """Trade a login link's token for a new session's secret, once: None when the token is
    unknown, was used, or expired. The check and the use are one UPDATE, so two requests racing
    with the same link cannot both win."""
    secret = _secret(SESSION)
    stamp = now()
    result = session.execute(
        update(BrowserSession)
        .where(
            BrowserSession.link_hash == _hash(token),
            BrowserSession.used_at.is_(None),
            BrowserSession.link_expires_at > stamp,
        )
        .values(used_at=stamp, session_hash=_hash(secret), expires_at=stamp + lifetime)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return secret if cast(CursorResult[Any], result).rowcount == 1 else None


def check_session(session: Session, *, secret: str) -> ApiKey | None:
    """The key whose live browser session has the secret ``secret``, or None."""
    row = session.scalar(
        select(ApiKey)
        .join(BrowserSession, BrowserSession.key_id == ApiKey.id)
        .where(BrowserSession.session_hash == _hash(secret), BrowserSession.expires_at > now())
    )
    return None if row is None else _touch(session, row)
