"""``roundhouse``: the engine's commands plus ``serve``, ``worker`` and ``keys``.

``roundhouse serve --with-worker --demo`` is what ``make run`` starts: the API, a worker in a
child process on the no-server broker, the demo model and dataset ready, and a login URL.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from engine.cli import build_parser as engine_parser
from engine.cli import main as engine_main
from server.settings import get_settings

DEMO_DATASETS = (("demo: inventory (train)", "TRAIN"), ("demo: inventory (held-out)", "HELDOUT"))


def _prepare_demo(settings: Any, sessions: Any) -> None:
    """The demo base model (converted once from its package) and the demo datasets, stored once."""
    from engine import demo
    from engine.model.loading import prepare_demo_model
    from server.services import datasets

    print("preparing the demo model (once) ...", flush=True)
    prepare_demo_model(settings.models_dir)
    with sessions() as session:
        have = {d.name for d in datasets.list_datasets(session)}
        for name, attr in DEMO_DATASETS:
            if name not in have:
                path = getattr(demo, attr)
                with path.open("rb") as source:
                    datasets.store_upload(
                        session,
                        source=source,
                        filename=path.name,
                        name=name,
                        datasets_dir=settings.datasets_dir,
                        max_bytes=settings.max_upload_bytes,
                    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app, login_url
    from server.services import keys

    settings = get_settings().model_copy(update={"host": args.host, "port": args.port})
    app = create_app(settings)
    if args.demo:
        _prepare_demo(settings, app.state.sessions)
    key = app.state.first_key
    if key is None and args.new_login_key:
        with app.state.sessions() as session:
            key = keys.create_key(session, name="login")
    worker = None
    if args.with_worker:
        env = {**os.environ, **settings.child_environment()}
        worker = subprocess.Popen([sys.executable, "-m", "server.cli", "worker"], env=env)
    if key is not None:
        print(f"\nRoundhouse is up. Open: {login_url(settings, key)}\n", flush=True)
    else:
        print(
            f"\nRoundhouse is up at http://{settings.host}:{settings.port} (log in with your key, or create"
            " one: roundhouse keys create)\n",
            flush=True,
        )
    try:
        if args.processes > 1:  # each process builds its own app from the same environment
            os.environ.update(settings.child_environment())
            uvicorn.run(
                "server.app:app_for_process",
                factory=True,
                workers=args.processes,
                host=settings.host,
                port=settings.port,
                log_level="warning",
            )
        else:
            uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from server.db import make_engine, migrate
    from server.worker.tasks import app, settings

    migrate(make_engine(settings.url))
    name = args.name or f"roundhouse-{os.getpid()}@{socket.gethostname()}"
    argv = [
        "worker",
        "--queues",
        settings.queue,
        "--concurrency",
        "1",
        "--prefetch-multiplier",
        "1",
        "--hostname",
        name,
        "--loglevel",
        args.loglevel,
        "--without-gossip",
        "--without-mingle",
    ]
    app.worker_main(argv)
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from server.app import login_url
    from server.db import make_engine, migrate, session_factory
    from server.services import keys

    settings = get_settings()
    engine = make_engine(settings.url)
    migrate(engine)
    with session_factory(engine)() as session:
        key = keys.create_key(session, name=args.name)
    print(key)
    print(f"login URL: {login_url(settings, key)}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = engine_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    settings = get_settings()
    s = sub.add_parser("serve", help="run the API (and, for one machine, a worker beside it)")
    s.add_argument("--host", default=settings.host)
    s.add_argument("--port", type=int, default=settings.port)
    s.add_argument("--with-worker", action="store_true", help="also start a worker in a child process")
    s.add_argument("--demo", action="store_true", help="prepare the demo model and datasets first")
    s.add_argument("--new-login-key", action="store_true", help="print a login URL with a new key")
    s.add_argument("--processes", type=int, default=1, help="server processes (one core of Python each)")
    s.set_defaults(func=cmd_serve)
    w = sub.add_parser("worker", help="run the GPU worker (a Celery worker that owns every GPU here)")
    w.add_argument("--name", help="the worker's name (default roundhouse-PID@HOST)")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=cmd_worker)
    k = sub.add_parser("keys", help="API keys")
    ks = k.add_subparsers(dest="keys_command", required=True)
    kc = ks.add_parser("create", help="create an API key and print it with its login URL")
    kc.add_argument("--name", default="cli")
    kc.set_defaults(func=cmd_keys_create)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return engine_main(argv, parser=build_parser())


if __name__ == "__main__":
    raise SystemExit(main())
