"""The image store: each image a dataset holds, stored once under the key of its content's SHA-256
(``images/<hex[:2]>/<hex>``); a stored dataset names it ``sha256:<hex>`` (the engine reads it from
the folder a job's ``data.image_store`` gives, ``<store>/<hex[:2]>/<hex>``).

A dataset folder that holds images lists them in its manifest (``<folder>/images.txt``, one hex
a line), the only record of who uses an image: an image no manifest lists is unused and goes.
Whoever stores a dataset writes its manifest *before* its images, and whoever removes images reads
every manifest first; both hold the image lock (a lock of this process, and ``flock`` on a file in
a folder every API process of the host shares), so an image another upload is about to name is
never removed under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from server.storage.base import Storage, join

FOLDER = "images"  # the store's folder of images
MANIFEST = "images.txt"  # a dataset folder's list of the images it names
PREFIX = "sha256:"
LOCK_FILE = ".images.lock"
_HEX = re.compile(r"[0-9a-f]{64}")
_lock = threading.Lock()


def image_key(digest: str) -> str:
    """The store's key of the image whose SHA-256 is ``digest`` (64 lowercase hex digits)."""
    if not _HEX.fullmatch(digest):
        raise ValueError(f"image digest {digest!r}: expected 64 lowercase hex digits")
    return f"{FOLDER}/{digest[:2]}/{digest}"


def reference(digest: str) -> str:
    """What a stored dataset names the image by: ``sha256:<hex>``."""
    image_key(digest)  # checked
    return PREFIX + digest


def digest_of(value: str) -> str | None:
    """The hex of a ``sha256:<hex>`` reference, or None when ``value`` is none."""
    if value.startswith(PREFIX) and _HEX.fullmatch(value[len(PREFIX) :]):
        return value[len(PREFIX) :]
    return None


def staged_path(folder: Path, digest: str) -> Path:
    """Where a folder laid out as the store (``<hex[:2]>/<hex>``) keeps an image."""
    return folder / digest[:2] / digest


def manifest_key(dataset_folder: str) -> str:
    return join(dataset_folder, MANIFEST)


@contextlib.contextmanager
def locked(lock_dir: Path | None) -> Iterator[None]:
    """The image lock: this process's, and ``flock`` on ``lock_dir/.images.lock`` when given (the
    API processes of one host share it; hosts that share a store but no folder are not held)."""
    with _lock:
        if lock_dir is None:
            yield
            return
        lock_dir.mkdir(parents=True, exist_ok=True)
        with (lock_dir / LOCK_FILE).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def read_manifest(storage: Storage, dataset_folder: str) -> set[str]:
    """The digests a dataset folder's manifest lists (none: no manifest)."""
    try:
        text = b"".join(storage.iter_bytes(manifest_key(dataset_folder))).decode("ascii")
    except FileNotFoundError:
        return set()
    return {line for line in text.split() if _HEX.fullmatch(line)}


def has_images(storage: Storage, dataset_folder: str) -> bool:
    return storage.exists(manifest_key(dataset_folder))


def publish(
    storage: Storage, *, dataset_folder: str, staged: Path, digests: Iterable[str], lock_dir: Path | None
) -> None:
    """Store a dataset's images from ``staged`` (laid out as the store): its manifest first, then
    each image the store does not hold yet. The caller stores the dataset file and commits its row
    next; when that fails it removes the folder and calls ``remove_unused`` with ``digests``."""
    wanted = sorted(set(digests))
    with locked(lock_dir):
        body = "".join(f"{d}\n" for d in wanted).encode("ascii")
        storage.put_stream(manifest_key(dataset_folder), io.BytesIO(body))
        for digest in wanted:
            key = image_key(digest)
            if not storage.exists(key):
                storage.put_file(key, staged_path(staged, digest))


def in_use(storage: Storage, *, datasets_folder: str) -> set[str]:
    """Every digest some manifest under ``datasets_folder`` lists."""
    used: set[str] = set()
    for key, _ in storage.list(datasets_folder):
        if key.endswith("/" + MANIFEST):
            used |= read_manifest(storage, key.removesuffix("/" + MANIFEST))
    return used


def remove_unused(
    storage: Storage, candidates: Iterable[str], *, datasets_folder: str, lock_dir: Path | None
) -> list[str]:
    """Remove each of the images ``candidates`` that no manifest lists any more (a dataset's, once
    its folder is gone). Returns the digests removed."""
    wanted = set(candidates)
    if not wanted:
        return []
    with locked(lock_dir):
        gone = sorted(wanted - in_use(storage, datasets_folder=datasets_folder))
        for digest in gone:
            storage.delete(image_key(digest))
    return gone


def sweep(storage: Storage, *, datasets_folder: str, lock_dir: Path | None) -> list[str]:
    """Remove every stored image no manifest lists (what an upload cut short after storing images
    left). Returns the digests removed."""
    with locked(lock_dir):
        used = in_use(storage, datasets_folder=datasets_folder)
        gone = []
        for key, _ in storage.list(FOLDER):
            digest = key.rsplit("/", 1)[-1]
            if _HEX.fullmatch(digest) and digest not in used:
                storage.delete(key)
                gone.append(digest)
    return gone


def local_folder(storage: Storage, digests: Iterable[str], *, cache: Path) -> Path:
    """The image store as a folder on this host: the store's own ``images`` folder where the
    store is local, else ``cache/images`` with each of ``digests`` pulled into it once (an image's
    bytes never change under its key).

    Raises:
        FileNotFoundError: one of ``digests`` is not stored.
    """
    own = storage.local_path(FOLDER)
    if own is not None:
        return own
    folder = cache / FOLDER
    for digest in sorted(set(digests)):
        target = staged_path(folder, digest)
        if not target.is_file():
            storage.get_file(image_key(digest), target)
    return folder


def folder_for(storage: Storage, dataset_keys: Iterable[str], *, cache: Path) -> Path:
    """The image store as a folder on this host for a job that reads the dataset files
    ``dataset_keys`` (``datasets/<id>/<file>``): ``local_folder`` of the images their folders'
    manifests list (a worker's ``data.image_store`` when the store is remote).

    Raises:
        FileNotFoundError: an image they name is not stored.
    """
    named: set[str] = set()
    for key in dataset_keys:
        named |= read_manifest(storage, key.rsplit("/", 1)[0])
    return local_folder(storage, named, cache=cache)
