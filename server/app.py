"""``create_app()``: the FastAPI application (routers, error shape, auth, migrations at start)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from server import __version__, errors
from server.api import (
    checkpoints,
    datasets,
    disk,
    docs,
    evaluations,
    generate,
    gpus,
    guide,
    health,
    hub,
    jobs,
    login,
    methods,
    models,
    plan,
    sweeps,
)
from server.api.openai import completions as openai_completions
from server.api.openai import files as openai_files
from server.api.openai import fine_tuning as openai_fine_tuning
from server.api.openai import graders as openai_graders
from server.api.openai import models as openai_models
from server.api.openai import sweeps as openai_sweeps
from server.db import make_engine, migrate, session_factory
from server.deps import current_key, plain_parameters
from server.services import datasets as datasets_service
from server.services import keys
from server.settings import Settings, get_settings
from server.storage import open_storage
from server.streams import Hub, lifespan

WEB = Path(__file__).resolve().parent.parent / "web"
LANDING = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Roundhouse</title></head>
<body><h1>Roundhouse</h1><p>The REST API is described at <a href="/docs">/docs</a>.</p></body></html>"""


def create_app(settings: Settings | None = None, *, apply_migrations: bool = True) -> FastAPI:
    """Build the app: apply migrations, create the first API key if there is none, and remove what
    uploads cut short by a killed process left (``datasets.sweep_incoming``)."""
    settings = settings or get_settings()
    engine = make_engine(settings.url)
    if apply_migrations:
        migrate(engine)
    sessions = session_factory(engine)
    storage = open_storage(settings)
    with sessions() as session:
        first_key = keys.ensure_first_key(session)
        # what uploads cut short by a killed process left (a crash, a power cut)
        datasets_service.sweep_incoming(session, storage=storage, scratch=settings.cache_dir / "incoming")

    app = FastAPI(
        title="Roundhouse",
        version=__version__,
        summary="Fine-tune open LLMs on one box of consumer GPUs",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        dependencies=[Depends(plain_parameters)],  # before each route's own: no NUL reaches a query
    )
    app.state.settings = settings
    app.state.storage = storage
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.first_key = first_key
    tick = settings.telemetry_seconds
    app.state.streams = Hub(sessions, stale_after=tick * 5, gpu_every=tick / 2)
    errors.install(app)
    for module in (health, datasets, models, methods, jobs, checkpoints, gpus, plan, disk):
        app.include_router(module.router)
    app.include_router(evaluations.router)
    app.include_router(generate.router)  # the playground: a stream with no session held open
    app.include_router(hub.router)  # Hugging Face Hub pulls and pushes
    app.include_router(sweeps.router)  # hyperparameter sweeps: their trials are jobs
    for module in (openai_files, openai_fine_tuning, openai_models):  # /v1: OpenAI's fine-tuning API
        app.include_router(module.router)
    app.include_router(openai_sweeps.router)  # /v1 extension: sweeps of fine-tuning jobs
    app.include_router(openai_graders.router)  # /v1: graders, checked and tried on answers
    app.include_router(openai_completions.router)  # /v1: answers, from the workers' inference services
    for module in (jobs, gpus, hub):  # the event streams: no database connection while open
        app.include_router(module.stream_router)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(current_key)])
    def openapi() -> JSONResponse:
        """The OpenAPI schema of every documented route (what /docs and /redoc read)."""
        return JSONResponse(app.openapi())

    app.include_router(docs.router)  # /docs, /redoc and their scripts, served from here
    app.include_router(guide.router)  # /guide: the manual of docs/, rendered
    app.include_router(login.router)

    web = settings.web_dir or WEB
    if web.is_dir():
        app.mount("/static", StaticFiles(directory=web), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        """The web UI's page (web/index.html)."""
        page = web / "index.html"
        return HTMLResponse(page.read_text() if page.is_file() else LANDING)

    return app


def app_for_process() -> FastAPI:
    """The app of one of several server processes (the parent applied the migrations)."""
    return create_app(get_settings(), apply_migrations=False)
