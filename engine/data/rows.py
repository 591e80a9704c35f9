"""One dataset row, checked: the ``Example`` a format makes of it, the ``RowError`` that names
its line, and the field checks every format shares (a string field, a list of chat messages).

Nothing here knows a format; the formats (``engine.data.formats``) build on these checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RowError:
    line: int
    message: str
    unit: str = "line"

    def __str__(self) -> str:
        return f"{self.unit} {self.line}: {self.message}"


@dataclass
class Example:
    """One valid row, normalised: ``messages`` for chat and instruction rows.

    A preference row is its prompt with the preferred answer as the last turn of ``messages``,
    and the rejected answer in ``rejected``."""

    line: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    completion: str | None = None
    text: str | None = None
    rejected: str | None = None
    # an unpaired preference row (KTO): whether its answer, the last turn of ``messages``, is desirable
    label: bool | None = None
    # a prompt row (GRPO): its fields besides the prompt, for the graders (``item.<field>``)
    fields: dict[str, Any] | None = None


def text_field(record: dict[str, Any], key: str, *, required: bool = True) -> str:
    """A record's string field. Raises ``ValueError`` naming the field when it is missing or empty."""
    if key not in record or record[key] is None:
        if required:
            raise ValueError(f"missing field '{key}'")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"field '{key}' must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise ValueError(f"field '{key}' is empty")
    return value


def conversation(value: Any, name: str = "messages", *, end: str = "assistant") -> list[dict[str, str]]:
    """Check a list of messages: an optional system turn, then user and assistant alternating,
    ending with ``end`` (``"assistant"``: a chat row; ``"user"``: a prompt). Errors name ``name``.

    Raises:
        ValueError: what is wrong, with the index of the message at fault.
    """
    if value is None:
        raise ValueError(f"missing field '{name}'")
    if not isinstance(value, list):
        raise ValueError(f"field '{name}' must be a list, got {type(value).__name__}")
    if not value:
        raise ValueError(f"field '{name}' is empty")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{name}[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}]: unknown role {role!r} (use {', '.join(ROLES)})")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise ValueError(f"{name}[{i}].content is empty")
        out.append({"role": role, "content": content})
    turns = out[1:] if out[0]["role"] == "system" else out
    whose = "" if name == "messages" else f"{name}: "
    if end == "assistant" and not any(m["role"] == "assistant" for m in turns):
        raise ValueError(f"{whose}no assistant turn")
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            where = i + (len(out) - len(turns))
            raise ValueError(
                f"{name}[{where}]: expected role '{want}', got '{m['role']}' (turns must alternate)"
            )
    if end == "assistant" and turns[-1]["role"] != "assistant":
        raise ValueError(f"{whose}the last turn must be the assistant's")
    if end == "user" and (not turns or turns[-1]["role"] != "user"):
        raise ValueError(f"'{name}' must end with a user turn (the answers follow it)")
    return out


def prompt_turns(record: dict[str, Any], key: str = "prompt") -> list[dict[str, str]]:
    """A prompt field as chat turns: a string is one user turn; a list of messages follows the chat
    rules and ends with a user turn.

    Raises:
        ValueError: naming the field (and the message at fault).
    """
    value = record.get(key)
    if isinstance(value, list):
        return conversation(value, key, end="user")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"field '{key}' must be a string or a list of messages, got {type(value).__name__}")
    return [{"role": "user", "content": text_field(record, key)}]


def answer_text(record: dict[str, Any], key: str) -> str:
    """An answer field's text: a string, or a list holding one assistant message.

    Raises:
        ValueError: naming the field (and the message at fault).
    """
    value = record.get(key)
    if isinstance(value, list):
        if len(value) > 1:
            raise ValueError(f"field '{key}' must hold one assistant message, got {len(value)} messages")
        if not value:
            raise ValueError(f"field '{key}' is empty")
        return _assistant(value[0], f"{key}[0]")
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"field '{key}' must be a string or a list with one assistant message, got {type(value).__name__}"
        )
    return text_field(record, key)


def _assistant(message: Any, name: str) -> str:
    if not isinstance(message, dict):
        raise ValueError(f"{name} must be an object, got {type(message).__name__}")
    if message.get("role") != "assistant":
        raise ValueError(f"{name}: expected role 'assistant', got {message.get('role')!r}")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"{name}.content must be a string, got {type(content).__name__}")
    if not content.strip():
        raise ValueError(f"{name}.content is empty")
    return content
