"""Validating dataset files and encoding them for a run: every row checked by its format
(``engine.data.formats``), encoded into token sequences (``engine.data.sequences``), and the
token lengths reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.data.formats import Family, get_format, titles
from engine.data.read import RowError, check_rows
from engine.data.rows import IMAGES_SFT_ONLY
from engine.data.sequences import (
    FALLBACK_CHAT_TEMPLATE,
    Encoded,
    EncodedPair,
    EncodedRow,
    EncodedUnpaired,
    assistant_spans,
    encode,
    encode_pair,
    encode_prompt_row,
    ensure_chat_template,
    rejected_example,
)
from engine.errors import ConfigError

__all__ = [
    "FALLBACK_CHAT_TEMPLATE",
    "Encoded",
    "EncodedPair",
    "EncodedRow",
    "EncodedUnpaired",
    "Report",
    "assistant_spans",
    "encode",
    "encode_pair",
    "encode_prompt_row",
    "ensure_chat_template",
    "load_encoded",
    "load_pairs",
    "load_rows",
    "rejected_example",
    "validate",
]


@dataclass
class Report:
    """What ``validate`` found in a dataset file."""

    path: str
    format: str | None
    rows: int
    errors: list[RowError] = field(default_factory=list)  # the first ``max_errors`` of them
    errors_total: int = 0
    tokens: dict[str, float] = field(default_factory=dict)
    truncated_share: float = 0.0
    max_length: int | None = None
    images: int = 0  # the images of the valid rows

    @property
    def ok(self) -> bool:
        return not self.errors and self.rows > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "rows": self.rows,
            "ok": self.ok,
            "errors": [{"line": e.line, "unit": e.unit, "message": e.message} for e in self.errors],
            "errors_total": self.errors_total,
            "tokens": self.tokens,
            "truncated_share": self.truncated_share,
            "max_length": self.max_length,
            "images": self.images,
        }


def validate(
    path: str,
    *,
    tokenizer: Any = None,
    fmt: str = "auto",
    max_length: int = 1024,
    max_errors: int | None = None,
    image_store: str | None = None,
) -> Report:
    """Read every row of a dataset file (or archive) and report its format, errors and token
    lengths. A row's images are read and decoded, each error naming its line and field.

    Args:
        tokenizer: also encode every row (and report token lengths; both sequences of a
            preference row count); without one the rows are only checked, one at a time. A
            vision-language model's processor encodes rows with images too (their tokens count).
        max_errors: report only the first errors (``errors_total`` counts all); None reports all.
        image_store: the content-addressed image store's folder (``sha256:`` references).

    Raises:
        ValueError: an unsupported file type, an archive that cannot be unpacked.
    """
    return _checked(
        path,
        tokenizer=tokenizer,
        fmt=fmt,
        max_length=max_length,
        max_errors=max_errors,
        image_store=image_store,
    )[0]


def _checked(
    path: str, *, tokenizer: Any, fmt: str, max_length: int, max_errors: int | None, image_store: str | None
) -> tuple[Report, list[EncodedRow]]:
    """``validate``'s report and every valid row encoded (none without a tokenizer)."""
    found = check_rows(path, fmt, keep=tokenizer is not None, max_errors=max_errors, image_store=image_store)
    report = Report(path, found.format, found.rows, found.errors, found.errors_total, max_length=max_length)
    report.images = found.images
    unit = found.unit

    def fail(line: int, message: str) -> None:
        report.errors.append(RowError(line, message, unit))
        report.errors_total += 1

    if found.rows == 0:
        fail(1, "the file holds no rows")
    if tokenizer is None or not found.examples or found.format is None:
        return report, []  # without a tokenizer the rows were only checked, not kept
    ensure_chat_template(tokenizer)
    fmt_of = get_format(found.format)  # a format of the registry: its rows were checked by it
    encoded: list[EncodedRow] = []
    sequences: list[Encoded] = []
    for ex in found.examples:
        try:
            item = fmt_of.encode(ex, tokenizer, max_length)
        except ValueError as exc:
            fail(ex.line, str(exc))
            continue
        encoded.append(item)
        for what, e in fmt_of.sequences(item):
            sequences.append(e)
            if fmt_of.trains_on_rows() and e.trained_tokens == 0:
                fail(e.line, f"no token{what} left to train on within max_length={max_length}")
    report.errors.sort(key=lambda e: e.line)
    if max_errors is not None:  # the first ones: every read error check_rows dropped lies past them
        del report.errors[max_errors:]
    lengths = sorted(e.length for e in sequences)
    if lengths:
        report.tokens = {
            "min": float(lengths[0]),
            "mean": statistics.fmean(lengths),
            "p50": float(lengths[len(lengths) // 2]),
            "p95": float(lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))]),
            "max": float(lengths[-1]),
            "total": float(sum(lengths)),
        }
        report.truncated_share = sum(e.truncated for e in sequences) / len(sequences)
    return report, encoded


PAIRS = "preference rows (a prompt with a preferred and a rejected answer)"


def _family(name: str) -> Family | None:
    try:
        return get_format(name).family
    except ValueError:  # an unknown format: each row says so
        return None


def _supervised_only() -> str:
    return f"lora and full train on {titles('supervised')} rows"


def _dpo_only() -> str:
    return f"they train with method.kind 'dpo' or 'orpo'; {_supervised_only()}"


