"""``/guide``: the manual (``docs/``) rendered as HTML pages, with its images (``server.guide.pages``).

Behind the key like ``/docs`` and every route but health and login: a browser sends its session
cookie. A missing page is a 404, as HTML for a browser (with the list of pages) and in the API's
JSON error shape otherwise; a path that tries to leave the manual (``..``, encoded or not, an
absolute path) is a 400 before any file is looked at.
"""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from server.deps import SettingsDep, current_key
from server.errors import ApiError
from server.guide.pages import PREFIX, SUFFIX, BadPath, Guide, docs_folder, document, page_url, render

WEB = Path(__file__).resolve().parents[2] / "web"  # the source tree's; the image sets web_dir
# the images may be any of FILE_TYPES: an SVG opened on its own runs no script
FILE_HEADERS = {"Cache-Control": "private, max-age=3600", "Content-Security-Policy": "default-src 'none'"}
PAGE_HEADERS = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False, dependencies=[Depends(current_key)])


def guide_of(settings: SettingsDep) -> Guide:
    return Guide(docs_folder(settings.web_dir or WEB))


@router.get(PREFIX)
def contents(request: Request, settings: SettingsDep) -> Response:
    """The manual's contents page (docs/index.md)."""
    return page(request, settings, "")


@router.get(PREFIX + "/{path:path}")
def page(request: Request, settings: SettingsDep, path: str) -> Response:
    """A page of the manual (docs/PATH.md) or one of its images (docs/PATH)."""
    guide = guide_of(settings)
    try:
        found = guide.page(path)
        file = None if found else guide.file(path)
    except BadPath as exc:
        raise ApiError(400, "invalid_request", f"path {exc}", param="path") from None
    if found is not None:
        name, source = found
        shown = render(source.read_text(encoding="utf-8"), name)
        body = document(guide, title=shown.title, body=shown.body, current=page_url(name))
        return HTMLResponse(body, headers=PAGE_HEADERS)
    if file is not None:
        return FileResponse(file[0], media_type=file[1], headers=FILE_HEADERS)
    if path.endswith(SUFFIX) and guide.page(path.removesuffix(SUFFIX)) is not None:
        return RedirectResponse(page_url(path), status_code=308)  # a link written as on GitHub
    message = f"no guide page {path!r}"
    if not guide.folder.is_dir():
        message += " (the manual's folder docs/ is not beside the web UI's)"
    if "text/html" in request.headers.get("accept", ""):
        body = f'<h1>Page not found</h1>\n<p id="not-found">{html.escape(message)}: see the pages beside.</p>'
        return HTMLResponse(document(guide, title="Not found", body=body, current=None), status_code=404)
    raise ApiError(404, "not_found", message, param="path")
