"""Prompt rows: what a reinforcement method (GRPO) samples completions for and grades.

A row is a prompt, in the chat shape ``{"messages": [..., {"role": "user", ...}]}`` (an optional
system turn, then user and assistant turns alternating, ending with the user's) or the plain
shape ``{"prompt": str}``, and any other JSON fields: the graders read them as ``item.<field>``
(``{{item.reference_answer}}``). A chat prompt is rendered with the model's chat template and its
generation prompt; a plain prompt is the text itself, as a prompt/completion row's prompt.
Nothing of a prompt row is trained on: its completions are sampled in training.
"""

from __future__ import annotations

import json
from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, conversation, text_field
from engine.data.sequences import EncodedRow, encode_prompt_row

MAX_FIELDS_BYTES = 65_536  # a row's grader fields, as JSON: a hostile row cannot hold gigabytes


class Prompts(DataFormat):
    name = "prompts"
    title = "prompts"
    family = "prompts"
    description = (
        "prompts (messages ending with a user turn, or prompt alone, with fields such as reference_answer)"
    )
    measures = "the prompts"
    detect_order = 10  # before chat: its messages end with the user's turn

    def detect(self, record: dict[str, Any]) -> bool:
        return is_prompt_row(record)

    def example(self, line: int, record: dict[str, Any]) -> Example:
        return prompt_example(line, record)

    def encode(self, example: Example, tokenizer: Any, max_length: int) -> EncodedRow:
        """The prompt's last ``max_length`` tokens (as a run keeps them), none trained."""
        return encode_prompt_row(example, tokenizer, max_length)

    def trains_on_rows(self) -> bool:
        return False

    def preview(self, example: Example, tokenizer: Any, max_length: int) -> dict[str, Any]:
        """The prompt (with the generation prompt of a chat prompt) and its other fields
        (``item``, what a grader reads)."""
        view = super().preview(example, tokenizer, max_length)
        return {**view, "item": example.fields}


def is_prompt_row(record: dict[str, Any]) -> bool:
    """A row that holds a prompt and no answer: ``messages`` ending with a user turn, or
    ``prompt`` without ``completion``."""
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        return isinstance(last, dict) and last.get("role") == "user"
    return "prompt" in record and "completion" not in record and "messages" not in record


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


PROMPTS = register(Prompts())