def _refused_format(fmt: str, *, wanted: Family, method: str) -> str:
    """Why ``data.format`` does not suit a method that trains on ``wanted`` rows."""
    if wanted == "preference":
        return (
            f"data.format={fmt!r}: method.kind {method!r} trains on {PAIRS} "
            "(data.format 'preference' or 'auto')"
        )
    if wanted != "supervised":
        return f"data.format={fmt!r}: method.objective {method!r} trains on {titles(wanted)} rows (or 'auto')"
    if _family(fmt) == "preference":
        return f"data.format={fmt!r} names {PAIRS}: {_dpo_only()}"
    return f"data.format={fmt!r} names {_family(fmt)} rows: {_supervised_only()}"


def _refused_file(path: str, found: str, *, field: str, wanted: Family, method: str) -> str:
    """Why a file of ``found`` rows does not suit a method that trains on ``wanted`` rows."""
    if wanted == "preference":
        return f"{field}: {path} holds {found} rows; method.kind {method!r} trains on {PAIRS}"
    if wanted != "supervised":
        return (
            f"{field}: {path} holds {found} rows; method.objective {method!r} trains on {titles(wanted)} rows"
        )
    if _family(found) == "preference":
        return f"{field}: {path} holds {PAIRS}: {_dpo_only()}"
    return f"{field}: {path} holds {found} rows: {_supervised_only()}"


def _load(
    path: str,
    tokenizer: Any,
    *,
    fmt: str,
    max_length: int,
    field: str,
    wanted: Family,
    method: str,
    image_store: str | None = None,
) -> list[EncodedRow]:
    """Every row of a file encoded, after checking that its rows are of the family ``wanted``."""
    if fmt != "auto" and _family(fmt) not in (None, wanted):
        raise ConfigError("data.format", _refused_format(fmt, wanted=wanted, method=method), value=fmt)
    try:
        report, encoded = _checked(
            path, tokenizer=tokenizer, fmt=fmt, max_length=max_length, max_errors=20, image_store=image_store
        )
    except ValueError as exc:  # an unsupported file type, an archive that cannot be unpacked
        raise ConfigError(field, str(exc), value=path) from exc
    if report.images and method != "sft":
        raise ConfigError(
            field,
            f"{field}: {path} holds {report.images} images; method.objective {method!r} trains on text: "
            f"{IMAGES_SFT_ONLY}",
            value=path,
        )
    if report.format is not None and _family(report.format) not in (None, wanted):
        message = _refused_file(path, report.format, field=field, wanted=wanted, method=method)
        raise ConfigError(field, message, value=path)
    if not report.ok:
        total = report.errors_total
        shown = "; ".join(str(e) for e in report.errors)
        more = f" (and {total - len(report.errors)} more)" if total > len(report.errors) else ""
        raise ConfigError(field, f"{path}: {total} invalid rows: {shown}{more}", value=path)
    return encoded


# each kind of encoded row: the format family whose rows encode to it, and the method named in
# errors about them by default (a refusal of supervised rows names none)
_KINDS: dict[type, tuple[Family, str]] = {
    Encoded: ("supervised", "sft"),
    EncodedPair: ("preference", "dpo"),
    EncodedUnpaired: ("unpaired", "kto"),
}

Row = TypeVar("Row", Encoded, EncodedPair, EncodedUnpaired)


def load_rows(
    path: str,
    tokenizer: Any,
    kind: type[Row],
    *,
    fmt: str = "auto",
    max_length: int = 1024,
    field: str = "data.train",
    method: str | None = None,
    image_store: str | None = None,
) -> list[Row]:
    """Every row of a file, encoded as ``kind``: ``Encoded`` (supervised rows), ``EncodedPair``
    (preference rows, both sequences) or ``EncodedUnpaired`` (unpaired rows, the sequence and its
    label).

    Args:
        field: the configuration field naming the file (``data.train``, ``data.validation``).
        method: the method that trains on them, named in errors (None: DPO for pairs, KTO for
            unpaired rows); rows with images train with ``"sft"`` alone.
        image_store: the content-addressed image store's folder (``data.image_store``).

    Raises:
        ConfigError: for ``field``: an unsupported file type, invalid rows listed by line, or rows
            of another format family than ``kind``'s (for ``data.format`` when it names such a
            format).
    """
    family, default = _KINDS[kind]
    encoded = _load(
        path,
        tokenizer,
        fmt=fmt,
        max_length=max_length,
        field=field,
        wanted=family,
        method=default if method is None else method,
        image_store=image_store,
    )
    return [e for e in encoded if isinstance(e, kind)]


def load_encoded(
    path: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    max_length: int = 1024,
    field: str = "data.train",
    image_store: str | None = None,
) -> list[Encoded]:
    """Every example of a supervised file, encoded (``load_rows`` of ``Encoded``; preference rows
    are refused, they train with DPO); ``tokenizer`` a processor for rows with images."""
    return load_rows(
        path, tokenizer, Encoded, fmt=fmt, max_length=max_length, field=field, image_store=image_store
    )


def load_pairs(
    path: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    max_length: int = 1024,
    field: str = "data.train",
    method: str = "dpo",
) -> list[EncodedPair]:
    """Every preference row of a file, encoded as its two sequences (``load_rows`` of
    ``EncodedPair``)."""
    return load_rows(path, tokenizer, EncodedPair, fmt=fmt, max_length=max_length, field=field, method=method)
