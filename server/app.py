"""``create_app()``: the FastAPI application (routers, error shape, auth, migrations at start)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from server import __version__, errors
from server.api import checkpoints, datasets, gpus, health, jobs, models, plan
from server.db import make_engine, migrate, session_factory
from server.deps import COOKIE, SessionDep, current_key
from server.errors import ApiError
from server.services import keys
from server.settings import Settings, get_settings

WEB = Path(__file__).resolve().parent.parent / "web"
LANDING = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Roundhouse</title></head>
<body><h1>Roundhouse</h1><p>The REST API is described at <a href="/docs">/docs</a>.</p></body></html>"""


def create_app(settings: Settings | None = None, *, apply_migrations: bool = True) -> FastAPI:
    """Build the app: apply migrations, create the first API key if there is none."""
    settings = settings or get_settings()
    engine = make_engine(settings.url)
    if apply_migrations:
        migrate(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        first_key = keys.ensure_first_key(session)

    app = FastAPI(
        title="Roundhouse",
        version=__version__,
        summary="Fine-tune open LLMs on one box of consumer GPUs",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.first_key = first_key
    errors.install(app)
    for module in (health, datasets, models, jobs, checkpoints, gpus, plan):
        app.include_router(module.router)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(current_key)])
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(current_key)])
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Roundhouse API")

    @app.get("/login", include_in_schema=False)
    def login(session: SessionDep, token: Annotated[str, Query(min_length=1)]) -> Any:
        """Trade the printed login URL's token for a cookie, then open the app."""
        if keys.check_key(session, key=token) is None:
            raise ApiError(401, "unauthorized", "this login link's key is not valid", param="token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", max_age=30 * 24 * 3600)
        return response

    web = settings.web_dir or WEB
    if web.is_dir():
        app.mount("/static", StaticFiles(directory=web), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        page = web / "index.html"
        return HTMLResponse(page.read_text() if page.is_file() else LANDING)

    return app


def app_for_process() -> FastAPI:
    """The app of one of several server processes (the parent applied the migrations)."""
    return create_app(get_settings(), apply_migrations=False)


def login_url(settings: Settings, key: str) -> str:
    base = settings.public_url or f"http://{settings.host}:{settings.port}"
    return f"{base.rstrip('/')}/login?token={key}"
