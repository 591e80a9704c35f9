"""``/docs`` and ``/redoc``: the API's interactive docs, their scripts and styles served from here.

Swagger UI (5.x, which reads OpenAPI 3.1) and ReDoc come from the pinned ``fastapi-offline``
package's ``static/`` folder, so the pages render on a box with no internet access.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from server.deps import current_key
from server.errors import ApiError

ASSETS = "/docs/assets"
TYPES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
}
NO_ICON = "data:,"  # the default favicons are on a web site

# behind the key like every route but health and login (a browser sends its session cookie)
router = APIRouter(include_in_schema=False, dependencies=[Depends(current_key)])


@cache
def _folder() -> Path:
    return Path(str(files("fastapi_offline") / "static"))


@router.get("/docs")
def swagger() -> HTMLResponse:
    """Swagger UI on this server's OpenAPI schema."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="Roundhouse API",
        swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS}/swagger-ui.css",
        swagger_favicon_url=NO_ICON,
    )


@router.get("/redoc")
def redoc() -> HTMLResponse:
    """ReDoc on this server's OpenAPI schema."""
    return get_redoc_html(
        openapi_url="/openapi.json",
        title="Roundhouse API",
        redoc_js_url=f"{ASSETS}/redoc.standalone.js",
        redoc_favicon_url=NO_ICON,
        with_google_fonts=False,
    )


@router.get(ASSETS + "/{name}")
def asset(name: str) -> FileResponse:
    """One of the docs pages' scripts or styles."""
    if name not in TYPES:
        raise ApiError(404, "not_found", f"no docs asset {name!r}", param="name")
    return FileResponse(
        _folder() / name, media_type=TYPES[name], headers={"Cache-Control": "private, max-age=86400"}
    )
