"""Tokenizing examples with the model's chat template and marking the trained tokens.

Chat and instruction rows are rendered with ``tokenizer.apply_chat_template``; the loss covers
exactly the assistant turns (their content and the template's end-of-turn marker), found by
rendering each conversation prefix and mapping character spans to tokens. Prompt/completion rows
are plain text (prompt + completion + EOS) with the loss on the completion; text rows train on
every token. A preference row becomes two sequences (``EncodedPair``), the prompt with the preferred
answer and the prompt with the rejected one, each with the loss on its answer alone (its last
assistant turn, end-of-turn marker included), never on assistant turns of the prompt.

Fallback: a tokenizer without a chat template gets ``FALLBACK_CHAT_TEMPLATE`` (ChatML-style
``<|im_start|>role ... <|im_end|>`` turns written as plain text, the end of each assistant turn
followed by the EOS token), recorded with the exported tokenizer so inference renders the same.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from engine.data.read import Example, RowError, check_rows, file_kind
from engine.errors import ConfigError

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Encoded:
    """Token ids and labels (-100 where no loss is taken) of one example."""

    line: int
    input_ids: list[int]
    labels: list[int]
    length: int  # before truncation
    truncated: bool

    @property
    def trained_tokens(self) -> int:
        return sum(1 for t in self.labels[1:] if t != -100)


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template the documented fallback."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool = False) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], *, last_only: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (``last_only``:
    of the last message alone, an assistant turn).

    Raises:
        ValueError: the template does not render a conversation's prefixes as prefixes.
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (last_only and i < len(messages) - 1):
            continue
        before = _render(tokenizer, messages[:i], generation=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError("the chat template does not render conversation prefixes as prefixes")
        spans.append((len(before), len(upto)))
    return full, spans


def encode(example: Example, tokenizer: Any, max_length: int) -> Encoded:
    """Token ids and loss labels of one example, truncated to ``max_length``.

    A preference row encodes as its prompt and preferred answer, the loss on that answer alone."""
    if example.messages is not None:
        text, spans = assistant_spans(tokenizer, example.messages, last_only=example.rejected is not None)
        special = False
    elif example.prompt is not None and example.completion is not None:
        text = example.prompt + example.completion + (tokenizer.eos_token or "")
        spans = [(len(example.prompt), len(text))]
        special = True
    else:
        text = (example.text or "") + (tokenizer.eos_token or "")
        spans = [(0, len(text))]
        special = True
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"], strict=True):
        trained = b > a and any(s <= a < e for s, e in spans)
        labels.append(tok if trained else -100)
    n = len(ids)
    return Encoded(example.line, ids[:max_length], labels[:max_length], n, n > max_length)


def encode_prompt_row(example: Example, tokenizer: Any, max_length: int) -> Encoded:
    """A prompt row's prompt as an ``Encoded`` without label tokens (its length counts; its
    completions are sampled in training). Raises ``ValueError`` for a prompt of no token."""
    from engine.data.prompts import encode_prompt  # it builds on the row checks this module uses

    item = encode_prompt(example, tokenizer, max_length)
    n = len(item.input_ids)
    return Encoded(example.line, item.input_ids, [-100] * n, n, item.truncated)


@dataclass
class EncodedPair:
    """The two sequences of one preference row: its prompt and each answer, the loss on the answer."""

    line: int
    chosen: Encoded
    rejected: Encoded


def rejected_example(example: Example) -> Example:
    """A preference row with its answers swapped: the prompt and the rejected answer."""
    if example.messages is None or example.rejected is None:
        raise ValueError(f"line {example.line}: not a preference row")
    answer = {"role": "assistant", "content": example.rejected}
    return Example(
        example.line, messages=[*example.messages[:-1], answer], rejected=example.messages[-1]["content"]
    )


def encode_pair(example: Example, tokenizer: Any, max_length: int) -> EncodedPair:
    """Both sequences of a preference row, each truncated to ``max_length``.

    Raises:
        ValueError: not a preference row, or a chat template that renders prefixes differently.
    """
    rejected = rejected_example(example)
    return EncodedPair(
        example.line, encode(example, tokenizer, max_length), encode(rejected, tokenizer, max_length)
    )


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
        }


def validate(
    path: str,
    *,
    tokenizer: Any = None,
    fmt: str = "auto",
    max_length: int = 1024,
    max_errors: int | None = None,
) -> Report:
    """Read every row of a dataset file and report its format, errors and token lengths.

    Args:
        tokenizer: also encode every row (and report token lengths; both sequences of a
            preference row count); without one the rows are only checked, one at a time.
        max_errors: report only the first errors (``errors_total`` counts all); None reports all.

    Raises:
        ValueError: an unsupported file type.
    """
    return _checked(path, tokenizer=tokenizer, fmt=fmt, max_length=max_length, max_errors=max_errors)[0]


def _checked(
    path: str, *, tokenizer: Any, fmt: str, max_length: int, max_errors: int | None
) -> tuple[Report, list[Encoded | EncodedPair]]:
    """``validate``'s report and every valid row encoded (none without a tokenizer)."""
    found = check_rows(path, fmt, keep=tokenizer is not None, max_errors=max_errors)
    report = Report(path, found.format, found.rows, found.errors, found.errors_total, max_length=max_length)
    unit = "row" if file_kind(path) == "parquet" else "line"

    def fail(line: int, message: str) -> None:
        report.errors.append(RowError(line, message, unit))
        report.errors_total += 1

    if found.rows == 0:
        fail(1, "the file holds no rows")
    if tokenizer is None or not found.examples:
        return report, []  # without a tokenizer the rows were only checked, not kept
    ensure_chat_template(tokenizer)
    encoded: list[Encoded | EncodedPair] = []
    sequences: list[Encoded] = []
    for ex in found.examples:
        try:
            if ex.fields is not None:  # a prompt row (GRPO): its prompt, nothing trained yet
                sequences.append(encode_prompt_row(ex, tokenizer, max_length))
                continue
            item = (
                encode_pair(ex, tokenizer, max_length)
                if ex.rejected is not None
                else encode(ex, tokenizer, max_length)
            )
        except ValueError as exc:
            fail(ex.line, str(exc))
            continue
        encoded.append(item)
        named = (
            [(" of the preferred answer", item.chosen), (" of the rejected answer", item.rejected)]
            if isinstance(item, EncodedPair)
            else [("", item)]
        )
        for what, e in named:
            sequences.append(e)
            if e.trained_tokens == 0:
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
DPO_ONLY = (
    "they train with method.kind 'dpo' or 'orpo'; lora and full train on chat, instruction, "
    "prompt/completion or text rows"
)


