"""Loading prompt rows for a reinforcement method (GRPO): every row of a file checked by the
``prompts`` format (``engine.data.formats.prompts``) and encoded as a ``PromptItem``, the prompt's
token ids and the fields its graders read."""

from __future__ import annotations

from typing import Any

from engine.data.formats import detect_format
from engine.data.read import RowError, check_rows, read_records
from engine.data.sequences import PromptItem, encode_prompt, ensure_chat_template
from engine.errors import ConfigError

__all__ = ["PromptItem", "encode_prompt", "load_prompts"]


def load_prompts(
    path: str, tokenizer: Any, *, fmt: str = "auto", max_prompt_tokens: int, field: str = "data.train"
) -> list[PromptItem]:
    """Every prompt row of a file, encoded.

    Raises:
        ConfigError: for ``field``: an unsupported file type, rows of another format, or invalid
            rows listed by line (the first 20, and how many more); for ``data.format`` when it
            names another format.
    """
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
