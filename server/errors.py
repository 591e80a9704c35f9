"""One JSON error shape for every failure: ``{"error": {"code", "message", "param"}}``.

Under ``/v1`` (the OpenAI-compatible API) the same handlers answer in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, and a request that does not validate is a
400 (OpenAI's status for it) instead of a 422. A service's refusal (``server.services.failures``)
and a job's illegal transition (409) get their HTTP status here, once. A database server that
cannot be reached (stopped, restarting) is a 503 ``database_unavailable`` with ``Retry-After``:
the request may be sent again as it is once the server is back."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.db import unavailable
from server.schemas import LINE_PATTERN, ErrorBody
from server.services.failures import Conflict, Invalid, NotFound, Refusal, TooLarge
from server.services.job_states import IllegalTransition
from server.storage import StorageUnavailable


class ApiError(Exception):
    """An error a route raises: HTTP status, machine code, human message, offending parameter."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        details: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.details = status, code, message, param, details
        self.extra = extra  # more fields of the error object (ErrorDetail), e.g. errors_total


def body(
    code: str,
    message: str,
    param: str | None = None,
    details: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict:
    error: dict[str, Any] = {"code": code, "message": message, "param": param}
    if details is not None:
        error["details"] = details
    error.update(extra or {})
    return {"error": error}


OPENAI_PREFIX = "/v1"
# OpenAI's error ``type`` by HTTP status (the client picks its exception class by the status)
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


# seconds a client is told to wait before it asks again a store that did not answer (503)
STORAGE_RETRY_AFTER_S = 30
log = logging.getLogger("roundhouse.api")
# what a 503 for a database that cannot be reached suggests to wait before sending the request again
DATABASE_RETRY_AFTER_S = 5


# the HTTP status of each refusal of a service (``server.services.failures``)
REFUSAL_STATUS: dict[type[Refusal], int] = {NotFound: 404, Conflict: 409, TooLarge: 413, Invalid: 422}


def openai_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """The error body of the OpenAI-compatible API."""
    kind = "server_error" if status >= 500 else OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# the name pydantic gives a union's choice in an error's location ("int", "literal['auto']")
_CHOICE = re.compile(r"^((constrained-)?(int|float|str|bool)|none|[a-z-]+\[.*\])$")


def _field(param: str | None) -> str | None:
    """The dotted field of a validation error's param, without the union choice at its end."""
    if not param:
        return param
    parts = param.split(".")
    while len(parts) > 1 and _CHOICE.match(parts[-1]):
        parts.pop()
    return ".".join(parts)


def _openai(request: Request) -> bool:
    path = request.url.path
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def _respond(
    request: Request,
    status: int,
    error: dict,
    *,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """``error`` (a ``body()``) as the response, in OpenAI's shape under ``/v1``."""
    if _openai(request):
        status = 400 if status == 422 else status
        inner = error["error"]
        param, message = _field(inner["param"]), inner["message"]
        if param != inner["param"]:  # a union's value: what each of its choices said
            said = [d["message"] for d in inner.get("details") or () if _field(d.get("param")) == param]
            message = f"{param}: {'; or '.join(dict.fromkeys(said))}"
        error = openai_body(status, inner["code"], message, param)
    return JSONResponse(error, status_code=status, headers=headers)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a router or route: the error statuses it answers, each in the one shape
    (so the OpenAPI schema shows ``ErrorBody``, not FastAPI's default validation error)."""
    return {s: {"model": ErrorBody, "description": HTTPStatus(s).phrase} for s in statuses}


def _param(error: Any) -> str | None:
    """The dotted field of one validation error (``body``/``query``/``path`` left out unless it is
    the whole body); the body too for JSON that does not parse (pydantic puts an offset there)."""
    if error.get("type") == "json_invalid":
        return "body"
    loc = [str(p) for p in error.get("loc", ())]
    if loc[1:] and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    return ".".join(loc) or None


def _message(error: Any) -> str:
    if error.get("type") == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == LINE_PATTERN:
        return "must be one line of text: no NUL or other control character"
    return str(error["msg"])


def disk_full_message(exc: OSError) -> str:
    """What a write that found no space says: the path, the bytes it needed and the bytes free."""
    needed, free = getattr(exc, "needed_bytes", None), getattr(exc, "free_bytes", None)
    path = getattr(exc, "path", None) or exc.filename
    if free is None and path:
        where = Path(str(path))
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free
    what = f"writing {path}" if path else "writing a file"
    need = f" needs {needed} bytes," if needed is not None else ""
    has = f" {free} bytes are free there" if free is not None else ""
    return f"disk full: no space left {what}:{need}{has}; free some space (GET /api/disk) and try again"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return _respond(request, exc.status, body(exc.code, exc.message, exc.param, exc.details, exc.extra))

    @app.exception_handler(Refusal)
    async def _refusal(request: Request, exc: Refusal) -> JSONResponse:
        status = next((s for kind, s in REFUSAL_STATUS.items() if isinstance(exc, kind)), 422)
        return _respond(request, status, body(exc.code, exc.message, exc.param, exc.details, exc.extra))

    @app.exception_handler(IllegalTransition)
    async def _transition(request: Request, exc: IllegalTransition) -> JSONResponse:
        # /v1 names the job by its path parameter; /api by the state it is in
        param = "fine_tuning_job_id" if _openai(request) else "status"
        return _respond(request, 409, body("illegal_transition", str(exc), param))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param(first)
        message = f"{param}: {_message(first)}" if param else _message(first)
        details = [{"param": _param(e) or "", "message": _message(e)} for e in errors]
        return _respond(request, 422, body("invalid_request", message, param, details))

    @app.exception_handler(OSError)
    async def _disk_full(request: Request, exc: OSError) -> JSONResponse:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise exc  # any other OSError stays an internal error
        return _respond(request, 507, body("disk_full", disk_full_message(exc)))

    @app.exception_handler(StorageUnavailable)
    async def _storage(request: Request, exc: StorageUnavailable) -> JSONResponse:
        message = f"the object store is unavailable, try again later: {exc}"
        headers = {"Retry-After": str(STORAGE_RETRY_AFTER_S)}
        return _respond(request, 503, body("storage_unavailable", message), headers=headers)

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        if not unavailable(exc):
            raise exc  # a statement that failed stays an internal error
        # the driver's words stay in the server's log: they name the database's host and port
        log.warning("%s %s: the database is unavailable: %s", request.method, request.url.path, exc.orig)
        message = "the database is unavailable (stopped or restarting); try again in a few seconds"
        headers = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
        return _respond(request, 503, body("database_unavailable", message), headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400: a body that cannot be parsed at all (not UTF-8 JSON, a broken multipart form)
        code = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return _respond(request, exc.status_code, body(code, str(exc.detail)), headers=exc.headers)
