"""Prompt/completion rows: ``{"prompt": str, "completion": str}``, trained as plain text
(prompt + completion + EOS, no chat template) with the loss on the completion."""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, text_field


class PromptCompletion(DataFormat):
    name = "prompt_completion"
    title = "prompt/completion"
    family = "supervised"
    description = "prompt/completion"
    detect_order = 40

    def detect(self, record: dict[str, Any]) -> bool:
        return "prompt" in record and "completion" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        return Example(line, prompt=text_field(record, "prompt"), completion=text_field(record, "completion"))


PROMPT_COMPLETION = register(PromptCompletion())
