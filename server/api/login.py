"""``/login``: a one-time login link traded for a session cookie (``roundhouse login-url`` prints
one)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from server.deps import COOKIE, SessionDep, SettingsDep
from server.services import keys
from server.settings import Settings

LINK_USED = """<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<title>Login link used or expired</title></head><body><h1>This login link was already used or has expired</h1>
<p>A login link works once, for {minutes:g} minutes. For a new one, run <code>roundhouse login-url</code>
on the server (<code>docker compose exec api roundhouse login-url</code> with Docker).</p></body></html>"""

router = APIRouter(include_in_schema=False)


@router.get("/login")
def login(
    request: Request, session: SessionDep, settings: SettingsDep, token: Annotated[str, Query(min_length=1)]
) -> Any:
    """Trade a one-time login link's token for a session cookie, then open the app."""
    lifetime = timedelta(days=settings.session_days)
    secret = keys.redeem_login(session, token=token, lifetime=lifetime)
    if secret is None:
        page = LINK_USED.format(minutes=settings.login_link_minutes)
        return HTMLResponse(page, status_code=401, headers={"Cache-Control": "no-store"})
    response = RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})
    # Secure when this request came over https (as the ASGI server reports it) or the public
    # URL is https; X-Forwarded-Proto is not read here
    secure = request.url.scheme == "https" or (settings.public_url or "").lower().startswith("https:")
    max_age = int(lifetime.total_seconds())
    response.set_cookie(COOKIE, secret, max_age=max_age, httponly=True, samesite="strict", secure=secure)
    return response


def login_url(settings: Settings, token: str) -> str:
    """The login link of a one-time token (``keys.create_login``)."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host  # a bind-all address
    base = settings.public_url or f"http://{host}:{settings.port}"
    return f"{base.rstrip('/')}/login?token={token}"
