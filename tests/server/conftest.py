"""Service fixtures: a real database (a SQLite file, and PostgreSQL when one answers), the app
with its first key, a tiny base model, and — for the worker tests — Redis and a real worker."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.utils import Process, answers, child_env, roundhouse, xdist_worker
from tests.utils import postgres_database as temporary_postgres

POSTGRES_ADMIN = os.environ.get(
    "ROUNDHOUSE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards (skips without a server)."""
    from sqlalchemy.engine import make_url

    admin_url = make_url(POSTGRES_ADMIN)
    if not answers(admin_url.host or "127.0.0.1", admin_url.port or 5432):
        pytest.skip(f"no PostgreSQL server at {admin_url.host}:{admin_url.port}")
    with temporary_postgres(POSTGRES_ADMIN) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'roundhouse.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    home = tmp_path / "home"
    tiny_model_folder(home / "models" / "tiny")
    return Settings(
        home=home,
        database_url=database_url,
        max_upload_bytes=200_000,
        queue=f"t-{uuid.uuid4().hex}",
        hub_offline=True,  # no test reaches the real Hub (tests/utils/fake_hub.py stands in for it)
    )


@pytest.fixture
def app_and_key(settings: Settings) -> tuple[object, str]:
    app = create_app(settings)
    key = app.state.first_key
    assert key is not None and key.startswith("rh_")
    return app, key


@pytest.fixture
def client(app_and_key: tuple[object, str]) -> Iterator[TestClient]:
    app, key = app_and_key
    with TestClient(app) as c:  # type: ignore[arg-type]
        c.headers["Authorization"] = f"Bearer {key}"
        yield c


def _redis_url() -> str | None:
    # a database of its own for each pytest-xdist worker: 15, 14, ... (7 and below: test_durability)
    url = os.environ.get("ROUNDHOUSE_TEST_REDIS", f"redis://127.0.0.1:6379/{15 - xdist_worker() % 8}")
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    return url if answers(host, int(port or 6379)) else None


class WorkerProcess(Process):
    """``roundhouse worker`` on ``settings`` as a real process, with its log kept for failures."""

    def __init__(self, settings: Settings, log: Path) -> None:
        s = settings
        env = child_env(
            **s.child_environment(),
            ROUNDHOUSE_QUEUE=s.queue,
            ROUNDHOUSE_LEASE_SECONDS=str(s.lease_seconds),
            ROUNDHOUSE_TELEMETRY_SECONDS=str(s.telemetry_seconds),
            ROUNDHOUSE_CANCEL_GRACE_SECONDS=str(s.cancel_grace_seconds),
            ROUNDHOUSE_REQUEUE_AFTER_SECONDS=str(s.requeue_after_seconds),
            ROUNDHOUSE_MAX_RETRIES=str(s.max_retries),
        )
        if s.redis_url:
            env["ROUNDHOUSE_REDIS_URL"] = s.redis_url
        super().__init__(roundhouse("worker", "--loglevel", "INFO"), env=env, log=log)
        self.settings = settings

    def end(self) -> None:
        """Kill the worker's whole process group (its pool, training child and inference service)
        and reap it: the cleanup after a test that checks nothing of the worker's own shutdown,
        which would first wait out the broker's poll and the pool's exit (seconds a worker)."""
        self.kill_group()
        if self.proc is not None:
            self.proc.wait()


@pytest.fixture(params=["redis", "filesystem", "redis+postgresql"])
def worker_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """A database and a broker: SQLite with Redis, SQLite with the no-server folder transport that
    ``make run`` uses, and PostgreSQL with Redis (the end-to-end test only)."""
    if request.param == "redis+postgresql" and "upload_train_download" not in request.node.name:
        pytest.skip("the other worker tests do not depend on the database kind")
    redis = None
    if request.param.startswith("redis"):
        redis = _redis_url()
        if redis is None:
            pytest.skip("no Redis server answers (make test starts one)")
    home = tmp_path / "home"
    tiny_model_folder(home / "models" / "tiny")
    with contextlib.ExitStack() as stack:
        if request.param.endswith("postgresql"):
            url = stack.enter_context(postgres_database())
        else:
            url = f"sqlite:///{tmp_path / 'roundhouse.db'}"
        yield Settings(
            home=home,
            database_url=url,
            redis_url=redis,
            queue=f"t-{uuid.uuid4().hex}",
            lease_seconds=3.0,
            telemetry_seconds=0.5,
            cancel_grace_seconds=60.0,
        )


@pytest.fixture
def worker_client(worker_settings: Settings) -> Iterator[TestClient]:
    app = create_app(worker_settings)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.first_key}"
        yield c


@pytest.fixture
def workers(worker_settings: Settings, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Start workers with ``workers.append(WorkerProcess(...).start())``; all killed at the end."""
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.end()
