"""A dataset packed as an archive (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``): one data file (JSONL,
CSV or Parquet) and the image files its rows name, relative to the data file's folder or to the
archive's root.

``unpack`` writes the members into a folder under limits counted as the bytes come out (an
archive's headers may lie), and refuses a member whose name would leave the folder (absolute,
``..``), links and devices. ``unpacked`` does it into a temporary folder for as long as a reader
needs it. macOS's ``__MACOSX`` folder and dot files are left out.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
DATA_SUFFIXES = (".jsonl", ".csv", ".parquet")  # the data files an archive may hold
MAX_MEMBERS = 100_000
MAX_UNPACKED = 64 * 1024**3  # bytes an archive may unpack to, all members together
CHUNK = 1 << 20


def archive_suffix(name: str | Path) -> str | None:
    """The archive type a file name ends with (``.zip``, ``.tar``, ``.tar.gz``, ``.tgz``), or None."""
    lower = str(name).lower()
    return next((s for s in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True) if lower.endswith(s)), None)


@dataclass(frozen=True)
class Unpacked:
    """An unpacked archive: its one data file and the folder it was unpacked into (its root)."""

    data: Path
    root: Path


def member_path(name: str) -> PurePosixPath | None:
    """The relative path a member's name stands for; None for one left out (``__MACOSX``, dot files).

    Raises:
        ValueError: an absolute name, a drive, ``..`` or a NUL byte, naming the member.
    """
    path = PurePosixPath(name.replace("\\", "/"))
    if "\x00" in name:
        raise ValueError(f"archive member {name!r}: a NUL byte in its name")
    if path.is_absolute() or (path.parts and ":" in path.parts[0]):
        raise ValueError(f"archive member {name!r}: an absolute name (give names relative to the root)")
    if ".." in path.parts:
        raise ValueError(f"archive member {name!r}: '..' in its name")
    parts = [p for p in path.parts if p not in ("", ".")]
    if not parts or parts[0] == "__MACOSX" or parts[-1].startswith("."):
        return None
    return PurePosixPath(*parts)


# a member: its name, where it goes, and how to open its bytes
_Member = tuple[str, PurePosixPath, Callable[[], IO[bytes]]]


def _zip_members(archive: Path) -> Iterator[_Member]:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            rel = member_path(info.filename)
            if rel is None or info.is_dir():
                continue
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no type recorded (a plain file)
            if kind and kind != stat.S_IFREG:
                raise ValueError(f"archive member {info.filename!r}: not a plain file (a link?)")
            if info.flag_bits & 0x1:
                raise ValueError(f"archive member {info.filename!r}: encrypted")
            yield info.filename, rel, lambda info=info: zf.open(info)  # type: ignore[misc]


def _tar_members(archive: Path) -> Iterator[_Member]:
    with tarfile.open(archive, "r:*") as tf:
        for info in tf:
            rel = member_path(info.name)
            if rel is None or info.isdir():
                continue
            if not info.isfile():
                raise ValueError(f"archive member {info.name!r}: not a plain file (a link or a device?)")
            source = tf.extractfile(info)
            if source is None:
                raise ValueError(f"archive member {info.name!r}: not a plain file")
            yield info.name, rel, lambda source=source: source  # type: ignore[misc]


def unpack(archive: str | Path, folder: str | Path, *, max_bytes: int = MAX_UNPACKED) -> Unpacked:
    """Write an archive's members into ``folder`` (new or empty; at most ``MAX_MEMBERS``,
    ``max_bytes`` in all) and find its data file.

    Raises:
        ValueError: not an archive type, an unreadable archive, a member that breaks a limit or
            would leave the folder (naming it), no data file or more than one, a folder not empty.
    """
    archive, folder = Path(archive), Path(folder)
    suffix = archive_suffix(archive)
    if suffix is None:
        raise ValueError(f"{archive.name}: not an archive ({', '.join(ARCHIVE_SUFFIXES)})")
    kind = "zip" if suffix == ".zip" else "tar"
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"unpack {archive.name}: the folder to unpack into is not empty")
    total = members = 0
    try:
        for name, rel, opened in _zip_members(archive) if kind == "zip" else _tar_members(archive):
            members += 1
            if members > MAX_MEMBERS:
                raise ValueError(f"the archive holds more than {MAX_MEMBERS} files")
            target = folder.joinpath(*rel.parts)
            if target.exists():
                raise ValueError(f"archive member {name!r}: given twice")
            target.parent.mkdir(parents=True, exist_ok=True)
            with opened() as source, target.open("wb") as out:
                while chunk := source.read(CHUNK):
                    total += len(chunk)
                    if total > max_bytes:
                        raise ValueError(f"the archive unpacks to more than {max_bytes} bytes")
                    out.write(chunk)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise ValueError(f"{archive.name}: not a readable {kind} archive ({exc})") from None
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    if not found:
        raise ValueError(f"{archive.name}: the archive holds no data file ({', '.join(DATA_SUFFIXES)})")
    if len(found) > 1:
        names = ", ".join(p.relative_to(folder).as_posix() for p in found[:5])
        raise ValueError(f"{archive.name}: the archive holds {len(found)} data files ({names}); give one")
    return Unpacked(found[0], folder)


@contextmanager
def unpacked(archive: str | Path, *, scratch: str | Path | None = None) -> Iterator[Unpacked]:
    """``unpack`` into a temporary folder (under ``scratch`` when given), removed on leaving.

    Raises:
        ValueError: as ``unpack``.
    """
    folder = Path(tempfile.mkdtemp(prefix="dataset-", dir=scratch))
    try:
        yield unpack(archive, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
