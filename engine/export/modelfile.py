"""Ollama's ``Modelfile`` for an exported GGUF: ``ollama create NAME -f Modelfile``.

FROM the GGUF next to it; a ``stop`` parameter per end-of-turn marker of the chat template (and
the end-of-sequence token); ``num_ctx`` where the file's context was capped; the system prompt
when the training data gave every conversation the same one. Ollama takes the chat template
from the GGUF's ``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# end-of-turn markers of the common chat templates
END_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
)


def stop_words(*, chat_template: str | None, eos: str | None) -> list[str]:
    """The markers that end an answer: the template's end-of-turn markers, then the EOS token."""
    found = [m for m in END_MARKERS if chat_template and m in chat_template]
    if eos and eos not in found:
        found.append(eos)
    return found


def system_prompt(rows: Iterable[dict[str, Any]]) -> str | None:
    """The system message every chat row starts with, when they all share one; else None."""
    prompts = set()
    for row in rows:
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            return None
        first = messages[0]
        if not isinstance(first, dict) or first.get("role") != "system":
            return None
        prompts.add(str(first.get("content", "")))
        if len(prompts) > 1:
            return None
    return prompts.pop() if prompts else None


def system_prompt_of_file(path: str | Path, *, limit: int = 10_000) -> str | None:
    """:func:`system_prompt` of a JSONL file's first ``limit`` rows (None for other formats)."""
    path = Path(path)
    if path.suffix.lower() not in (".jsonl", ".json") or not path.is_file():
        return None
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    return None
    return system_prompt(rows)


def _quote(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile(
    gguf_name: str,
    *,
    chat_template: str | None,
    eos: str | None,
    system: str | None = None,
    context_length: int | None = None,
    comment: str | None = None,
) -> str:
    """The text of a Modelfile for the GGUF file ``gguf_name`` in the same folder."""
    lines = [f"# {line}" for line in (comment or "").splitlines()]
    lines.append(f"FROM ./{gguf_name}")
    for word in stop_words(chat_template=chat_template, eos=eos):
        lines.append(f"PARAMETER stop {json.dumps(word)}")
    if context_length:
        lines.append(f"PARAMETER num_ctx {int(context_length)}")
    if system:
        lines.append(f"SYSTEM {_quote(system)}")
    return "\n".join(lines) + "\n"
