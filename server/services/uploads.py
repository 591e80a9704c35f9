"""An upload: a dataset file read from a stream, validated row by row and stored only if every row
is valid (``POST /api/datasets``, ``POST /v1/files``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.orm import Session

from server.services import datasets
from server.services.failures import Invalid, TooLarge
from server.storage import Storage
from server.tables import Dataset


def upload(
    session: Session,
    *,
    source: BinaryIO,
    filename: str | None,
    name: str | None,
    storage: Storage,
    scratch: Path,
    max_bytes: int,
    fetch_urls: bool = False,
    origin: dict[str, Any] | None = None,
) -> Dataset:
    """Store the file ``source`` reads (``datasets.store_upload``) and return its dataset.
    ``fetch_urls``: whether its rows' http(s) image URLs are fetched and stored (the operator's
    ``allow_image_urls``); otherwise such a row is refused, naming its line.

    Raises:
        TooLarge: more than ``max_bytes`` arrived (naming ``file``).
        Invalid: a NUL byte in the file's name or ``name``; an unsupported file type; invalid rows,
            the first ``MAX_REPORTED_ERRORS`` as ``details`` and their count in ``extra``.
    """
    for param, value in (("file", filename), ("name", name)):
        if value is not None and "\x00" in value:
            raise Invalid("invalid_request", f"{param}: a NUL byte is not allowed in it", param=param)
    try:
        stored, report = datasets.store_upload(
            session,
            source=source,
            filename=filename or "dataset",
            name=name,
            storage=storage,
            scratch=scratch,
            max_bytes=max_bytes,
            origin=origin,
            fetch_urls=fetch_urls,
        )
    except datasets.TooLarge as exc:
        raise TooLarge("too_large", str(exc), param="file") from exc
    except ValueError as exc:
        raise Invalid("invalid_dataset", str(exc), param="file") from exc
    if stored is None:
        errors = report.to_dict()["errors"]  # the first MAX_REPORTED_ERRORS
        total = report.errors_total
        head = "; ".join(f"{e['unit']} {e['line']}: {e['message']}" for e in errors[:3])
        more = f" (and {total - 3} more)" if total > 3 else ""
        message = f"{total} invalid row(s), nothing was stored: {head}{more}"
        extra = {"errors_total": total, "errors_truncated": total > len(errors)}
        raise Invalid("invalid_dataset", message, param="file", details=errors, extra=extra)
    return stored
