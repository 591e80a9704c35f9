"""Reading dataset files (JSONL, CSV, Parquet) and checking every row against its format.

The row formats are the registry's (``engine.data.formats``): this module reads records from a
file and asks the registry which format the first row announces and whether each row is valid;
it knows no format itself.

Locations are 1-based: a JSONL or CSV *line* (the CSV header is line 1), a Parquet *row*.
In CSV files a ``messages`` cell holds the JSON-encoded list.

A dataset may come as an archive (``engine.data.archives``: one data file and the images its
rows name). A row's images (``engine.data.images``) are read and decoded as its row is checked:
file names from the dataset's folder (in an archive, its data file's folder or its root),
``sha256:`` references from the image store, each error naming the line and the field.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.data.archives import ARCHIVE_SUFFIXES, archive_suffix, unpacked
from engine.data.formats import detect_format, format_names, get_format
from engine.data.images import ImageReader, check_image
from engine.data.rows import Example, RowError

__all__ = [
    "ARCHIVE_SUFFIXES",
    "FORMATS",
    "MAX_MESSAGE",
    "SUFFIXES",
    "Checked",
    "Example",
    "RowError",
    "check_rows",
    "dataset_file",
    "detect_format",
    "file_kind",
    "read_examples",
    "read_records",
    "to_example",
]

# the registry's names, every format being registered by now; callers that may see formats
# registered later (a test's) read format_names()
FORMATS = format_names()
SUFFIXES = (".jsonl", ".csv", ".parquet")
PARQUET_BATCH = 1024  # rows converted to Python at a time
MAX_MESSAGE = 300  # characters of one error message: a hostile row cannot make its error large


def file_kind(path: str | Path) -> str:
    """``"jsonl"``, ``"csv"``, ``"parquet"``, or ``"archive"`` (``ARCHIVE_SUFFIXES``).

    Raises:
        ValueError: another file type, naming those read.
    """
    if archive_suffix(path) is not None:
        return "archive"
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        kinds = ", ".join((*SUFFIXES, *ARCHIVE_SUFFIXES))
        raise ValueError(f"{Path(path).name}: unsupported file type {suffix!r}; use {kinds}")
    return suffix[1:]


@contextmanager
def dataset_file(path: str | Path) -> Iterator[tuple[Path, Path]]:
    """The data file of a dataset and the folder its rows' image file names start from: the file
    and its folder, or an archive's data file and root (unpacked while the context lasts).

    Raises:
        ValueError: an unsupported file type, an archive that cannot be unpacked.
    """
    if file_kind(path) != "archive":
        yield Path(path), Path(path).parent
        return
    with unpacked(path) as found:
        yield found.data, found.root


def read_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield ``(location, record or RowError)`` for every row of the file (of an archive's data
    file), in order."""
    kind = file_kind(path)
    if kind == "archive":
        with dataset_file(path) as (data, _):
            yield from read_records(data)
        return
    if kind == "jsonl":
        yield from _jsonl(Path(path))
    elif kind == "csv":
        yield from _csv(Path(path))
    else:
        yield from _parquet(Path(path))


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield (
                    n,
                    RowError(n, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"),
                )
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                yield n, RowError(n, f"invalid JSON: {exc.msg} (column {exc.colno})")
                continue
            if not isinstance(value, dict):
                yield n, RowError(n, f"expected a JSON object, got {type(value).__name__}")
                continue
            yield n, value


def _csv(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    # read as it goes; undecodable bytes become surrogates, reported per row below
    with path.open(encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield 1, RowError(1, f"invalid CSV: {exc}")
            return
        header = [h.strip().lstrip("\ufeff") for h in header]
        while True:
            start = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                yield start, RowError(start, f"invalid CSV: {exc}")
                return
            if not any(c.strip() for c in cells):
                continue
            if any(_has_surrogate(c) for c in cells):
                yield start, RowError(start, "not valid UTF-8")
                continue
            if len(cells) != len(header):
                yield start, RowError(start, f"{len(cells)} cells, the header has {len(header)} columns")
                continue
            record: dict[str, Any] = dict(zip(header, cells, strict=True))
            if "messages" in record:
                try:
                    record["messages"] = json.loads(record["messages"])
                except json.JSONDecodeError as exc:
                    yield start, RowError(start, f"column 'messages' is not valid JSON: {exc.msg}")
                    continue
            yield start, record


def _has_surrogate(s: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in s)


def _parquet(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    import pyarrow.parquet as pq

    row = 0
    try:
        # a file object, not the path: pyarrow's messages then name no server folder
        with path.open("rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=PARQUET_BATCH):
                for record in batch.to_pylist():
                    row += 1
                    yield row, record
    except Exception as exc:  # pyarrow raises several types for a damaged file
        what = "not a readable Parquet file" if row == 0 else "the rest of the Parquet file is unreadable"
        yield row + 1, RowError(row + 1, f"{what}: {exc}", unit="row")


def to_example(line: int, record: dict[str, Any], fmt: str) -> Example:
    """Check a record against the format named ``fmt``.

    Raises:
        ValueError: what is wrong with the row, naming the field; or an unknown format.
    """
    return get_format(fmt).example(line, record)


@dataclass
class Checked:
    """What ``check_rows`` found: the row format, the row count, the valid examples (when kept) and
    the first errors, with the count of all of them; how its errors name a location (``unit``)
    and the images of its valid rows."""

    format: str | None
    rows: int
    examples: list[Example]
    errors: list[RowError]
    errors_total: int
    unit: str = "line"
    images: int = 0


def _clip(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


def check_rows(
    path: str | Path,
    fmt: str = "auto",
    *,
    keep: bool = True,
    max_errors: int | None = None,
    image_store: str | Path | None = None,
    limit: int | None = None,
) -> Checked:
    """Read and check every row of a file, holding one row at a time unless ``keep``. A row's
    images are read and decoded (a kept example holds their bytes).

    Args:
        fmt: a format's name (``engine.data.formats``), or ``auto`` to detect it from the
            first row.
        keep: keep the valid examples (else they are checked and dropped).
        max_errors: keep only the first errors (all are counted); None keeps all.
        image_store: the folder of the content-addressed image store (``sha256:`` references).
        limit: read no further than this many rows (a preview's); None reads them all.

    Raises:
        ValueError: an unsupported file type, an archive that cannot be unpacked.
    """
    with dataset_file(path) as (data, root):
        unit = "row" if file_kind(data) == "parquet" else "line"
        found = Checked(None if fmt == "auto" else fmt, 0, [], [], 0, unit)
        reader = ImageReader(data.parent, image_store, root=root, cache=keep)

        def fail(error: RowError) -> None:
            found.errors_total += 1
            if max_errors is None or len(found.errors) < max_errors:
                found.errors.append(RowError(error.line, _clip(error.message), error.unit))

        for n, rec in read_records(data):
            if limit is not None and found.rows >= limit:
                break
            found.rows += 1
            if isinstance(rec, RowError):
                fail(rec)
                continue
            if found.format is None:
                found.format = detect_format(rec)
                if found.format is None:
                    keys = ", ".join(sorted(rec)) or "none"
                    fail(RowError(n, f"cannot tell the row format from its fields ({keys})", unit))
                    continue
            try:
                example = to_example(n, rec, found.format)
                if example.images:
                    example = _with_images(example, reader, keep=keep)
                    found.images += len(example.images)
                if keep:
                    found.examples.append(example)
            except ValueError as exc:
                fail(RowError(n, str(exc), unit))
    return found


def _with_images(example: Example, reader: ImageReader, *, keep: bool) -> Example:
    """The example with its images read and decoded (their bytes kept when ``keep``).

    Raises:
        ValueError: naming the field: a missing image, an unreadable or oversized one.
    """
    read = []
    for ref in example.images:
        loaded = reader.read(ref)
        check_image(loaded)
        read.append(loaded if keep else ref)
    return dataclasses.replace(example, images=tuple(read))


def read_examples(
    path: str | Path, fmt: str = "auto", *, keep: bool = True, image_store: str | Path | None = None
) -> tuple[str | None, int, list[Example], list[RowError]]:
    """Read and check every row (its images read too). Returns (format, rows, valid examples,
    every error).

    With ``keep=False`` the valid examples are checked and dropped (an upload's validation of a
    large file then holds one row at a time); ``check_rows`` also bounds the errors kept."""
    found = check_rows(path, fmt, keep=keep, image_store=image_store)
    return found.format, found.rows, found.examples, found.errors
