"""ShareGPT/LLaVA rows, as LLaMA-Factory reads them: a conversation and the row's images.

``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...], "images": [...]}``,
or ``messages`` with ``role``/``content`` in place of ``conversations``; an optional ``system``
field is the system turn. Each ``<image>`` in the text (or ``{"type": "image"}`` part of a
content list, as TRL's vision rows give them) stands for the next entry of ``images``, in order;
LLaVA's single ``image`` field is a list of one. An image entry is a data URL, a file name beside
the dataset, ``sha256:<hex>``, or bytes (a Parquet column of binary or of ``{"bytes", "path"}``
structs). The loss covers every assistant turn, as for chat rows.
"""

from __future__ import annotations

import json
from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, chat_turns

# ShareGPT's speakers and the chat roles they are
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class ShareGPT(DataFormat):
    name = "sharegpt"
    title = "ShareGPT/LLaVA"
    family = "supervised"
    description = "conversations (or messages) with <image> placeholders, and an images list"
    detect_order = 15  # before chat: a row with an images column may hold messages too

    def detect(self, record: dict[str, Any]) -> bool:
        talk = "conversations" in record or "messages" in record
        return talk and ("conversations" in record or "images" in record or "image" in record)

    def example(self, line: int, record: dict[str, Any]) -> Example:
        key = "conversations" if "conversations" in record else "messages"
        turns = _turns(record.get(key), key)
        system = record.get("system")
        if system is not None and system != "":
            if not isinstance(system, str):
                raise ValueError(f"field 'system' must be a string, got {type(system).__name__}")
            if turns and turns[0].get("role") == "system":
                raise ValueError(f"a 'system' field and a system turn in '{key}': give one")
            turns = [{"role": "system", "content": system}, *turns]
        column = "image" if "image" in record else "images"
        messages, images = chat_turns(turns, key, images=_images(record), column=column)
        return Example(line, messages=messages, images=images)


def _turns(value: Any, key: str) -> Any:
    """ShareGPT's ``from``/``value`` turns as ``role``/``content`` messages (others as given)."""
    if isinstance(value, str) and key == "conversations":  # a CSV cell
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column '{key}' is not valid JSON: {exc.msg}") from None
    if not isinstance(value, list):
        return value  # chat_turns names what is wrong
    out = []
    for i, turn in enumerate(value):
        if isinstance(turn, dict) and "from" in turn:
            speaker = turn.get("from")
            role = SPEAKERS.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                raise ValueError(f"{key}[{i}]: unknown speaker {speaker!r} (use {', '.join(SPEAKERS)})")
            turn = {"role": role, "content": turn.get("value")}
        out.append(turn)
    return out


def _images(record: dict[str, Any]) -> list[Any]:
    """The row's images column: ``images`` (a list), LLaVA's ``image`` (one), or none."""
    if "images" in record and "image" in record:
        raise ValueError("fields 'images' and 'image' both given: give one")
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    if isinstance(value, str) and "images" in record and value.lstrip().startswith("["):  # a CSV cell
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column 'images' is not valid JSON: {exc.msg}") from None
    if "image" in record:
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"field 'images' must be a list, got {type(value).__name__}")
    return value


SHAREGPT = register(ShareGPT())
