"""Datasets in the store (``datasets/<id>/<file name>``) and in the database; validated with the
engine's validator before storing. A dataset that finished jobs name is deleted by removing its
file and marking its row (``deleted_at``): the jobs keep their record, and only they see the row.

An upload is copied into ``scratch/.incoming-<id><suffix>``, a file its process holds locked
(``flock``) until the dataset's row is committed; an archive is unpacked, and the images staged,
in ``scratch/.unpacked-<id>/``. Images are stored once each, by content (``server.storage.images``:
the dataset's folder lists those it names), and go with the last dataset that names them. What an
upload cut short by a killed process left — those files, the dataset's folder in the store, whole
or partial, that no row names, and images no dataset names — is removed by ``sweep_incoming`` when
the API starts again."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import logging
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any, BinaryIO

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from engine.data import (
    ARCHIVE_SUFFIXES,
    SUFFIXES,
    Example,
    Report,
    archive_suffix,
    ensure_chat_template,
    formats_listing,
    get_format,
    read_records,
    unpack,
    validate,
)
from server.services import dataset_images
from server.services.job_states import TERMINAL
from server.storage import Storage, StorageUnavailable, images
from server.tables import Dataset, Job, now

log = logging.getLogger("roundhouse.datasets")
CHUNK = 1 << 20
FOLDER = "datasets"  # the store's folder of datasets
INCOMING = ".incoming-"  # an upload's copy in the scratch folder: .incoming-<id><suffix>
UNPACKED = ".unpacked-"  # beside it, its archive unpacked and its images staged: .unpacked-<id>/
MAX_NAME = 120  # characters of a stored file name
# an archive may unpack to this many times the upload limit (a "zip bomb" stops there), and a
# dataset's images (fetched ones too) come to as much
UNPACKED_FACTOR = 4
MAX_REPORTED_ERRORS = 100  # invalid rows listed in an upload's report; the rest are counted


# whether an upload fetches its http(s) image URLs (the operator's allow_image_urls); the API sets
# it around an upload (``fetching_urls``), the rest never fetch
FETCH_URLS: ContextVar[bool] = ContextVar("fetch_urls", default=False)


@contextlib.contextmanager
def fetching_urls(allowed: bool) -> Iterator[None]:
    """Uploads in this context fetch their http(s) image URLs when ``allowed``."""
    token = FETCH_URLS.set(allowed)
    try:
        yield
    finally:
        FETCH_URLS.reset(token)


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the upload exceeds the limit of {limit} bytes")
        self.limit = limit


def safe_name(filename: str) -> str:
    """A file name that cannot leave its folder: the last path part, odd characters replaced."""
    base = re.split(r"[\\/]", filename or "")[-1]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".")
    if len(base) > MAX_NAME:  # shortened before its suffix, which tells the file type
        suffix = Path(base).suffix
        keep = suffix if len(suffix) <= 16 else ""  # one that long is no file type
        base = base[: MAX_NAME - len(keep)] + keep
    return base or "dataset"


def store_upload(
    session: Session,
    *,
    source: BinaryIO,
    filename: str,
    name: str | None,
    storage: Storage,
    scratch: Path,
    max_bytes: int,
    origin: dict[str, Any] | None = None,
    fetch_urls: bool | None = None,
) -> tuple[Dataset | None, Report]:
    """Copy an upload in chunks to a temporary file in ``scratch``, unpack it when it is an
    archive (``engine.data.unpack``; at most ``UNPACKED_FACTOR`` times ``max_bytes`` unpacked),
    store its images once each and rewrite their references (``dataset_images``), validate every
    row, and store it (as ``datasets/<id>/<file name>``) only if it is valid; the temporary files
    always go.

    Returns the stored dataset (None when invalid) and the validation report (its first
    ``MAX_REPORTED_ERRORS`` errors, and the count of all). ``origin``: where the file came from
    when it was not uploaded (a Hub pull), recorded as the dataset's ``source``. ``fetch_urls``:
    whether http(s) image URLs are fetched (the operator's ``allow_image_urls``); None: as
    ``fetching_urls`` says (default no).

    Raises:
        TooLarge: more than ``max_bytes`` arrived (nothing is kept).
        ValueError: an unsupported file type; an archive that breaks a limit, or holds no data
            file or several.
    """
    clean = safe_name(filename)
    archive = archive_suffix(clean)
    suffix = archive or Path(clean).suffix.lower()
    if archive is None and suffix not in SUFFIXES:
        kinds = ", ".join((*SUFFIXES, *ARCHIVE_SUFFIXES))
        raise ValueError(f"unsupported file type {suffix or '(none)'!r}; use {kinds}")
    ident = uuid.uuid4().hex
    folder = f"{FOLDER}/{ident}"
    scratch.mkdir(parents=True, exist_ok=True)
    incoming = scratch / f"{INCOMING}{ident}{suffix}"
    work = scratch / f"{UNPACKED}{ident}"
    digest, size = hashlib.sha256(), 0
    out = _held(incoming)  # locked until the row is committed or the upload given up
    try:
        try:
            while chunk := source.read(CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(max_bytes)
                digest.update(chunk)
                out.write(chunk)
            out.flush()
        except OSError as exc:  # a full scratch disk: say which (the error names no file)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename is None:
                raise OSError(exc.errno, os.strerror(exc.errno), str(incoming)) from exc
            raise
        data_file, stored_name, roots = incoming, clean, []
        if archive is not None:
            data_file, root = _unpacked(
                incoming, work / "files", name=clean, max_bytes=UNPACKED_FACTOR * max_bytes
            )
            stored_name = safe_name(data_file.name)
            roots = list(dict.fromkeys([data_file.parent, root]))  # its folder, then the root
        staged = dataset_images.Staged(work / "images", max_bytes=UNPACKED_FACTOR * max_bytes)
        fetch = FETCH_URLS.get() if fetch_urls is None else fetch_urls
        resolver = dataset_images.Resolver(staged, storage=storage, roots=roots, fetch_urls=fetch)
        rewritten = dataset_images.rewrite_file(
            data_file, target=work / stored_name, resolve=resolver, max_errors=MAX_REPORTED_ERRORS
        )
        if rewritten.errors_total:
            return None, Report(clean, None, 0, rewritten.errors, rewritten.errors_total)
        final = rewritten.path or data_file
        store = str(staged.folder) if rewritten.has_images else None  # the staged images, by hash
        report = validate(str(final), max_errors=MAX_REPORTED_ERRORS, image_store=store)
        report.path = clean
        if not report.ok:
            return None, report
        dataset = Dataset(
            id=ident,
            name=name or clean,
            filename=stored_name,
            path=f"{folder}/{stored_name}",
            format=report.format or "unknown",
            rows=report.rows,
            size_bytes=size,
            sha256=digest.hexdigest(),
            source=origin,
        )
        _store(session, dataset=dataset, file=final, storage=storage, staged=staged, lock_dir=scratch)
        return dataset, report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        incoming.unlink(missing_ok=True)  # before the lock goes: a sweep never sees it unlocked
        out.close()


def _unpacked(archive: Path, folder: Path, *, name: str, max_bytes: int) -> tuple[Path, Path]:
    """``unpack``: the archive's data file and its root, its errors naming the upload (not its
    scratch copy).

    Raises:
        ValueError: as ``unpack``; also a damaged gzip stream.
    """
    try:
        found = unpack(archive, folder, max_bytes=max_bytes)
    except ValueError as exc:
        raise ValueError(str(exc).replace(archive.name, name)) from None
    except (gzip.BadGzipFile, zlib.error) as exc:  # a damaged stream found while reading members
        raise ValueError(f"{name}: not a readable tar.gz archive ({exc})") from None
    return found.data, found.root


def _store(
    session: Session,
    *,
    dataset: Dataset,
    file: Path,
    storage: Storage,
    staged: dataset_images.Staged,
    lock_dir: Path,
) -> None:
    """Store a valid dataset: its images (manifest first), its file, then its row. What fails
    midway is taken back: the folder, and the images no other dataset names."""
    folder = f"{FOLDER}/{dataset.id}"
    try:
        if staged.digests:
            images.publish(
                storage,
                dataset_folder=folder,
                staged=staged.folder,
                digests=staged.digests,
                lock_dir=lock_dir,
            )
        storage.put_file(dataset.path, file)
        session.add(dataset)
        session.commit()
    except BaseException:
        with contextlib.suppress(Exception):  # the first failure is the one to tell
            session.rollback()
        with contextlib.suppress(Exception):
            storage.delete_prefix(folder)
            images.remove_unused(storage, staged.digests, datasets_folder=FOLDER, lock_dir=lock_dir)
        raise


def _held(path: Path) -> IO[bytes]:
    """``path`` created for writing and locked (``flock``) for as long as it is open."""
    while True:
        out = path.open("wb")
        fcntl.flock(out, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(out.fileno()).st_ino:
                return out
        out.close()  # a sweep removed it between its creation and the lock: make it again


def sweep_incoming(session: Session, *, storage: Storage, scratch: Path) -> list[str]:
    """Remove what uploads cut short left (their process was killed: a crash, a power cut): each
    ``.incoming-<id>`` file in ``scratch`` that no live process holds locked, and, when no row
    names dataset ``<id>``, its folder in the store (a file stored in part or whole whose row was
    never committed). For the API's start. Returns the ids swept; a store that does not answer
    leaves its folder and file for the next start.
    """
    swept: list[str] = []
    for path in sorted(scratch.glob(f"{INCOMING}*")) if scratch.is_dir() else []:
        try:
            held = path.open("rb")
        except FileNotFoundError:  # its upload ended meanwhile
            continue
        with held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an upload in progress (this process's or another's)
                continue
            ident = path.name.removeprefix(INCOMING).split(".", 1)[0]
            if re.fullmatch(r"[0-9a-f]{32}", ident) and session.get(Dataset, ident) is None:
                try:
                    storage.delete_prefix(f"{FOLDER}/{ident}")
                except StorageUnavailable:
                    log.warning("the store did not answer: %s/%s is swept at the next start", FOLDER, ident)
                    continue
            path.unlink(missing_ok=True)
            swept.append(ident)
    for work in sorted(scratch.glob(f"{UNPACKED}*")) if scratch.is_dir() else []:
        ident = work.name.removeprefix(UNPACKED)
        if not any(scratch.glob(f"{INCOMING}{ident}*")):  # its upload is over (or was swept above)
            shutil.rmtree(work, ignore_errors=True)
    try:
        gone = images.sweep(storage, datasets_folder=FOLDER, lock_dir=scratch)
    except StorageUnavailable:
        log.warning("the store did not answer: images no dataset names are swept at the next start")
        gone = []
    if gone:
        log.warning("removed %d image(s) no dataset names", len(gone))
    if swept:
        log.warning("removed what %d upload(s) cut short left: %s", len(swept), ", ".join(swept))
    return swept


def list_datasets(session: Session) -> list[Dataset]:
    q = select(Dataset).where(Dataset.deleted_at.is_(None)).order_by(Dataset.created_at.desc())
    return list(session.scalars(q))


def get_dataset(session: Session, *, dataset_id: str) -> Dataset | None:
    """The dataset, or None (also when it was deleted and only its finished jobs' record keeps it)."""
    found = session.get(Dataset, dataset_id)
    return None if found is None or found.deleted_at is not None else found


def _users(dataset_id: str) -> Any:
    return select(Job.id).where((Job.dataset_id == dataset_id) | (Job.validation_dataset_id == dataset_id))


def in_use(session: Session, *, dataset_id: str) -> str | None:
    """The id of a job that may still read the dataset (one not succeeded, failed or cancelled), or
    None: a finished job's record does not hold its files."""
    return session.scalar(_users(dataset_id).where(Job.status.not_in(TERMINAL)).limit(1))


def delete_dataset(
    session: Session, *, dataset: Dataset, storage: Storage, lock_dir: Path | None = None
) -> None:
    """Delete the row (or, while finished jobs name it, mark it deleted), then its folder in the
    store (``datasets/<id>``), then the images it named that no other dataset names. ``lock_dir``:
    the uploads' scratch folder, whose image lock keeps an upload on this host from naming an
    image as it goes."""
    folder = f"{FOLDER}/{dataset.id}"
    named = images.read_manifest(storage, folder)
    if session.scalar(_users(dataset.id).limit(1)) is None:
        session.delete(dataset)
    else:
        dataset.deleted_at = now()
    session.commit()
    storage.delete_prefix(folder)
    images.remove_unused(storage, named, datasets_folder=FOLDER, lock_dir=lock_dir)


def image_store(storage: Storage, *datasets: Dataset | None) -> str | None:
    """What a job's ``data.image_store`` is when it trains on ``datasets``: the store's image
    folder (its path where the store is this host's folder, else its key, which a worker pulls the
    dataset's images from: ``local_images``), or None when none of them names an image."""
    if not any(d is not None and images.has_images(storage, f"{FOLDER}/{d.id}") for d in datasets):
        return None
    own = storage.local_path(images.FOLDER)
    return str(own) if own is not None else images.FOLDER


def local_images(storage: Storage, dataset: Dataset, *, cache: Path) -> Path | None:
    """The image store as a folder on this host with the images ``dataset`` names (the store's own
    folder, or those images pulled into ``cache/images``); None when it names none.

    Raises:
        FileNotFoundError: an image it names is not stored.
    """
    named = images.read_manifest(storage, f"{FOLDER}/{dataset.id}")
    return images.local_folder(storage, named, cache=cache) if named else None


def forget_deleted(session: Session) -> None:
    """Delete the rows of deleted datasets no job names any more (the caller commits)."""
    named = select(Job.dataset_id).union(
        select(Job.validation_dataset_id).where(Job.validation_dataset_id.is_not(None))
    )
    session.execute(delete(Dataset).where(Dataset.deleted_at.is_not(None), Dataset.id.not_in(named)))


def missing_files(session: Session, *, job: Job) -> list[tuple[str, Dataset]]:
    """The job's datasets that were deleted, each with its field (``dataset_id``,
    ``validation_dataset_id``): a run of it cannot read them."""
    out = []
    for field, ident in (
        ("dataset_id", job.dataset_id),
        ("validation_dataset_id", job.validation_dataset_id),
    ):
        found = session.get(Dataset, ident) if ident else None
        if found is not None and found.deleted_at is not None:
            out.append((field, found))
    return out


def local_file(storage: Storage, dataset: Dataset, *, cache: Path) -> Path:
    """The dataset's file on this host: the store's own file (a local store), or a copy pulled
    once into ``cache/<key>`` (an upload's bytes never change under its key).

    Raises:
        FileNotFoundError: it is not in the store.
    """
    try:
        key = storage.key_of(dataset.path)
    except ValueError as exc:  # a host path outside the store (a row the migration left)
        raise FileNotFoundError(str(exc)) from exc
    try:
        return storage.local_copy(key, cache)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"dataset {dataset.id} is not in the store") from exc


