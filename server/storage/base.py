"""The storage seam: every dataset, checkpoint, export and log is read and written through a
``Storage`` under a key (a relative path with ``/`` separators), never a host path.

Two backends: a local folder (``LocalStorage``: the keys are paths under ROUNDHOUSE_HOME, today's
layout) and an S3-compatible object store (``S3Storage``). A "folder" is a key prefix: the
objects under ``prefix/``.

A remote store that does not answer (stopped, unreachable, failing with 5xx) is tried again with
exponential backoff for a bounded time (``retrying``); past it the operation raises
``StorageUnavailable``, which the API answers with a 503 and a worker's checkpoint push waits out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO, TypeVar

T = TypeVar("T")
log = logging.getLogger("roundhouse.storage")


class StorageUnavailable(Exception):
    """The store did not answer an operation (a stopped or unreachable object store, or one failing
    with 5xx), still so after its retries: nothing is known to have been stored or read whole, and
    the operation may be tried again later. Not an ``OSError``: no caller takes it for a missing
    or unreadable file."""


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, StorageUnavailable)


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    budget_s: float,
    transient: Callable[[BaseException], bool] = _is_unavailable,
    first_s: float = 0.25,
    most_s: float = 8.0,
    on_retry: Callable[[str, float], None] | None = None,
) -> T:
    """``call()``, called again after each transient failure (``transient(exc)``; default: a
    ``StorageUnavailable``) with exponential backoff — ``first_s``, doubling up to ``most_s``, each
    wait drawn between half and all of it — until ``budget_s`` seconds have passed since the first
    call. ``on_retry(message, wait_s)`` hears of each retry before its wait (the log always does).

    Raises:
        StorageUnavailable: still failing when the time is up (``budget_s`` 0: at the first
            transient failure), naming ``what``, the tries and the last failure.
        Exception: a failure that is not transient, as it is, at once.
    """
    started = time.monotonic()
    backoff, tries = first_s, 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as exc:
            if not transient(exc):
                raise
            left = budget_s - (time.monotonic() - started)
            wait = min(backoff * random.uniform(0.5, 1.0), left)
            if wait <= 0:
                spent = time.monotonic() - started
                reason = str(exc).split("\n", 1)[0][:300]
                raise StorageUnavailable(
                    f"{what}: the store did not answer ({tries} tries in {spent:.0f} s): {reason}"
                ) from exc
            message = f"{what}: the store did not answer ({exc}); try {tries + 1} in {wait:.1f} s"
            log.warning("%s", message)
            if on_retry is not None:
                on_retry(message, wait)
            time.sleep(wait)
            backoff = min(backoff * 2, most_s)


def check_key(key: str, *, prefix: bool = False) -> str:
    """``key`` if it is a valid storage key: relative, ``/``-separated, no ``.``/``..`` parts, no
    empty parts, no NUL. A prefix may be ``""`` (everything).

    Raises:
        ValueError: naming the key and what is wrong with it.
    """
    if prefix and key == "":
        return key
    if not isinstance(key, str) or key == "":
        raise ValueError(f"storage key {key!r}: empty")
    if "\x00" in key or "\\" in key:
        raise ValueError(f"storage key {key!r}: a NUL or backslash is not allowed")
    if key.startswith("/"):
        raise ValueError(f"storage key {key!r}: must be relative (no leading '/')")
    parts = key.removesuffix("/").split("/") if prefix else key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"storage key {key!r}: empty, '.' or '..' parts are not allowed")
    return key


def join(*parts: str) -> str:
    """Keys joined with ``/`` (empty parts skipped)."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def relative(key: str, prefix: str) -> str:
    """``key`` relative to ``prefix`` (a folder of it)."""
    return key[len(prefix) :].lstrip("/") if prefix else key


