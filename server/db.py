"""Database engine and sessions; migrations applied with Alembic at start.

SQLite by default (WAL journal, a busy timeout, foreign keys on); PostgreSQL by setting
``ROUNDHOUSE_DATABASE_URL`` (each connection checked before use, so one cut by a restart of the
server is replaced; a connection attempt gives up after ``CONNECT_TIMEOUT_S``). ``unavailable``
tells a server that cannot be reached from a statement that failed: the API answers the first
with 503, the worker keeps its writes until the server is back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
BUSY_TIMEOUT_MS = 10_000
# how long a new PostgreSQL connection may take (unless the URL sets connect_timeout): a server
# that is away answers within it, and a request waiting on it gets its 503 within it
CONNECT_TIMEOUT_S = 5
# the SQLSTATEs of a PostgreSQL server that cannot serve now: a connection exception (class 08),
# a server shutting down or crashed (57P01, 57P02), one still starting or recovering (57P03)
UNAVAILABLE_STATES = ("08", "57P01", "57P02", "57P03")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
        )

        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args: dict[str, Any] = {}
    if make_url(url).get_backend_name() == "postgresql" and "connect_timeout" not in make_url(url).query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database server cannot be reached now (stopped, restarting, the
    network away) rather than that a statement failed: what a later try may not meet again.

    A connection found dead (SQLAlchemy's disconnect test), or a PostgreSQL driver's operational
    error without a SQLSTATE (no connection was made) or with one of ``UNAVAILABLE_STATES``.
    SQLite's errors (a locked file) are never an outage."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    orig = exc.orig
    if not hasattr(orig, "sqlstate") and not hasattr(orig, "pgcode"):  # not PostgreSQL's driver
        return False
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return state is None or str(state).startswith(UNAVAILABLE_STATES)


def _transactional_ddl(engine: Engine) -> Engine:
    """An engine on the same SQLite file whose transactions hold DDL too (``BEGIN IMMEDIATE``: the
    write lock at once). The driver otherwise commits each ``CREATE``/``ALTER`` on its own, so a
    migration killed midway (a power cut) would stay half applied, and the next start fail."""
    ddl = create_engine(
        engine.url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
    )

    @event.listens_for(ddl, "connect")
    def _manual(conn: Any, _record: Any) -> None:
        conn.isolation_level = None  # the driver emits no BEGIN of its own
        cur = conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    @event.listens_for(ddl, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return ddl


def migrate(engine: Engine) -> None:
    """Apply every Alembic migration (idempotent); on SQLite all of them in one transaction, so a
    kill midway leaves the database as it was."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    target = _transactional_ddl(engine) if engine.url.get_backend_name() == "sqlite" else engine
    try:
        with target.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        if target is not engine:
            target.dispose()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def migrated_sessions(url: str) -> sessionmaker[Session]:
    """The sessions of the database at ``url``, migrated first (what a command line run opens)."""
    engine = make_engine(url)
    migrate(engine)
    return session_factory(engine)
