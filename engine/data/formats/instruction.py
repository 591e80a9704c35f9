"""Instruction rows (Alpaca): ``{"instruction": str, "input": str (optional), "output": str}``,
trained as one user turn (the instruction, then the input after a blank line) and the
assistant's answer, the output."""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, text_field


class Instruction(DataFormat):
    name = "instruction"
    title = "instruction"
    family = "supervised"
    description = "instruction/input/output"
    detect_order = 30

    def detect(self, record: dict[str, Any]) -> bool:
        return "instruction" in record and "output" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        instruction = text_field(record, "instruction")
        extra = text_field(record, "input", required=False)
        output = text_field(record, "output")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return Example(
            line, messages=[{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        )


INSTRUCTION = register(Instruction())
