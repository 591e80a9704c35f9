"""FastAPI dependencies as ``Annotated`` aliases: the session, the settings, the caller's key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from server.errors import ApiError
from server.services import keys
from server.settings import Settings
from server.tables import ApiKey

COOKIE = "roundhouse_key"


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


def presented_key(request: Request) -> str | None:
    """The key a request carries: ``Authorization: Bearer``, else the login cookie, else ``?token=``.

    The query token exists for the login URL and for ``EventSource``, which cannot set headers.
    """
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.cookies.get(COOKIE) or request.query_params.get("token")


def current_key(request: Request, session: SessionDep) -> ApiKey:
    key = presented_key(request)
    row = keys.check_key(session, key=key) if key else None
    if row is None:
        raise ApiError(401, "unauthorized", "a valid API key is required (Authorization: Bearer <key>)")
    return row


CurrentKeyDep = Annotated[ApiKey, Depends(current_key)]
