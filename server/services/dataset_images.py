"""The images an uploaded dataset names, each stored once: every image reference of its rows is
resolved to the image's bytes, staged under the SHA-256 of its content and rewritten to
``sha256:<hex>`` (``server.storage.images``).

Where a row names images (as ``engine.data`` reads them): an ``image_url`` part of a chat
message's content list (OpenAI's vision fine-tuning rows: ``{"type": "image_url", "image_url":
{"url": ...}}``) or an ``{"type": "image", "image": ...}`` part, and an ``images`` column (the
ShareGPT/LLaVA layout: a list; LLaVA's ``image``: one), as Hugging Face datasets write it too
(``{"bytes", "path"}`` structs). A reference is:

- image bytes (a Parquet binary cell, a struct's ``bytes``);
- a ``data:image/...;base64,...`` URL;
- a file name relative to the upload's archive (its data file's folder, else the archive's root);
  a name that leaves the archive (``..``, absolute) is refused;
- ``sha256:<hex>`` of an image the store holds already;
- an ``http(s)://`` URL, fetched now when the operator allows it (``ROUNDHOUSE_ALLOW_IMAGE_URLS``),
  else refused naming the line.

A dataset file with no image reference is stored as it came; one with images is written again in
its own format (JSONL, CSV, Parquet), each reference rewritten.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from engine.data import Example, RowError, decode_data_url, read_records
from server.storage import Storage
from server.storage import images as store_images

FETCH_TIMEOUT_S = 30.0
URL_SETTING = "ROUNDHOUSE_ALLOW_IMAGE_URLS"
MESSAGE_LISTS = ("messages", "conversations")
IMAGE_COLUMNS = ("images", "image")
PART_KEYS = ("image", "url", "path")  # where an {"type": "image"} part may give its image

Resolve = Callable[[Any, str], str]


def max_image_bytes() -> int:
    """The largest image file the engine opens (``engine.vision.MAX_IMAGE_BYTES``), read when first
    needed: its module loads torch, which the API does not at its start."""
    from engine.vision import MAX_IMAGE_BYTES

    return MAX_IMAGE_BYTES


@dataclass
class Staged:
    """The images of one upload, staged in ``folder`` (laid out as the store) before they are
    stored; ``digests``: those its rows name; ``max_bytes``: what they may come to, each image
    counted once (None: no limit)."""

    folder: Path
    max_bytes: int | None = None
    digests: set[str] = field(default_factory=set)
    total: int = 0

    def add(self, data: bytes) -> str:
        """Stage ``data`` (once per content); its ``sha256:<hex>`` reference."""
        if len(data) > (most := max_image_bytes()):
            raise ValueError(f"the image has {len(data)} bytes, more than the limit of {most}")
        if not data:
            raise ValueError("the image is empty (0 bytes)")
        digest = hashlib.sha256(data).hexdigest()
        target = store_images.staged_path(self.folder, digest)
        if not target.is_file():
            self.charge(len(data))
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(name, target)
        self.digests.add(digest)
        return store_images.reference(digest)

    def charge(self, size: int) -> None:
        """Count ``size`` more bytes of images.

        Raises:
            ValueError: past ``max_bytes``.
        """
        self.total += size
        if self.max_bytes is not None and self.total > self.max_bytes:
            raise ValueError(f"the dataset's images come to more than {self.max_bytes} bytes")


def rewrite(record: dict[str, Any], resolve: Resolve) -> bool:
    """Rewrite, in place, every image reference of ``record`` to what ``resolve(value, field)``
    returns (``field``: where it is, e.g. ``messages[1].content[0].image_url.url``). Returns
    whether the record names any image. ``resolve`` raises ``ValueError`` for a bad reference."""
    found = False
    for key in MESSAGE_LISTS:
        messages = record.get(key)
        if not isinstance(messages, list):
            continue
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"{key}[{i}].content[{j}]"
                if kind == "image_url":
                    found, inner = True, part.get("image_url")
                    if isinstance(inner, dict):
                        inner["url"] = resolve(inner.get("url"), where + ".image_url.url")
                    else:
                        part["image_url"] = resolve(inner, where + ".image_url")
                elif kind == "image":  # its image under one of these, or none (the images column's)
                    found = True
                    named = next((k for k in PART_KEYS if part.get(k) is not None), None)
                    if named is not None:
                        part[named] = resolve(part[named], f"{where}.{named}")
    for key in IMAGE_COLUMNS:
        value = record.get(key)
        if value is None:
            continue
        found = True
        if isinstance(value, list):
            record[key] = [resolve(item, f"{key}[{k}]") for k, item in enumerate(value)]
        else:
            record[key] = resolve(value, key)
    return found


def _json_cells(record: dict[str, Any]) -> None:
    """A CSV row's image column holding a JSON list (``["a.png", "b.png"]``), read as the list."""
    for key in IMAGE_COLUMNS:
        value = record.get(key)
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                record[key] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{key}: not a valid JSON list: {exc.msg}") from None
        elif value == "":
            record[key] = None