def formats() -> list[dict[str, Any]]:
    """Every data format a dataset can be, in registry order (``engine.data.formats``)."""
    return formats_listing()


def first_examples(
    dataset: Dataset, limit: int, *, file: Path, images_dir: Path | None = None
) -> Iterator[Example]:
    """The first ``limit`` rows of a stored (valid) dataset from its ``file`` (``local_file``),
    read no further than needed; their images read from ``images_dir`` (``local_images``).

    Raises:
        ValueError: a row that changed on disk; an image that is not in ``images_dir``.
    """
    fmt = get_format(dataset.format)
    for count, (line, record) in enumerate(read_records(str(file))):
        if count >= limit:
            return
        if not isinstance(record, dict):
            raise ValueError(f"dataset {dataset.id} changed on disk: {record}")
        example = fmt.example(line, record)
        yield dataset_images.with_images(example, images_dir) if example.images else example


@contextlib.contextmanager
def _at_line(line: int) -> Iterator[None]:
    """A row's ``ValueError`` naming its line."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("line ") else f"line {line}: {message}") from exc


def _text_tokenizer(tokenizer: Any) -> Any:
    """A processor's tokenizer (a vision-language model's), or the tokenizer itself."""
    return tokenizer.tokenizer if getattr(tokenizer, "image_processor", None) is not None else tokenizer


def preview(
    dataset: Dataset,
    *,
    file: Path,
    tokenizer: Any,
    limit: int,
    max_length: int,
    images_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The first rows rendered through the tokenizer's chat template (a vision-language model's
    processor for rows with images), each token marked trained or not, as the dataset's format
    shows them (``DataFormat.preview``): a preference row as its prompt and both answers; a prompt
    row as its prompt (with the generation prompt of a chat prompt; nothing trained: GRPO samples
    the completions) and its other fields (``item``, what a grader reads); a row with images also
    its ``images``, a thumbnail (a data URL) of each, in order, read from ``images_dir``
    (``local_images``).

    Raises:
        ValueError: rows with images and a tokenizer that is no vision-language model's processor.
    """
    fmt = get_format(dataset.format)
    ensure_chat_template(_text_tokenizer(tokenizer))
    rows = []
    for example in first_examples(dataset, limit, file=file, images_dir=images_dir):
        with _at_line(example.line):
            rows.append(fmt.preview(example, tokenizer, max_length))
    return rows