def _load(
    path: str, tokenizer: Any, *, fmt: str, max_length: int, field: str, pairs: bool, method: str = "dpo"
) -> list[Encoded | EncodedPair]:
    """Every row of a file encoded, after checking that its rows suit the method."""
    if fmt != "auto" and (fmt == "preference") != pairs:
        message = (
            f"data.format={fmt!r}: method.kind {method!r} trains on {PAIRS} "
            "(data.format 'preference' or 'auto')"
            if pairs
            else f"data.format='preference' names {PAIRS}: {DPO_ONLY}"
        )
        raise ConfigError("data.format", message, value=fmt)
    try:
        report, encoded = _checked(path, tokenizer=tokenizer, fmt=fmt, max_length=max_length, max_errors=20)
    except ValueError as exc:  # an unsupported file type
        raise ConfigError(field, str(exc), value=path) from exc
    if report.format is not None and (report.format == "preference") != pairs:
        message = (
            f"{field}: {path} holds {report.format} rows; method.kind {method!r} trains on {PAIRS}"
            if pairs
            else f"{field}: {path} holds {PAIRS}: {DPO_ONLY}"
        )
        raise ConfigError(field, message, value=path)
    if not report.ok:
        total = report.errors_total
        shown = "; ".join(str(e) for e in report.errors)
        more = f" (and {total - len(report.errors)} more)" if total > len(report.errors) else ""
        raise ConfigError(field, f"{path}: {total} invalid rows: {shown}{more}", value=path)
    return encoded


def load_encoded(
    path: str, tokenizer: Any, *, fmt: str = "auto", max_length: int = 1024, field: str = "data.train"
) -> list[Encoded]:
    """Every example of a file, encoded.

    Args:
        field: the configuration field naming the file (``data.train``, ``data.validation``).

    Raises:
        ConfigError: for ``field``: an unsupported file type, invalid rows listed by line, or
            preference rows (they train with DPO; for ``data.format`` when it says so).
    """
    encoded = _load(path, tokenizer, fmt=fmt, max_length=max_length, field=field, pairs=False)
    return [e for e in encoded if isinstance(e, Encoded)]


def load_pairs(
    path: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    max_length: int = 1024,
    field: str = "data.train",
    method: str = "dpo",
) -> list[EncodedPair]:
    """Every preference row of a file, encoded as its two sequences.

    Args:
        field: the configuration field naming the file (``data.train``, ``data.validation``).
        method: the preference method that trains on them (named in errors).

    Raises:
        ConfigError: for ``field``: an unsupported file type, invalid rows listed by line, or rows
            that are not preference rows (for ``data.format`` when it names another format).
    """
    encoded = _load(path, tokenizer, fmt=fmt, max_length=max_length, field=field, pairs=True, method=method)
    return [e for e in encoded if isinstance(e, EncodedPair)]
