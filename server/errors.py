"""One JSON error shape for every failure: ``{"error": {"code", "message", "param"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.schemas import LINE_PATTERN, ErrorBody


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


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            body(exc.code, exc.message, exc.param, exc.details, exc.extra), status_code=exc.status
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param(first)
        message = f"{param}: {_message(first)}" if param else _message(first)
        details = [{"param": _param(e) or "", "message": _message(e)} for e in errors]
        return JSONResponse(body("invalid_request", message, param, details), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400: a body that cannot be parsed at all (not UTF-8 JSON, a broken multipart form)
        code = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)
