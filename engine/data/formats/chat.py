"""Chat rows: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
(OpenAI style: an optional system turn, then user and assistant alternating, ending with the
assistant). The loss covers every assistant turn. In CSV files the ``messages`` cell holds the
JSON-encoded list."""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, conversation


class Chat(DataFormat):
    name = "chat"
    title = "chat"
    family = "supervised"
    description = "chat messages"
    detect_order = 20  # after prompts, whose rows may hold messages too

    def detect(self, record: dict[str, Any]) -> bool:
        return "messages" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        return Example(line, messages=conversation(record.get("messages")))


CHAT = register(Chat())
