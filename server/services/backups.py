"""``roundhouse backup DIR`` and ``roundhouse restore DIR``: a home's database, taken online and
consistent, with the files its rows name.

- The database: SQLite through its backup API (a consistent copy while the service runs);
  PostgreSQL through ``pg_dump`` (custom format; ``pg_restore`` puts it back). API keys live in
  it (hashed), so they come back with it.
- The files, with the home folder as the store: the stored datasets, and each job's folder
  without its rebuildable downloads (``exports/``) and without what a write in progress has not
  renamed into place (hidden names). Copied after the database, so every row of the copy finds
  its file (a checkpoint written meanwhile comes along too; the worker records it on the next run).
- With a remote store (S3) the objects stay where they are: ``objects.json`` lists every key
  with its size, and ``restore`` checks the store against it (``missing_objects``).

``restore`` refuses a home that has jobs or datasets already; it puts the files and the database
back (on PostgreSQL into a database emptied of the service's tables first), then applies the
migrations (a backup of an older release comes up to date).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from engine.training import EXPORTS_DIR
from server.db import make_engine, migrate, session_factory
from server.settings import Settings
from server.storage import LocalStorage, Storage, open_storage
from server.tables import Base, Dataset, Job

MANIFEST = "backup.json"
SQLITE_FILE = "roundhouse.db"
PG_DUMP = "roundhouse.pgdump"
OBJECTS = "objects.json"
FILES = "home"  # the copied folders of the home: datasets/, runs/
FOLDERS = ("datasets", "runs")
SKIP = (EXPORTS_DIR,)  # rebuilt on the next download


def _postgres_url(settings: Settings) -> str:
    """The URL as libpq takes it (no ``+driver``)."""
    return make_url(settings.url).set(drivername="postgresql").render_as_string(hide_password=False)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
            if (folder / name).is_file():
                return str(folder / name)
        raise RuntimeError(f"{name} is not installed: it backs up and restores a PostgreSQL database")
    return found


def _copy_tree(source: Path, target: Path) -> int:
    """Copy ``source`` into ``target`` leaving out hidden names (writes in progress) and ``SKIP``."""
    count = 0
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP]
        here = Path(folder)
        into = target / here.relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.startswith("."):
                continue
            try:
                shutil.copy2(here / name, into / name)
            except FileNotFoundError:  # pruned meanwhile: no row of the copy names it
                continue
            count += 1
    return count


def backup(settings: Settings, target: Path) -> dict[str, Any]:
    """Write a backup of the home to ``target`` (new or empty). Returns its manifest."""
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} is not empty: back up into a new folder")
    target.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.url)
    migrate(engine)
    backend = engine.url.get_backend_name()
    with engine.connect() as conn:
        revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    engine.dispose()
    if backend == "sqlite":
        source = sqlite3.connect(str(engine.url.database))
        copy = sqlite3.connect(target / SQLITE_FILE)
        with copy:
            source.backup(copy)
        source.close()
        copy.close()
    else:
        dump = [_tool("pg_dump"), "--format=custom", "--no-owner", "-f", str(target / PG_DUMP)]
        subprocess.run([*dump, _postgres_url(settings)], check=True)
    store = open_storage(settings)
    files = 0
    if isinstance(store, LocalStorage):
        for name in FOLDERS:
            if (store.root / name).is_dir():
                files += _copy_tree(store.root / name, target / FILES / name)
    else:
        listed = [{"key": k, "bytes": size} for k, size in store.list("")]
        (target / OBJECTS).write_text(json.dumps({"store": store.url, "objects": listed}, indent=1) + "\n")
    manifest = {
        "database": backend,
        "revision": revision,
        "store": store.url,
        "files": files,
        "created": datetime.now(UTC).isoformat(),
    }
    (target / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _empty(settings: Settings) -> None:
    engine = make_engine(settings.url)
    migrate(engine)
    with session_factory(engine)() as session:
        held = (session.scalar(select(func.count(Job.id))) or 0) + (
            session.scalar(select(func.count(Dataset.id))) or 0
        )
    engine.dispose()
    if held:
        raise ValueError(
            f"the database {make_url(settings.url)!r} holds jobs or datasets: restore into an empty home"
        )


def _drop_tables(settings: Settings) -> None:
    """Drop the service's tables (and its migration mark) from the empty home's PostgreSQL
    database, so that the dump, maybe of an older release, is restored alone and then migrated
    (``pg_restore --clean`` drops only what the dump holds: a newer table would stay and its
    migration find it there)."""
    engine = make_engine(settings.url)
    try:
        Base.metadata.drop_all(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS alembic_version")
    finally:
        engine.dispose()


def restore(settings: Settings, source: Path) -> dict[str, Any]:
    """Put the backup in ``source`` back into an empty home. Returns its manifest."""
    manifest = json.loads((source / MANIFEST).read_text())
    store: Storage = open_storage(settings)
    url = make_url(settings.url)
    if url.get_backend_name() != manifest["database"]:
        raise ValueError(
            f"the backup holds a {manifest['database']} database; the home uses {url.drivername}"
        )
    database = Path(str(url.database)) if manifest["database"] == "sqlite" else None
    if database is not None and database.exists():
        _empty(settings)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
    elif database is None:
        _empty(settings)
        _drop_tables(settings)
    if isinstance(store, LocalStorage) and (source / FILES).is_dir():
        for name in FOLDERS:
            if (source / FILES / name).is_dir():
                _copy_tree(source / FILES / name, store.root / name)
    if database is not None:
        database.parent.mkdir(parents=True, exist_ok=True)
        backup_db = sqlite3.connect(source / SQLITE_FILE)
        copy = sqlite3.connect(database)
        with copy:
            backup_db.backup(copy)
        backup_db.close()
        copy.close()
    else:
        restore_cmd = [
            _tool("pg_restore"),
            "--clean",
            "--if-exists",
            "--no-owner",
            "-d",
            _postgres_url(settings),
        ]
        subprocess.run([*restore_cmd, str(source / PG_DUMP)], check=True)
    engine = make_engine(settings.url)
    migrate(engine)
    engine.dispose()
    if not isinstance(store, LocalStorage) and (source / OBJECTS).is_file():
        listed = json.loads((source / OBJECTS).read_text())["objects"]
        manifest |= {"objects": len(listed), "missing_objects": missing_objects(store, source, listed)}
    return manifest


def missing_objects(store: Storage, source: Path, listed: list[dict[str, Any]] | None = None) -> list[str]:
    """The keys the backup in ``source`` lists (``objects.json``, or ``listed`` when already read)
    that ``store`` lacks or holds at another size; a download (``exports/``), rebuilt on demand,
    is not missed."""
    if listed is None:
        listed = json.loads((source / OBJECTS).read_text())["objects"]
    held = dict(store.list(""))
    return [
        o["key"]
        for o in listed
        if not set(o["key"].split("/")) & set(SKIP) and held.get(o["key"]) != o["bytes"]
    ]
