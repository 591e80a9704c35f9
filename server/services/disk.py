"""Disk use: each job's folder (checkpoints, exports, merged builds, its log) and the total.

With a remote store (S3) a job's bytes are the sizes its folder's listing gives, kept ``TTL_S``.
With the home folder as the store, a folder's size is a walk of its files, kept in a cache per
process. An entry holds while the folder's signature is unchanged and for at most ``TTL_S``:
the signature is the modification time of the folder and of each folder inside it, plus the
size of each file directly in it. A checkpoint or an export is renamed into place (its parent's
time changes) and the log sits at the top (its size is in the signature), so a cached size is
rarely stale, and never for long.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.kinds import JobStatus
from server.storage import Storage, StorageUnavailable
from server.tables import Dataset, Job

TTL_S = 60.0
_cache: dict[str, tuple[tuple[object, ...], int, float]] = {}
_lock = threading.Lock()


def _signature(folder: Path) -> tuple[object, ...] | None:
    """What changes when the folder's content does (see the module's docstring); None: no folder."""
    try:
        top = folder.stat().st_mtime_ns
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None
    parts: list[object] = [top]
    for entry in sorted(entries, key=lambda e: e.name):
        with contextlib.suppress(OSError):  # gone meanwhile
            st = entry.stat(follow_symlinks=False)
            parts.append((entry.name, st.st_mtime_ns if entry.is_dir(follow_symlinks=False) else st.st_size))
    return tuple(parts)


def walk_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (links not followed; files that vanish skipped)."""
    total = 0
    stack = [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                else:
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def folder_bytes(folder: Path | str) -> int:
    """The bytes under ``folder`` (0 when it does not exist), from the cache while it holds."""
    path = Path(folder)
    key = str(path)
    signature = _signature(path)
    if signature is None:
        with _lock:
            _cache.pop(key, None)
        return 0
    with _lock:
        cached = _cache.get(key)
    if cached is not None and cached[0] == signature and time.monotonic() - cached[2] < TTL_S:
        return cached[1]
    size = walk_bytes(path)
    with _lock:
        _cache[key] = (signature, size, time.monotonic())
    return size


def forget(folder: Path | str) -> None:
    with _lock:
        _cache.pop(str(Path(folder)), None)


def job_bytes(storage: Storage, key: str) -> int:
    """The bytes of a job's folder in the store: a local folder's from the cached walk
    (:func:`folder_bytes`), a remote store's from a listing (kept ``TTL_S``; while the store does
    not answer, the size last seen: a figure is not worth a 503, nor a wait)."""
    try:
        key = storage.key_of(key)
    except ValueError:  # a host path outside the store (a row from before the store)
        return folder_bytes(key) if Path(key).is_absolute() else 0
    own = storage.local_path(key)
    if own is not None:
        return folder_bytes(own)
    name = f"{storage.url}/{key}"
    with _lock:
        cached = _cache.get(name)
    if cached is not None and time.monotonic() - cached[2] < TTL_S:
        return cached[1]
    try:
        size = storage.without_retries().size(key)
    except StorageUnavailable:  # a store that does not answer: the size last seen (0: none), kept a while
        size = cached[1] if cached is not None else 0
    with _lock:
        _cache[name] = ((), size, time.monotonic())
    return size


def remove_job_folder(storage: Storage, key: str, *, job_id: str) -> None:
    """Delete a job's folder from the store: only the folder the API made for it (``runs/<id>``)."""
    try:
        key = storage.key_of(key)
    except ValueError:
        return
    if key.rsplit("/", 1)[-1] != job_id:
        return
    own = storage.local_path(key)
    if own is not None:
        remove_folder(own)
    else:
        forget(f"{storage.url}/{key}")
        storage.delete_prefix(key)


def remove_folder(folder: Path) -> None:
    """Delete ``folder`` and everything in it; files already gone are no error. A file written
    into it meanwhile (a download's archive being built) is removed by a second pass."""
    forget(folder)
    for _ in range(3):
        try:
            shutil.rmtree(folder, onerror=_gone_is_fine)
        except OSError:
            continue
        if not folder.exists():
            return
    shutil.rmtree(folder, onerror=_gone_is_fine)


def _gone_is_fine(function: object, path: str, info: tuple[type, BaseException, object]) -> None:
    if not isinstance(info[1], FileNotFoundError):  # onerror (Python 3.11): sys.exc_info()
        raise info[1]


@dataclass(frozen=True)
class PausedForSpace:
    job_id: str
    name: str
    message: str


@dataclass(frozen=True)
class DiskUse:
    jobs: int
    jobs_bytes: int
    datasets_bytes: int
    free_bytes: int
    capacity_bytes: int
    reserve_bytes: int
    low: bool
    paused_for_space: list[PausedForSpace]


def usage(session: Session, *, storage: Storage, runs_dir: Path, reserve_bytes: int = 0) -> DiskUse:
    """Every job's folder, the stored datasets, and the free space where the runs are written
    (with a remote store: on this host's disk, where its cache is); ``low`` when it is under the
    reserve a checkpoint must leave, and the jobs a worker paused because a checkpoint did not fit
    (paused with an error: the path, the bytes needed and free)."""
    folders = list(session.scalars(select(Job.output_dir)))
    stored = select(func.coalesce(func.sum(Dataset.size_bytes), 0)).where(Dataset.deleted_at.is_(None))
    datasets = session.scalar(stored) or 0
    where = runs_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    disk = shutil.disk_usage(where)
    paused = session.execute(
        select(Job.id, Job.name, Job.error)
        .where(Job.status == JobStatus.PAUSED, Job.error.is_not(None))
        .order_by(Job.created_at)
    )
    return DiskUse(
        jobs=len(folders),
        jobs_bytes=sum(job_bytes(storage, f) for f in folders),
        datasets_bytes=int(datasets),
        free_bytes=disk.free,
        capacity_bytes=disk.total,
        reserve_bytes=reserve_bytes,
        low=disk.free < reserve_bytes,
        paused_for_space=[PausedForSpace(job_id=i, name=n, message=e or "") for i, n, e in paused],
    )