def token_stats(
    dataset: Dataset,
    *,
    file: Path,
    tokenizer: Any,
    max_length: int,
    limit: int,
    bins: int = 20,
    images_dir: Path | None = None,
) -> dict[str, Any]:
    """Token lengths of the first ``limit`` rows as a histogram, with the share cut at ``max_length``
    (every sequence of a row counts: both of a preference row; a prompt row's prompt alone; a
    row's image tokens with its text, by a vision-language model's processor).

    Raises:
        ValueError: rows with images and a tokenizer that is no vision-language model's processor.
    """
    fmt = get_format(dataset.format)
    ensure_chat_template(_text_tokenizer(tokenizer))
    lengths, truncated, sampled = [], 0, 0
    for ex in first_examples(dataset, limit, file=file, images_dir=images_dir):
        sampled += 1
        with _at_line(ex.line):
            encoded = fmt.encode(ex, tokenizer, max_length)
        for _, enc in fmt.sequences(encoded):
            lengths.append(enc.length)
            truncated += enc.truncated
    top = max(lengths, default=0)
    width = max(1, -(-top // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(n // width, bins - 1)] += 1
    return {
        "rows": dataset.rows,
        "sampled": sampled,
        "max_length": max_length,
        "truncated_share": truncated / len(lengths) if lengths else 0.0,
        "mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "max": top,
        "histogram": [{"lo": i * width, "hi": (i + 1) * width, "count": c} for i, c in enumerate(counts)],
    }
