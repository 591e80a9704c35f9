"""Prompt rows: what a reinforcement method (GRPO) samples completions for and grades.

A row is a prompt, in the chat shape ``{"messages": [..., {"role": "user", ...}]}`` (an optional
system turn, then user and assistant turns alternating, ending with the user's) or the plain
shape ``{"prompt": str}``, and any other JSON fields: the graders read them as ``item.<field>``
(``{{item.reference_answer}}``). A chat prompt is rendered with the model's chat template and its
generation prompt; a plain prompt is the text itself, as a prompt/completion row's prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.data.read import Example, RowError, conversation, text_field

MAX_FIELDS_BYTES = 65_536  # a row's grader fields, as JSON: a hostile row cannot hold gigabytes


def prompt_example(line: int, record: dict[str, Any]) -> Example:
    """Check a prompt row. Raises ``ValueError`` naming the field at fault."""
    if "completion" in record:
        raise ValueError("a prompt row has no 'completion' (the completions are sampled)")
    if "messages" in record:
        messages = conversation(record.get("messages"), end="user")
        rest = {k: v for k, v in record.items() if k != "messages"}
        example = Example(line, messages=messages)
    else:
        prompt = text_field(record, "prompt")
        rest = {k: v for k, v in record.items() if k != "prompt"}
        example = Example(line, prompt=prompt)
    size = len(json.dumps(rest, ensure_ascii=False, default=str))
    if size > MAX_FIELDS_BYTES:
        raise ValueError(f"the row's other fields take {size:,} bytes as JSON: at most {MAX_FIELDS_BYTES:,}")
    example.fields = rest
    return example


@dataclass(frozen=True)
class PromptItem:
    """One prompt row encoded: its token ids and the fields its graders read.

    Attributes:
        line: the row's line (or Parquet row) in its file.
        input_ids: the prompt's token ids (a chat prompt with its generation prompt).
        text: the prompt as rendered, for the job page's samples.
        fields: the row's other fields (``item`` to a grader).
        truncated: the prompt was longer than its budget and lost its first tokens.
    """

    line: int
    input_ids: list[int]
    text: str
    fields: dict[str, Any]
    truncated: bool = False


def encode_prompt(example: Example, tokenizer: Any, max_prompt_tokens: int) -> PromptItem:
    """A prompt row's token ids, keeping its last ``max_prompt_tokens`` (the end of a prompt is
    what the completion follows).

    Raises:
        ValueError: the row is not a prompt row, or its prompt encodes to no token.
    """
    if example.messages is not None:
        text = str(
            tokenizer.apply_chat_template(example.messages, tokenize=False, add_generation_prompt=True)
        )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    elif example.prompt is not None:
        text = example.prompt
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    else:
        raise ValueError("not a prompt row: give 'messages' ending with a user turn, or 'prompt'")
    if not ids:
        raise ValueError("the prompt encodes to no token")
    kept = ids[-max_prompt_tokens:]
    return PromptItem(example.line, kept, text, dict(example.fields or {}), len(kept) < len(ids))


def load_prompts(
    path: str, tokenizer: Any, *, fmt: str = "auto", max_prompt_tokens: int, field: str = "data.train"
) -> list[PromptItem]:
    """Every prompt row of a file, encoded.

    Raises:
        ConfigError: for ``field``: an unsupported file type, rows of another format, or invalid
            rows listed by line (the first 20, and how many more); for ``data.format`` when it
            names another format.
    """
    from engine.data.encode import ensure_chat_template
    from engine.data.read import check_rows, detect_format, read_records
    from engine.errors import ConfigError

    if fmt not in ("auto", "prompts"):
        message = (
            f"data.format={fmt!r}: GRPO samples completions for prompt rows (data.format 'prompts' or 'auto')"
        )
        raise ConfigError("data.format", message, value=fmt)
    try:
        first = next((rec for _, rec in read_records(path) if isinstance(rec, dict)), None)
        shape = None if first is None else detect_format(first)
        if shape is not None and shape != "prompts":
            raise ConfigError(
                field,
                f"{field}: {path} holds {shape} rows; GRPO trains on prompt rows ('messages' ending with "
                "a user turn, or 'prompt', with any fields the grader reads)",
                value=path,
            )
        found = check_rows(path, "prompts" if fmt == "auto" else fmt, max_errors=20)
    except ValueError as exc:  # an unsupported file type
        raise ConfigError(field, str(exc), value=path) from exc
    errors, total = list(found.errors), found.errors_total
    ensure_chat_template(tokenizer)
    items: list[PromptItem] = []
    for ex in found.examples:
        try:
            items.append(encode_prompt(ex, tokenizer, max_prompt_tokens))
        except ValueError as exc:
            total += 1
            if len(errors) < 20:
                errors.append(RowError(ex.line, str(exc), "line"))
    if found.rows == 0:
        raise ConfigError(field, f"{path}: the file holds no rows", value=path)
    if total:
        shown = "; ".join(str(e) for e in sorted(errors, key=lambda e: e.line))
        more = f" (and {total - len(errors)} more)" if total > len(errors) else ""
        raise ConfigError(
            field,
            f"{path}: {total} invalid rows (GRPO trains on prompt rows: 'messages' ending with a user "
            f"turn, or 'prompt', with any fields the grader reads): {shown}{more}",
            value=path,
        )
    return items
