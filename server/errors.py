"""One JSON error shape for every failure: ``{"error": {"code", "message", "param"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.schemas import ErrorBody


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
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.details = status, code, message, param, details


def body(
    code: str, message: str, param: str | None = None, details: list[dict[str, Any]] | None = None
) -> dict:
    error: dict[str, Any] = {"code": code, "message": message, "param": param}
    if details is not None:
        error["details"] = details
    return {"error": error}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a router or route: the error statuses it answers, each in the one shape
    (so the OpenAPI schema shows ``ErrorBody``, not FastAPI's default validation error)."""
    return {s: {"model": ErrorBody, "description": HTTPStatus(s).phrase} for s in statuses}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(body(exc.code, exc.message, exc.param, exc.details), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        details = [{"param": ".".join(str(p) for p in e["loc"][1:]), "message": e["msg"]} for e in errors]
        return JSONResponse(body("invalid_request", message, param, details), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)
