"""``roundhouse``: the engine's commands plus ``serve``, ``worker`` and ``keys``.

``roundhouse serve --with-worker --demo`` is what ``make run`` starts: the API, a worker in a
child process on the no-server broker, the demo model and dataset ready, and a one-time login link
(``roundhouse login-url`` prints another; ``roundhouse keys create | list | revoke`` for scripts).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.commands import build_parser as engine_parser
from engine.commands import main as engine_main

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from server.settings import Settings
    from server.tables import ApiKey

DEMO_DATASETS = (  # (name, the engine.demo attribute holding the file's path)
    ("demo: inventory (train)", "TRAIN"),
    ("demo: inventory (held-out)", "HELDOUT"),
    ("demo: inventory preferences (train)", "PREFERENCE_TRAIN"),
    ("demo: inventory preferences (held-out)", "PREFERENCE_HELDOUT"),
    ("demo: inventory prompts (train)", "PROMPTS_TRAIN"),
    ("demo: inventory prompts (held-out)", "PROMPTS_HELDOUT"),
)
# how long uvicorn lets requests finish once asked to stop (the event streams end at once);
# `docker compose stop` waits 10 s before it kills
SHUTDOWN_GRACE_S = 5
ANNOUNCE_WAIT_S = 120.0  # the longest the login link waits for the worker to come up


def _prepare_demo(settings: Any, sessions: Any) -> None:
    """The demo base model (converted once from its package) and the demo datasets, stored once."""
    from engine import demo
    from engine.model import prepare_demo_model
    from server.services import datasets
    from server.storage import open_storage

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
                        storage=open_storage(settings),
                        scratch=settings.cache_dir / "incoming",
                        max_bytes=settings.max_upload_bytes,
                    )


def _stopped(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app
    from server.services import keys
    from server.settings import get_settings

    # SIGTERM is a request to stop: uvicorn handles it while it serves, then raises it again once
    # it has stopped, which by default would kill this process before the worker below is stopped
    signal.signal(signal.SIGTERM, _stopped)
    settings = get_settings().model_copy(update={"host": args.host, "port": args.port})
    app = create_app(settings)
    _say_confinement(settings)
    if args.demo:
        _prepare_demo(settings, app.state.sessions)
    with app.state.sessions() as session:
        key_id = None  # the first key
        if args.new_login_key and app.state.first_key is None:
            key_id = keys.create_key(session, name="login")[0].id
        link = _login_link(session, settings, key_id=key_id)
    worker = None
    started = time.time()
    if args.with_worker:
        env = {**os.environ, **settings.child_environment()}
        worker = subprocess.Popen([sys.executable, "-m", "server.cli", "worker"], env=env)
    # the link comes last, under the worker's banner and warnings: once the worker samples
    announce = functools.partial(_announce, link, settings, app.state.sessions, started, worker)
    threading.Thread(target=announce, name="announce-login", daemon=True).start()
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
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            )
        else:
            uvicorn.run(
                app,
                host=settings.host,
                port=settings.port,
                log_level="warning",
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            )
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    return 0


def _say_confinement(settings: Settings) -> None:
    """Print which confinement this box gives python graders (stderr when they are refused)."""
    from engine.graders import UNCONFINED_SETTING, confinement_refusal, detect_confinement

    if settings.allow_unconfined_graders:
        os.environ[UNCONFINED_SETTING] = "1"
    confinement = detect_confinement()
    refused = confinement_refusal(confinement) is not None
    print(confinement.describe(), file=sys.stderr if refused else sys.stdout, flush=True)


def cmd_worker(args: argparse.Namespace) -> int:
    from server.db import make_engine, migrate
    from server.services.placement import worker_queues
    from server.worker.network import endpoint
    from server.worker.tasks import app, settings
    from server.worker.telemetry import count_gpus

    migrate(make_engine(settings.url))
    host = settings.host_name
    name = args.name or f"roundhouse-{os.getpid()}@{host}"
    gpus = settings.worker_gpus if settings.worker_gpus is not None else count_gpus()
    queues = worker_queues(settings.queue, host=host, gpus=gpus)
    print(f"worker {name} on host {host}: {gpus} GPU(s); queues {', '.join(queues)}", flush=True)
    box = endpoint(settings)  # where the other boxes of a job on several hosts reach this one
    nic = f" on {box.interface}" if box.interface else ""
    speed = f" ({box.link_gbps:g} Gb/s)" if box.link_gbps else ""
    print(f"the boxes of a job on several hosts reach this one at {box.address}:{box.port}{nic}{speed}")
    _say_confinement(settings)
    if settings.storage_url and not (settings.database_url and settings.redis_url):
        # a remote store means a worker on another host: it must share the API's database and broker
        unset = [
            n
            for n, v in (("DATABASE_URL", settings.database_url), ("REDIS_URL", settings.redis_url))
            if not v
        ]
        print(
            f"warning: ROUNDHOUSE_{' and ROUNDHOUSE_'.join(unset)} unset: this worker uses its own home's"
            " (SQLite, folder broker) and sees only jobs of an API on this machine with the same home",
            file=sys.stderr,
            flush=True,
        )
    argv = [
        "worker",
        "--queues",
        ",".join(queues),
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


def cmd_models_push(args: argparse.Namespace) -> int:
    """Put a model folder in the store as ``models/<NAME>/``: a worker on any host that has no
    folder of that name pulls it from there (``server.worker.files.fetch_model``)."""
    from pathlib import Path

    from server.settings import get_settings
    from server.storage import check_key, open_storage

    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        print(f"{folder}: not a Hugging Face model folder (no config.json)", file=sys.stderr)
        return 1
    try:
        prefix = check_key(f"models/{args.name}")
    except ValueError as exc:
        print(f"NAME {args.name!r}: {exc}", file=sys.stderr)
        return 1
    storage = open_storage(get_settings())
    own = storage.local_path(prefix)
    if own is not None and own.resolve() == folder.resolve():
        print(f"{folder} is the store's own folder of {prefix}: nothing to copy")
        return 0
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    print(f"pushing {len(files)} file(s) of {folder} to {storage.url} as {prefix}/ ...", flush=True)
    storage.put_tree(prefix, folder)
    print(f"done: jobs with base_model {args.name!r} run on any host")
    return 0


def _login_link(session: Session, settings: Settings, *, key_id: int | None) -> str:
    """A new one-time login link for the key ``key_id`` (None: the first key)."""
    from datetime import timedelta

    from server.api.login import login_url
    from server.services import keys

    lifetime = timedelta(minutes=settings.login_link_minutes)
    return login_url(settings, keys.create_login(session, key_id=key_id, lifetime=lifetime))


def _announce(
    link: str, settings: Settings, sessions: Any, started: float, worker: subprocess.Popen[bytes] | None
) -> None:
    """Print the login link in a box, after the worker (when there is one) has started sampling,
    so that its banner and warnings come before it; at most ``ANNOUNCE_WAIT_S`` later."""
    from server.services import gpus

    deadline = time.monotonic() + ANNOUNCE_WAIT_S
    while worker is not None and worker.poll() is None and time.monotonic() < deadline:
        with sessions() as session:
            up = [h for h in gpus.hosts(session, stale_after=60) if h["heartbeat_at"].timestamp() >= started]
        if up:
            time.sleep(0.5)  # the worker's own last lines first
            break
        time.sleep(0.5)
    print(boxed([f"Roundhouse is up. Open: {link}", _link_note(settings)]), flush=True)


def boxed(lines: list[str]) -> str:
    """Lines in a box of ``=`` and ``|``, with a blank line above and below."""
    width = max(len(line) for line in lines)
    rule = "+" + "=" * (width + 4) + "+"
    return "\n".join(["", rule, *(f"|  {line.ljust(width)}  |" for line in lines), rule, ""])


def _link_note(settings: Settings) -> str:
    return (
        f"(the link works once, for {settings.login_link_minutes:g} minutes;"
        " `roundhouse login-url` prints a new one)"
    )


def _one_key(session: Session, ref: str) -> ApiKey | None:
    """The key ``ref`` names (an id or a prefix), or None after saying why on stderr."""
    from server.services import keys

    found = keys.find_keys(session, ref=ref)
    if len(found) != 1:
        why = "no key" if not found else f"{len(found)} keys ({', '.join(str(k.id) for k in found)})"
        print(f"{why} with the id or prefix {ref!r}: see `roundhouse keys list`", file=sys.stderr)
        return None
    return found[0]


def cmd_keys_create(args: argparse.Namespace) -> int:
    from server.db import migrated_sessions
    from server.services import keys
    from server.settings import get_settings

    settings = get_settings()
    with migrated_sessions(settings.url)() as session:
        row, key = keys.create_key(session, name=args.name)
        link = _login_link(session, settings, key_id=row.id)
    print(key)
    print(f"login URL: {link}\n{_link_note(settings)}", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from server.db import migrated_sessions
    from server.services import keys
    from server.settings import get_settings

    def when(stamp: Any) -> str:
        return stamp.strftime("%Y-%m-%d %H:%M UTC") if stamp else "never"

    with migrated_sessions(get_settings().url)() as session:
        rows = [
            (str(k.id), k.name, k.prefix, when(k.created_at), when(k.last_used_at), str(n))
            for k, n in keys.list_keys(session)
        ]
    header = ("ID", "NAME", "PREFIX", "CREATED", "LAST USED", "SESSIONS")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from server.db import migrated_sessions
    from server.services import keys
    from server.settings import get_settings

    with migrated_sessions(get_settings().url)() as session:
        row = _one_key(session, args.key)
        if row is None:
            return 1
        ended = keys.revoke_key(session, key_id=row.id)
    print(f"revoked key {row.id} ({row.name}, {row.prefix}); {ended} browser session(s) ended")
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from pathlib import Path

    from server.services import backups
    from server.settings import get_settings

    manifest = backups.backup(get_settings(), Path(args.folder))
    print(f"backed up the {manifest['database']} database and {manifest['files']} file(s) to {args.folder}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from pathlib import Path

    from server.services import backups
    from server.settings import get_settings

    try:
        manifest = backups.restore(get_settings(), Path(args.folder))
    except ValueError as exc:
        print(f"not restored: {exc}", file=sys.stderr)
        return 1
    print(f"restored the backup of {manifest['created']} ({manifest['files']} file(s))")
    missing = manifest.get("missing_objects")
    if missing:  # restored all the same: the rows that name them find nothing, as after a loss
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        print(
            f"warning: {len(missing)} of the {manifest['objects']} object(s) the backup lists are not in"
            f" the store {manifest['store']} (or have another size): {shown}",
            file=sys.stderr,
        )
    elif missing is not None:
        print(f"all {manifest['objects']} object(s) the backup lists are in the store")
    return 0


def cmd_login_url(args: argparse.Namespace) -> int:
    from server.db import migrated_sessions
    from server.settings import get_settings

    settings = get_settings()
    with migrated_sessions(settings.url)() as session:
        key_id = None
        if args.key is not None:
            row = _one_key(session, args.key)
            if row is None:
                return 1
            key_id = row.id
        link = _login_link(session, settings, key_id=key_id)
    print(link)
    print(_link_note(settings), file=sys.stderr)
    return 0


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def build_parser() -> argparse.ArgumentParser:
    from server import hub_commands, sweep_commands
    from server.settings import get_settings

    parser = engine_parser()
    sub = _subcommands(parser)
    settings = get_settings()
    s = sub.add_parser("serve", help="run the API (and, for one machine, a worker beside it)")
    s.add_argument(
        "--host", default=settings.host, help="the address to listen on (default: ROUNDHOUSE_HOST)"
    )
    s.add_argument(
        "--port",
        type=int,
        default=settings.port,
        help="the port to listen on, which login links name (default: ROUNDHOUSE_PORT)",
    )
    s.add_argument("--with-worker", action="store_true", help="also start a worker in a child process")
    s.add_argument("--demo", action="store_true", help="prepare the demo model and datasets first")
    s.add_argument(
        "--new-login-key", action="store_true", help="bind the login link to a new key, not the first"
    )
    s.add_argument("--processes", type=int, default=1, help="server processes (one core of Python each)")
    s.set_defaults(func=cmd_serve)
    w = sub.add_parser("worker", help="run the GPU worker (a Celery worker that owns every GPU here)")
    w.add_argument(
        "--name", help="the worker's name (default roundhouse-PID@HOST, HOST: ROUNDHOUSE_WORKER_HOST)"
    )
    w.add_argument(
        "--loglevel",
        default="INFO",
        help="the Celery worker's log level: DEBUG, INFO, WARNING, ERROR or CRITICAL",
    )
    w.set_defaults(func=cmd_worker)
    m = sub.add_parser("models", help="base models in the shared store")
    ms = m.add_subparsers(dest="models_command", required=True)
    mp = ms.add_parser("push", help="upload a model folder to the store as models/NAME/ for every worker")
    mp.add_argument("name", metavar="NAME", help='the base_model name jobs use, e.g. "Qwen/Qwen3-0.6B"')
    mp.add_argument("folder", metavar="FOLDER", help="a Hugging Face model folder (config.json, weights)")
    mp.set_defaults(func=cmd_models_push)
    c = sub.add_parser("checkpoints", help="a job's checkpoints")
    cs = c.add_subparsers(dest="checkpoints_command", required=True)
    hub_commands.add_parsers(sub, models=ms, checkpoints=cs)  # models pull, datasets pull, checkpoints push
    k = sub.add_parser("keys", help="API keys")
    ks = k.add_subparsers(dest="keys_command", required=True)
    kc = ks.add_parser("create", help="create an API key and print it with its login URL")
    kc.add_argument("--name", default="cli", help="the key's name, as `keys list` shows it")
    kc.set_defaults(func=cmd_keys_create)
    kl = ks.add_parser("list", help="every key: id, name, prefix, created, last used (never the key)")
    kl.set_defaults(func=cmd_keys_list)
    kr = ks.add_parser("revoke", help="delete a key and end its browser sessions")
    kr.add_argument("key", metavar="ID_OR_PREFIX", help="the key's id or prefix, as `keys list` shows")
    kr.set_defaults(func=cmd_keys_revoke)
    b = sub.add_parser("backup", help="copy the database (online, consistent) and the files its rows name")
    b.add_argument("folder", metavar="DIR", help="a new or empty folder")
    b.set_defaults(func=cmd_backup)
    r = sub.add_parser("restore", help="put a backup back into an empty home (then migrate it)")
    r.add_argument("folder", metavar="DIR", help="a folder `roundhouse backup` wrote")
    r.set_defaults(func=cmd_restore)
    lu = sub.add_parser("login-url", help="print a new one-time login link for the browser")
    lu.add_argument("--key", metavar="ID_OR_PREFIX", help="the session's key (default: the first key)")
    lu.set_defaults(func=cmd_login_url)
    sweep_commands.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    engine_commands = engine_parser()
    if words and words[0] in _subcommands(engine_commands).choices:
        # the engine's own commands (``plan`` answers in a fraction of a second) read none of the
        # service's settings: not even their module is imported
        return engine_main(words, parser=engine_commands)
    return engine_main(words, parser=build_parser())


if __name__ == "__main__":
    raise SystemExit(main())
