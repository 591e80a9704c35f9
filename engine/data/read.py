"""Reading dataset files (JSONL, CSV, Parquet) and checking every row's shape.

Row shapes:
- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
  (OpenAI style; an optional system turn first, then user and assistant alternating, ending with
  the assistant);
- instruction (alpaca): ``{"instruction": str, "input": str (optional), "output": str}``;
- prompt_completion: ``{"prompt": str, "completion": str}``;
- text: ``{"text": str}``;
- preference (for DPO): a prompt with a preferred and a rejected answer, in the OpenAI or the
  common open shape (``engine/data/preference.py``);
- prompts (for GRPO): a prompt alone, ``{"messages": [..., user turn]}`` or ``{"prompt": str}``,
  with any other fields a grader reads (``reference_answer``, ...) (``engine/data/prompts.py``).

Locations are 1-based: a JSONL or CSV *line* (the CSV header is line 1), a Parquet *row*.
In CSV files a ``messages`` cell holds the JSON-encoded list.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("chat", "instruction", "prompt_completion", "text", "preference", "prompts")
ROLES = ("system", "user", "assistant")
PREFERENCE_KEYS = ("chosen", "rejected", "preferred_output", "non_preferred_output")
SUFFIXES = (".jsonl", ".csv", ".parquet")
PARQUET_BATCH = 1024  # rows converted to Python at a time
MAX_MESSAGE = 300  # characters of one error message: a hostile row cannot make its error large


@dataclass(frozen=True)
class RowError:
    line: int
    message: str
    unit: str = "line"

    def __str__(self) -> str:
        return f"{self.unit} {self.line}: {self.message}"


@dataclass
class Example:
    """One valid row, normalised: ``messages`` for chat and instruction rows.

    A preference row is its prompt with the preferred answer as the last turn of ``messages``,
    and the rejected answer in ``rejected``."""

    line: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    completion: str | None = None
    text: str | None = None
    rejected: str | None = None
    # a prompt row (GRPO): its fields besides the prompt, for the graders (``item.<field>``)
    fields: dict[str, Any] | None = None


def file_kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{Path(path).name}: unsupported file type {suffix!r}; use {', '.join(SUFFIXES)}")
    return suffix[1:]


def read_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield ``(location, record or RowError)`` for every row of the file, in order."""
    kind = file_kind(path)
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


def detect_format(record: dict[str, Any]) -> str | None:
    """The row shape a record's keys announce, or None."""
    if any(key in record for key in PREFERENCE_KEYS):
        return "preference"
    if is_prompt_row(record):
        return "prompts"
    if "messages" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "instruction"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def is_prompt_row(record: dict[str, Any]) -> bool:
    """A row that holds a prompt and no answer: ``messages`` ending with a user turn, or
    ``prompt`` without ``completion``."""
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        return isinstance(last, dict) and last.get("role") == "user"
    return "prompt" in record and "completion" not in record and "messages" not in record


def text_field(record: dict[str, Any], key: str, *, required: bool = True) -> str:
    """A record's string field. Raises ``ValueError`` naming the field when it is missing or empty."""
    if key not in record or record[key] is None:
        if required:
            raise ValueError(f"missing field '{key}'")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"field '{key}' must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise ValueError(f"field '{key}' is empty")
    return value


def conversation(value: Any, name: str = "messages", *, end: str = "assistant") -> list[dict[str, str]]:
    """Check a list of messages: an optional system turn, then user and assistant alternating,
    ending with ``end`` (``"assistant"``: a chat row; ``"user"``: a prompt). Errors name ``name``.

    Raises:
        ValueError: what is wrong, with the index of the message at fault.
    """
    if value is None:
        raise ValueError(f"missing field '{name}'")
    if not isinstance(value, list):
        raise ValueError(f"field '{name}' must be a list, got {type(value).__name__}")
    if not value:
        raise ValueError(f"field '{name}' is empty")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{name}[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}]: unknown role {role!r} (use {', '.join(ROLES)})")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise ValueError(f"{name}[{i}].content is empty")
        out.append({"role": role, "content": content})
    turns = out[1:] if out[0]["role"] == "system" else out
    whose = "" if name == "messages" else f"{name}: "
    if end == "assistant" and not any(m["role"] == "assistant" for m in turns):
        raise ValueError(f"{whose}no assistant turn")
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            where = i + (len(out) - len(turns))
            raise ValueError(
                f"{name}[{where}]: expected role '{want}', got '{m['role']}' (turns must alternate)"
            )
    if end == "assistant" and turns[-1]["role"] != "assistant":
        raise ValueError(f"{whose}the last turn must be the assistant's")
    if end == "user" and (not turns or turns[-1]["role"] != "user"):
        raise ValueError(f"'{name}' must end with a user turn (the answers follow it)")
    return out


def to_example(line: int, record: dict[str, Any], fmt: str) -> Example:
    """Check a record against a row shape. Raises ``ValueError`` saying what is wrong."""
    if fmt == "chat":
        return Example(line, messages=conversation(record.get("messages")))
    if fmt == "instruction":
        instruction = text_field(record, "instruction")
        extra = text_field(record, "input", required=False)
        output = text_field(record, "output")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return Example(
            line, messages=[{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        )
    if fmt == "prompt_completion":
        return Example(line, prompt=text_field(record, "prompt"), completion=text_field(record, "completion"))
    if fmt == "text":
        return Example(line, text=text_field(record, "text"))
    if fmt == "preference":
        from engine.data.preference import preference_example  # it builds on this module's checks

        return preference_example(line, record)
    if fmt == "prompts":
        from engine.data.prompts import prompt_example  # it builds on this module's checks

        return prompt_example(line, record)
    raise ValueError(f"unknown format {fmt!r}; use auto or one of {', '.join(FORMATS)}")


@dataclass
class Checked:
    """What ``check_rows`` found: the row format, the row count, the valid examples (when kept) and
    the first errors, with the count of all of them."""

    format: str | None
    rows: int
    examples: list[Example]
    errors: list[RowError]
    errors_total: int


def _clip(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


def check_rows(
    path: str | Path, fmt: str = "auto", *, keep: bool = True, max_errors: int | None = None
) -> Checked:
    """Read and check every row of a file, holding one row at a time unless ``keep``.

    Args:
        fmt: a row shape of ``FORMATS``, or ``auto`` to detect it from the first row.
        keep: keep the valid examples (else they are checked and dropped).
        max_errors: keep only the first errors (all are counted); None keeps all.

    Raises:
        ValueError: an unsupported file type.
    """
    unit = "row" if file_kind(path) == "parquet" else "line"
    found = Checked(None if fmt == "auto" else fmt, 0, [], [], 0)

    def fail(error: RowError) -> None:
        found.errors_total += 1
        if max_errors is None or len(found.errors) < max_errors:
            found.errors.append(RowError(error.line, _clip(error.message), error.unit))

    for n, rec in read_records(path):
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
            if keep:
                found.examples.append(example)
        except ValueError as exc:
            fail(RowError(n, str(exc), unit))
    return found


def read_examples(
    path: str | Path, fmt: str = "auto", *, keep: bool = True
) -> tuple[str | None, int, list[Example], list[RowError]]:
    """Read and check every row. Returns (format, rows, valid examples, every error).

    With ``keep=False`` the valid examples are checked and dropped (an upload's validation of a
    large file then holds one row at a time); ``check_rows`` also bounds the errors kept."""
    found = check_rows(path, fmt, keep=keep)
    return found.format, found.rows, found.examples, found.errors