class Storage(ABC):
    """Where datasets, runs (checkpoints, logs, exports) and models live; see the module docstring."""

    url: str

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Store the file at ``path`` as ``key`` (replacing it)."""

    @abstractmethod
    def put_stream(self, key: str, stream: BinaryIO) -> int:
        """Store what ``stream`` reads as ``key``; the bytes written."""

    def put_tree(self, prefix: str, folder: Path) -> None:
        """Store every file under ``folder`` as ``prefix/<its relative path>``."""
        check_key(prefix, prefix=True)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            self.put_file(join(prefix, path.relative_to(folder).as_posix()), path)

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Write object ``key`` to ``path``, atomically (a temporary file beside it, renamed).

        Raises:
            FileNotFoundError: no such key.
        """

    def get_tree(self, prefix: str, folder: Path) -> None:
        """Every object under ``prefix`` as ``folder/<relative key>``: written into a temporary
        folder beside ``folder`` and renamed into place (replacing it), so ``folder`` is complete
        or absent."""
        check_key(prefix, prefix=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
        try:
            for key, _ in self.list(prefix):
                self.get_file(key, work / relative(key, prefix))
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(work, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @abstractmethod
    def iter_bytes(self, key: str, *, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The bytes of ``key`` in chunks. Raises ``FileNotFoundError`` (at the first ``next``)."""

    @abstractmethod
    def stream(self, key: str, *, chunk: int = 1 << 20) -> tuple[int, Iterator[bytes]]:
        """Object ``key`` opened now: its size and its bytes in chunks. What keeps it from being
        read at all is raised here, before a byte is read; the iterator ends only after exactly
        the size's bytes, else raises (``StorageUnavailable`` when the store broke off).

        Raises:
            FileNotFoundError: no such key.
            StorageUnavailable: the store did not answer.
        """

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object, or a folder with an object under it."""

    @abstractmethod
    def list(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under the folder ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object (none there is no error)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under the folder ``prefix`` (none there is no error)."""

    @abstractmethod
    def presigned_url(self, key: str, *, expires_s: int = 3600, filename: str | None = None) -> str | None:
        """A URL a browser can GET ``key`` from for ``expires_s`` (with ``filename`` as its
        attachment name); None where the store has none (a local folder)."""

    @abstractmethod
    def local_path(self, key: str) -> Path | None:
        """The store's own file or folder of ``key`` (no copy), or None when it is not local."""

    def local_copy(
        self, key: str, cache: Path, *, folder: bool = False, leave_out: Collection[str] = ()
    ) -> Path:
        """``key`` on this host: the store's own file (or folder) where the store is local, else a
        copy in ``cache/<key>``, pulled once (atomically: complete or absent). An object's bytes
        never change under its key, so a copy once made is used as it is.

        Args:
            folder: ``key`` is a folder (the objects under it), not one object.
            leave_out: top-level names under a folder that are not pulled (a checkpoint's resume
                state).

        Raises:
            FileNotFoundError: nothing is stored under ``key``.
        """
        check_key(key)
        own = self.local_path(key)
        if own is not None:
            if not (own.is_dir() if folder else own.is_file()):
                raise FileNotFoundError(f"nothing is stored under {key!r}")
            return own
        target = cache.joinpath(*PurePosixPath(key).parts)
        if target.is_dir() if folder else target.is_file():
            return target
        if not folder:
            self.get_file(key, target)
            return target
        objects = [(k, relative(k, key)) for k, _ in self.list(key)]
        if not objects:
            raise FileNotFoundError(f"nothing is stored under {key!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            for object_key, rel in objects:
                if rel.split("/", 1)[0] not in leave_out:
                    self.get_file(object_key, work.joinpath(*PurePosixPath(rel).parts))
            with contextlib.suppress(OSError):  # pulled by another thread meanwhile: keep that one
                os.rename(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target

    def materialize(self, prefix: str, cache: Path) -> Path:
        """A local folder with the files under ``prefix`` (``local_copy`` of the folder).

        Raises:
            FileNotFoundError: nothing is stored under ``prefix``.
        """
        return self.local_copy(prefix, cache, folder=True)

    def without_retries(self) -> Storage:
        """This store with each operation tried once: ``StorageUnavailable`` at the first failure
        to answer, for what may be left out rather than waited for (a figure on a page)."""
        return self

    def key_of(self, value: str) -> str:
        """The key a row's value names: a key as it is (checked); a local store also takes an
        absolute path under its folder (what rows held before keys, and older workers write).

        Raises:
            ValueError: not a key, nor a path in this store.
        """
        return check_key(value)

    def size(self, prefix: str) -> int:
        """The bytes of every object under the folder ``prefix``."""
        return sum(size for _, size in self.list(prefix))