class Resolver:
    """Turns one reference into the ``sha256:<hex>`` of its staged bytes (``Staged.add``)."""

    def __init__(self, staged: Staged, *, storage: Storage, roots: list[Path], fetch_urls: bool) -> None:
        self.staged, self.storage, self.roots, self.fetch_urls = staged, storage, roots, fetch_urls

    def __call__(self, value: Any, where: str) -> str:
        try:
            return self._resolve(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def _resolve(self, value: Any) -> str:
        if isinstance(value, dict) and ("bytes" in value or "path" in value):  # Hugging Face's struct
            value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
        if isinstance(value, bytes | bytearray | memoryview):
            return self.staged.add(bytes(value))
        if not isinstance(value, str) or not value.strip():
            got = "nothing" if value is None else repr(value) if value == "" else type(value).__name__
            raise ValueError(f"expected an image reference (a file name, a data: URL, bytes), got {got}")
        scheme = value[:8].lower()
        if scheme.startswith("data:"):
            return self.staged.add(_data_url(value))
        digest = store_images.digest_of(value)
        if digest is not None:  # a stored image: staged too, for the validation that reads them there
            target = store_images.staged_path(self.staged.folder, digest)
            if not target.is_file():
                try:
                    self.storage.get_file(store_images.image_key(digest), target)
                except FileNotFoundError:
                    raise ValueError(f"{value}: no such image in the store") from None
                self.staged.charge(target.stat().st_size)
            self.staged.digests.add(digest)
            return value
        if scheme.startswith(("http://", "https://")):
            if not self.fetch_urls:
                raise ValueError(
                    f"{_short(value)}: image URLs are not fetched on this server (its operator allows"
                    f" it with {URL_SETTING}=1); pack the image in a zip/tar with the data file, or use a"
                    " data: URL"
                )
            return self.staged.add(_fetch(value))
        if "://" in value:
            raise ValueError(f"{_short(value)}: unsupported URL scheme (use a file name, data: or https://)")
        return self.staged.add(self._file(value))

    def _file(self, name: str) -> bytes:
        if not self.roots:
            raise ValueError(
                f"{_short(name)}: names a file, but the upload is a lone data file; upload a zip/tar"
                " holding the data file and its images"
            )
        rel = PurePosixPath(name.replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts or name.startswith("~"):
            raise ValueError(
                f"{_short(name)}: a file name must stay inside the archive (no '..', not absolute)"
            )
        for root in self.roots:
            path = root.joinpath(*rel.parts)
            if path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if size > (most := max_image_bytes()):
                    raise ValueError(f"{_short(name)}: {size} bytes, more than the limit of {most}")
                return path.read_bytes()
        raise ValueError(f"{_short(name)}: no such file in the archive")


def _short(value: str) -> str:
    return repr(value if len(value) <= 120 else value[:117] + "...")


def _data_url(value: str) -> bytes:
    head, sep, body = value.partition(",")
    head = head.lower()
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{_short(value[:60])}: a data URL must be data:image/<type>;base64,<data>")
    if not head.startswith("data:image/"):
        raise ValueError(f"{_short(head)}: not an image (expected data:image/...)")
    if len(body) > ((most := max_image_bytes()) * 4) // 3 + 4:
        raise ValueError(f"the data URL's image is larger than the limit of {most} bytes")
    return decode_data_url(value)


def _fetch(url: str) -> bytes:
    """The bytes at ``url`` (at most ``max_image_bytes()``)."""
    most = max_image_bytes()
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # http(s) only: checked above
            data: bytes = response.read(most + 1)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{_short(url)}: the server answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"{_short(url)}: could not be fetched ({reason})") from None
    if len(data) > most:
        raise ValueError(f"{_short(url)}: larger than the limit of {most} bytes")
    return data


@dataclass
class Rewritten:
    """What ``rewrite_file`` did: whether the file names images (then ``path`` is the rewritten
    copy), its rows' errors (the first ``max_errors``) and their count."""

    has_images: bool
    path: Path | None
    errors: list[RowError]
    errors_total: int


def rewrite_file(source: Path, *, target: Path, resolve: Resolve, max_errors: int) -> Rewritten:
    """Read ``source`` (JSONL, CSV or Parquet) row by row, resolving each image reference, and write
    the rows with their references rewritten to ``target`` (same format) once a row names an image
    (the rows before it copied then): kept when no reference was refused. A row that cannot be
    read is left to the validation that follows (it reports it)."""
    kind = source.suffix.lower()
    unit = "row" if kind == ".parquet" else "line"
    errors: list[RowError] = []
    total = 0
    out: _Writer | None = None
    try:
        for line, record in read_records(source):
            if isinstance(record, RowError):
                continue
            try:
                if kind == ".csv":
                    _json_cells(record)
                has = rewrite(record, resolve)
            except ValueError as exc:
                total += 1
                if len(errors) < max_errors:
                    errors.append(RowError(line, str(exc), unit))
                continue
            if has and out is None:  # the first row with images: the rows before it, as they are
                out = _Writer(target, source=source).__enter__()
                for earlier, before in read_records(source):
                    if earlier >= line:
                        break
                    if isinstance(before, dict):
                        out.write(before)
            if out is not None and not total:
                out.write(record)
    finally:
        if out is not None:
            out.__exit__(None, None, None)
    if out is None or total:
        target.unlink(missing_ok=True)
        return Rewritten(out is not None, None, errors, total)
    return Rewritten(True, target, errors, total)


def _parquet_schema(source: Path) -> Any:
    """The source's Parquet schema with its image columns as the rewrite leaves them: ``images`` a
    list of references, ``image`` one (their bytes went into the store)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with source.open("rb") as f:
        schema = pq.ParquetFile(f).schema_arrow
    for name, kind in (("images", pa.list_(pa.string())), ("image", pa.string())):
        at = schema.get_field_index(name)
        if at >= 0:
            schema = schema.set(at, pa.field(name, kind))
    return schema


class _Writer:
    """Rows written to a JSONL, CSV or Parquet file as they come (Parquet: in batches)."""

    BATCH = 1024

    def __init__(self, target: Path, *, source: Path) -> None:
        self.target, self.kind = target, target.suffix.lower()
        self.schema = _parquet_schema(source) if self.kind == ".parquet" else None
        self.batch: list[dict[str, Any]] = []
        self.parquet: Any = None
        self.csv: csv.DictWriter[str] | None = None
        self.file: Any = None

    def __enter__(self) -> _Writer:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.kind != ".parquet":
            self.file = self.target.open("w", encoding="utf-8", newline="")
        return self

    def write(self, row: dict[str, Any]) -> None:
        if self.kind == ".jsonl":
            self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        elif self.kind == ".csv":
            if self.csv is None:
                self.csv = csv.DictWriter(self.file, fieldnames=list(row))
                self.csv.writeheader()
            self.csv.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in row.items()})
        else:
            self.batch.append(row)
            if len(self.batch) >= self.BATCH:
                self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.batch:
            return
        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.target, self.schema)
        try:
            table = pa.Table.from_pylist(self.batch, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:  # a column of mixed types
            raise ValueError(f"the rows cannot be written back as Parquet: {exc}") from None
        self.parquet.write_table(table)
        self.batch = []

    def __exit__(self, *exc: object) -> None:
        try:
            if self.kind == ".parquet":
                self._flush()
        finally:
            if self.parquet is not None:
                self.parquet.close()
            if self.file is not None:
                self.file.close()


def with_images(example: Example, images_dir: Path | None) -> Example:
    """The example with the bytes of its images (``sha256:`` references: a stored dataset's)."""
    read = []
    for ref in example.images:
        digest = store_images.digest_of(ref.source) if isinstance(ref.source, str) else None
        path = store_images.staged_path(images_dir, digest) if images_dir is not None and digest else None
        if path is None or not path.is_file():
            raise ValueError(f"line {example.line}: {ref.field}: the image is not in the image store")
        read.append(dataclasses.replace(ref, data=path.read_bytes()))
    return dataclasses.replace(example, images=tuple(read))
