"""``LocalStorage``: a folder (ROUNDHOUSE_HOME); a key is a path relative to it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from server.storage.base import Storage, check_key

CHUNK = 1 << 20


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def path(self, key: str, *, prefix: bool = False) -> Path:
        """The file or folder of ``key`` (valid keys cannot leave the root)."""
        check_key(key, prefix=prefix)
        return self.root.joinpath(*PurePosixPath(key).parts)

    def key_of(self, value: str) -> str:
        if not Path(value).is_absolute():
            return check_key(value)
        try:
            found = Path(value).resolve().relative_to(self.root)
        except ValueError:
            raise ValueError(f"{value!r} is not in the store {self.url}") from None
        return check_key(found.as_posix())

    def put_file(self, key: str, path: Path) -> None:
        with path.open("rb") as source:
            self.put_stream(key, source)

    def put_stream(self, key: str, stream: BinaryIO) -> int:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := stream.read(CHUNK):
                    size += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())  # on disk before a row can name it (a power cut)
            os.chmod(name, 0o644)
            os.replace(name, target)
            _fsync_dir(target.parent)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename is None:
                raise OSError(exc.errno, os.strerror(exc.errno), str(target)) from exc
            raise
        finally:
            Path(name).unlink(missing_ok=True)
        return size

    def get_file(self, key: str, path: Path) -> None:
        source = self.path(key)
        if not source.is_file():
            raise FileNotFoundError(f"no object {key!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out, source.open("rb") as f:
                shutil.copyfileobj(f, out, CHUNK)
            os.chmod(name, 0o644)
            os.replace(name, path)
        finally:
            Path(name).unlink(missing_ok=True)

    def iter_bytes(self, key: str, *, chunk: int = CHUNK) -> Iterator[bytes]:
        source = self.path(key)
        with source.open("rb") as f:
            while data := f.read(chunk):
                yield data

    def stream(self, key: str, *, chunk: int = CHUNK) -> tuple[int, Iterator[bytes]]:
        f = self.path(key).open("rb")
        size = os.fstat(f.fileno()).st_size

        def chunks() -> Iterator[bytes]:
            with f:
                left = size
                while left > 0:
                    data = f.read(min(chunk, left))
                    if not data:
                        raise OSError(f"{key!r} ended {left} bytes short of its {size} bytes")
                    left -= len(data)
                    yield data

        return size, chunks()

    def exists(self, key: str) -> bool:
        found = self.path(key)
        return found.is_file() or (found.is_dir() and any(True for _ in self._files(found)))

    def _files(self, folder: Path) -> Iterator[Path]:
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                yield path

    def list(self, prefix: str) -> list[tuple[str, int]]:
        folder = self.path(prefix, prefix=True)
        if not folder.is_dir():
            return []
        found = []
        for path in self._files(folder):
            with contextlib.suppress(OSError):  # gone meanwhile
                found.append((path.relative_to(self.root).as_posix(), path.stat().st_size))
        return sorted(found)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        folder = self.path(prefix)  # not "": the whole root is never removed this way
        for _ in range(3):  # a file written into it meanwhile is removed by another pass
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                return
        shutil.rmtree(folder)

    def presigned_url(self, key: str, *, expires_s: int = 3600, filename: str | None = None) -> str | None:
        check_key(key)
        return None

    def local_path(self, key: str) -> Path | None:
        return self.path(key)
