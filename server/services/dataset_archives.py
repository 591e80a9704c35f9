"""A dataset uploaded as an archive (zip, tar, tar.gz): one data file (JSONL, CSV or Parquet) and
the image files its rows name, unpacked into a scratch folder under limits — each member's size,
their count and their total size counted as the bytes come out (an archive's headers may lie: a
"zip bomb" stops at the limit) — and a member's name must stay inside the folder (no absolute
path, no ``..``; no links or devices). macOS's ``__MACOSX`` folder and dot files are left out."""

from __future__ import annotations

import gzip
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO

from engine.data import SUFFIXES

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
MAX_MEMBERS = 100_000
CHUNK = 1 << 20
IGNORED = "__MACOSX"

# a member: its name in the archive, its path in the folder, and how to open its bytes
Member = tuple[str, PurePosixPath, Callable[[], IO[bytes]]]


def archive_suffix(filename: str) -> str | None:
    """The archive type a file name announces (``.zip``, ``.tar``, ``.tar.gz``, ``.tgz``), or None."""
    lower = filename.lower()
    return next((s for s in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True) if lower.endswith(s)), None)


def member_path(name: str) -> PurePosixPath | None:
    """The relative path a member's name stands for; None for one left out.

    Raises:
        ValueError: a name that would leave the folder, naming the member.
    """
    path = PurePosixPath(name.replace("\\", "/"))
    if "\x00" in name:
        raise ValueError(f"archive member {name!r}: a NUL byte in its name")
    if path.is_absolute() or (path.parts and ":" in path.parts[0]):
        raise ValueError(f"archive member {name!r}: an absolute name (give names relative to the root)")
    if ".." in path.parts:
        raise ValueError(f"archive member {name!r}: '..' in its name")
    parts = [p for p in path.parts if p not in ("", ".")]
    if not parts or parts[0] == IGNORED or parts[-1].startswith("."):
        return None
    return PurePosixPath(*parts)


def unpack(archive: Path, *, name: str, folder: Path, member_bytes: int, total_bytes: int) -> Path:
    """Unpack ``archive`` (uploaded as ``name``, which tells its type) into ``folder`` and return
    its one data file. A member may hold ``member_bytes``, all of them ``total_bytes``, at most
    ``MAX_MEMBERS`` of them.

    Raises:
        ValueError: an unreadable archive; a member that breaks a limit, would leave ``folder`` or
            is not a plain file (naming it); no data file or more than one.
    """
    suffix = archive_suffix(name)
    if suffix is None:
        raise ValueError(f"{name}: not an archive ({', '.join(ARCHIVE_SUFFIXES)})")
    kind = "zip" if suffix == ".zip" else "tar"
    folder.mkdir(parents=True, exist_ok=True)
    total = members = 0
    try:
        for member, rel, opened in _zip(archive) if kind == "zip" else _tar(archive):
            members += 1
            if members > MAX_MEMBERS:
                raise ValueError(f"{name}: the archive holds more than {MAX_MEMBERS} files")
            target = folder.joinpath(*rel.parts)
            if target.exists():
                raise ValueError(f"archive member {member!r}: given twice")
            target.parent.mkdir(parents=True, exist_ok=True)
            size = 0
            with opened() as source, target.open("wb") as out:
                while chunk := source.read(CHUNK):
                    size, total = size + len(chunk), total + len(chunk)
                    if size > member_bytes:
                        raise ValueError(
                            f"archive member {member!r}: more than the limit of {member_bytes} bytes"
                        )
                    if total > total_bytes:
                        raise ValueError(f"{name}: the archive unpacks to more than {total_bytes} bytes")
                    out.write(chunk)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{name}: not a readable {kind} archive ({exc})") from None
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not found:
        raise ValueError(f"{name}: the archive holds no data file ({', '.join(SUFFIXES)})")
    if len(found) > 1:
        names = ", ".join(p.relative_to(folder).as_posix() for p in found[:5])
        raise ValueError(f"{name}: the archive holds {len(found)} data files ({names}); give one")
    return found[0]


def _zip(archive: Path) -> Iterator[Member]:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            rel = member_path(info.filename)
            if rel is None or info.is_dir():
                continue
            mode = info.external_attr >> 16
            # a type of file that is not a plain one (the type bits unset: a plain file, as
            # Python's zipfile and Windows tools write them)
            if stat.S_IFMT(mode) and not stat.S_ISREG(mode):
                raise ValueError(f"archive member {info.filename!r}: not a plain file (a link?)")
            if info.flag_bits & 0x1:
                raise ValueError(f"archive member {info.filename!r}: encrypted")
            yield info.filename, rel, partial(zf.open, info)


def _tar(archive: Path) -> Iterator[Member]:
    with tarfile.open(archive, "r:*") as tf:
        for info in tf:
            rel = member_path(info.name)
            if rel is None or info.isdir():
                continue
            if not info.isfile():
                raise ValueError(f"archive member {info.name!r}: not a plain file (a link or a device?)")
            yield info.name, rel, partial(_extracted, tf, info)


def _extracted(tf: tarfile.TarFile, info: tarfile.TarInfo) -> IO[bytes]:
    source = tf.extractfile(info)
    if source is None:  # not a regular file: refused above
        raise ValueError(f"archive member {info.name!r}: not a plain file")
    return source
