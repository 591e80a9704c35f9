"""FastAPI dependencies as ``Annotated`` aliases: the session, the settings, the store, the
caller's key, the job of a ``{job_id}`` route."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from server.errors import ApiError
from server.schemas import LINE_PATTERN
from server.services import jobs, keys
from server.settings import Settings
from server.storage import Storage
from server.tables import ApiKey, Job

COOKIE = "roundhouse_session"
# ``EventSource`` cannot set a header: on these routes (GET) a key may also come as ``?token=``
QUERY_TOKEN_ROUTES = frozenset(
    {"/api/jobs/{job_id}/stream", "/api/gpus/stream", "/api/transfers/{transfer_id}/stream"}
)


def app_settings(request: Request) -> Settings:
    """The settings the app was built with (``create_app(settings)``); the process's own are
    ``server.settings.get_settings()``."""
    return request.app.state.settings  # type: ignore[no-any-return]


def app_storage(request: Request) -> Storage:
    """The app's store (``server.storage``): where datasets and runs are read and written."""
    return request.app.state.storage  # type: ignore[no-any-return]


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StorageDep = Annotated[Storage, Depends(app_storage)]


def accepts_query_token(request: Request) -> bool:
    """Whether the request's route is an event stream, where ``?token=<key>`` is accepted."""
    route = request.scope.get("route")
    return request.method == "GET" and getattr(route, "path", None) in QUERY_TOKEN_ROUTES


def presented_key(request: Request) -> str | None:
    """The API key a request carries: ``Authorization: Bearer``, else ``?token=`` on an event
    stream. A ``?token=`` anywhere else is ignored: keys in URLs end up in logs and histories."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("token") if accepts_query_token(request) else None


def caller(request: Request, session: Session) -> ApiKey | None:
    """The key the caller authenticates with: a presented key, else the browser session's cookie."""
    key = presented_key(request)
    if key:
        return keys.check_key(session, key=key)
    cookie = request.cookies.get(COOKIE)
    return keys.check_session(session, secret=cookie) if cookie else None


def current_key(request: Request, session: SessionDep) -> ApiKey:
    row = caller(request, session)
    if row is None:
        raise ApiError(401, "unauthorized", "a valid API key is required (Authorization: Bearer <key>)")
    return row


CurrentKeyDep = Annotated[ApiKey, Depends(current_key)]


# an id in a route's path: one line of text, as long as any id column at most
IdPath = Annotated[str, Path(pattern=LINE_PATTERN, max_length=255)]


def found_job(session: SessionDep, job_id: IdPath) -> Job:
    """The job named by the route's ``job_id`` path parameter, or the 404 error."""
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="job_id")
    return job


JobDep = Annotated[Job, Depends(found_job)]


_LINE = re.compile(LINE_PATTERN)


def plain_parameters(request: Request) -> None:
    """Refuse a path or query parameter that is not one line of text (a control character, NUL
    above all: PostgreSQL can neither store nor compare it) with a 422 naming it. The app runs
    this before every route's own dependencies, so it covers parameters no route declares
    (``?token=``) and comes before any key check or query reads them."""
    for name, value in (*request.path_params.items(), *request.query_params.multi_items()):
        if _LINE.match(name) is None or _LINE.match(str(value)) is None:
            shown = name if _LINE.match(name) else repr(name)[:80]
            message = f"{shown}: must be one line of text: no NUL or other control character"
            raise ApiError(422, "invalid_request", message, param=name)
