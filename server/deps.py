"""FastAPI dependencies as ``Annotated`` aliases: the session, the settings, the caller's key, the
job of a ``{job_id}`` route."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from server.errors import ApiError
from server.services import jobs, keys
from server.settings import Settings
from server.tables import ApiKey, Job

COOKIE = "roundhouse_key"


def app_settings(request: Request) -> Settings:
    """The settings the app was built with (``create_app(settings)``); the process's own are
    ``server.settings.get_settings()``."""
    return request.app.state.settings  # type: ignore[no-any-return]


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(app_settings)]
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


def found_job(session: SessionDep, job_id: str) -> Job:
    """The job named by the route's ``job_id`` path parameter, or the 404 error."""
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="job_id")
    return job


JobDep = Annotated[Job, Depends(found_job)]
