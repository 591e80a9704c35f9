"""Chat rows: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``
(OpenAI style: an optional system turn, then user and assistant alternating, ending with the
assistant). The loss covers every assistant turn. In CSV files the ``messages`` cell holds the
JSON-encoded list.

A content is a string or, as in OpenAI's vision fine-tuning rows, a list of parts: ``{"type":
"text", "text": ...}`` and ``{"type": "image_url", "image_url": {"url": ...}}`` in the user's
turns, the URL a data URL, a file name beside the dataset or ``sha256:<hex>``
(``engine.data.images``). A row with images trains a vision-language model."""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, chat_turns


class Chat(DataFormat):
    name = "chat"
    title = "chat"
    family = "supervised"
    description = "chat messages (content may hold image_url parts)"
    detect_order = 20  # after prompts, whose rows may hold messages too

    def detect(self, record: dict[str, Any]) -> bool:
        return "messages" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        messages, images = chat_turns(record.get("messages"))
        return Example(line, messages=messages, images=images)


CHAT = register(Chat())
