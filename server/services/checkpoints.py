"""Checkpoints: rows written by the worker as the run saves them; archives built for download."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.tables import Checkpoint

MANIFEST = "MANIFEST.sha256"
STATE = "state"  # the resume state inside a checkpoint folder; not part of a download


def record(
    session: Session, *, job_id: str, step: int, path: str, kind: str, metrics: dict[str, Any]
) -> None:
    """Add the checkpoint the run just saved; forget the ones it pruned from disk."""
    for old in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)):
        if old.step == step or not Path(old.path).is_dir():
            session.delete(old)
    session.add(Checkpoint(job_id=job_id, step=step, path=path, kind=kind, metrics=metrics))
    session.commit()


def list_for(session: Session, *, job_id: str) -> list[Checkpoint]:
    """The job's checkpoints still on disk, oldest first."""
    rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
    return [r for r in rows if Path(r.path).is_dir()]


def get(session: Session, *, job_id: str, step: int) -> Checkpoint | None:
    found = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    return found if found is not None and Path(found.path).is_dir() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def export_files(folder: Path) -> list[Path]:
    """The files of a checkpoint's export (everything but the resume state), sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] != STATE)


_building: dict[str, threading.Lock] = {}
_building_guard = threading.Lock()


@contextlib.contextmanager
def _building_lock(target: Path) -> Iterator[None]:
    """Hold the right to build ``target``: one thread of this process and one server process at a
    time (``serve --processes N``), through a lock file next to it.

    ``flock`` alone also excludes threads on a local disk (each ``open`` is its own lock holder),
    but on NFS it becomes a per-process lock; the thread lock keeps threads apart there too."""
    with _building_guard:
        lock = _building.setdefault(str(target), threading.Lock())
    with lock, open(target.with_name(f".{target.name}.lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file is closed
        yield


def build_archive(folder: Path, target: Path) -> Path:
    """Write ``target`` (.tar): the export's files plus ``MANIFEST.sha256`` listing their sums.

    Built once (parallel first requests wait for the one build) under a unique temporary name
    next to it and renamed into place, so a download never sees half a file.
    """
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building_lock(target):
        if target.is_file():
            return target
        files = export_files(folder)
        manifest = "".join(f"{_sha256(p)}  {p.relative_to(folder).as_posix()}\n" for p in files).encode()
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
                info = tarfile.TarInfo(MANIFEST)
                info.size = len(manifest)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(manifest))
                for p in files:
                    tar.add(p, arcname=p.relative_to(folder).as_posix(), recursive=False)
            os.chmod(name, 0o644)  # mkstemp's 0600 otherwise
            os.replace(name, target)
        finally:
            Path(name).unlink(missing_ok=True)
    return target


def merged_folder(checkpoint: Checkpoint, *, base: Path, exports: Path) -> Path:
    """The adapter of ``checkpoint`` merged into its base model (built once, then reused)."""
    from engine.model.export import merge_adapter

    out = exports / f"step_{checkpoint.step:06d}-merged"
    if (out / "config.json").is_file():
        return out
    exports.mkdir(parents=True, exist_ok=True)
    with _building_lock(out):
        if (out / "config.json").is_file():
            return out
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=exports))
        try:
            merge_adapter(checkpoint.path, base, work / "model")
            shutil.rmtree(out, ignore_errors=True)  # a folder without config.json is no build; free the name
            (work / "model").rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out
