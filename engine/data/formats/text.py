"""Text rows: ``{"text": str}``, trained on every token (with EOS)."""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, text_field


class Text(DataFormat):
    name = "text"
    title = "text"
    family = "supervised"
    description = "text"
    detect_order = 50

    def detect(self, record: dict[str, Any]) -> bool:
        return "text" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        return Example(line, text=text_field(record, "text"))


TEXT = register(Text())
