"""The upload limit, held while a request body arrives (the routes that take a dataset file:
``POST /api/datasets``, ``POST /v1/files``)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from starlette.types import Message

from server.deps import app_settings, caller
from server.errors import ApiError
from server.settings import Settings

MULTIPART_OVERHEAD = 65536  # allowed past the file limit for the form's name field, part headers, boundaries


def _too_large(settings: Settings) -> ApiError:
    limit = settings.max_upload_bytes
    return ApiError(413, "too_large", f"the upload exceeds the limit of {limit} bytes", param="file")


def _anonymous(request: Request) -> bool:
    with request.app.state.sessions() as session:
        return caller(request, session) is None


class LimitedBodyRoute(APIRoute):
    """A route whose request body is refused once it passes the upload limit, while it arrives:
    by its Content-Length before any of it is read, and by counting a chunked body as it is read.
    (FastAPI parses a multipart form, spooling the whole file to disk, before the route runs.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            settings = app_settings(request)
            # the caller's key before any of the body: a stranger must not make the server take in
            # (and spool) up to the limit (the route's own key check runs only after the form is read)
            if request.method == "POST" and await run_in_threadpool(_anonymous, request):
                raise ApiError(
                    401, "unauthorized", "a valid API key is required (Authorization: Bearer <key>)"
                )
            limit = settings.max_upload_bytes + MULTIPART_OVERHEAD
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                raise _too_large(settings)
            received = 0

            async def receive() -> Message:
                nonlocal received
                message = await request.receive()
                received += len(message.get("body", b""))
                if received > limit:  # the form parser stops, closes (and so deletes) its temp file
                    raise _too_large(settings)
                return message

            try:
                return await handler(Request(request.scope, receive))
            except Exception:
                if received > limit:  # FastAPI turns any error of the form parser into a 400
                    raise _too_large(settings) from None
                raise

        return limited
