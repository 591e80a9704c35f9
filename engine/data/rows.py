"""One dataset row, checked: the ``Example`` a format makes of it, the ``RowError`` that names
its line, and the field checks every format shares (a string field, a list of chat messages).

A message's content is a string, or a list of parts as OpenAI's chat rows give it: ``{"type":
"text", "text": ...}`` and ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``{"type":
"image", "image": ...}``). The parts join into one string in which each image is ``IMAGE_MARK``
(``engine.data.images``), its ``ImageRef`` kept in the example's ``images`` in the same order.

Nothing here knows a format; the formats (``engine.data.formats``) build on these checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.data.images import IMAGE_MARK, ImageRef, image_ref

ROLES = ("system", "user", "assistant")
PLACEHOLDER = "<image>"  # an image's place in the text of the ShareGPT/LLaVA layout
IMAGES_SFT_ONLY = "images train with supervised fine-tuning (method.objective 'sft') on chat or ShareGPT rows"


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
    # a row's images in the order of the ``IMAGE_MARK`` in its messages (read into bytes by the reader)
    images: tuple[ImageRef, ...] = ()


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
    """Check a list of text messages: an optional system turn, then user and assistant
    alternating, ending with ``end`` (``"assistant"``: a chat row; ``"user"``: a prompt). Errors
    name ``name``. Content parts of text are joined; an image is refused (``IMAGES_SFT_ONLY``).

    Raises:
        ValueError: what is wrong, with the index of the message at fault.
    """
    messages, images = chat_turns(value, name, end=end)
    if images:
        raise ValueError(f"{images[0].field}: an image, and these rows take text only: {IMAGES_SFT_ONLY}")
    return messages


def chat_turns(
    value: Any,
    name: str = "messages",
    *,
    end: str = "assistant",
    images: Sequence[Any] | None = None,
    column: str = "images",
) -> tuple[list[dict[str, str]], tuple[ImageRef, ...]]:
    """Check a list of messages (``conversation``'s rules) whose content may hold images, and
    return the messages, each image as ``IMAGE_MARK`` in its text, and the images in order.

    Args:
        images: the row's ``images`` column (the ShareGPT/LLaVA layout): the text's ``<image>``
            placeholders and its ``{"type": "image"}`` parts stand for them, one each, in order.
            None: images are given in the messages (``image_url`` parts).
        column: the images column's name in errors (``"image"``: LLaVA's one image).

    Raises:
        ValueError: naming the message (and part) at fault: an image in an assistant turn, an
            image reference that cannot be read, placeholders and images of different counts.
    """
    if value is None:
        raise ValueError(f"missing field '{name}'")
    if not isinstance(value, list):
        raise ValueError(f"field '{name}' must be a list, got {type(value).__name__}")
    if not value:
        raise ValueError(f"field '{name}' is empty")
    out = []
    refs: list[ImageRef] = []
    marks = 0
    literal: int | None = None  # the first message whose text holds IMAGE_MARK itself
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{name}[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}]: unknown role {role!r} (use {', '.join(ROLES)})")
        content, found = _content(m.get("content"), f"{name}[{i}]", column=images is not None)
        if not content.strip():
            raise ValueError(f"{name}[{i}].content is empty")
        if found and role == "assistant":
            raise ValueError(f"{name}[{i}]: an image in an assistant turn (images go in the user's turns)")
        refs.extend(r for r in found if isinstance(r, ImageRef))
        marks += len(found)
        if content.count(IMAGE_MARK) != len(found) and literal is None:
            literal = i
        out.append({"role": role, "content": content})
    _check_turns(out, name, end)
    if marks and literal is not None:  # in a row with images the character would be taken for one
        raise ValueError(f"{name}[{literal}]: the text holds U+FFFC, the character that marks an image")
    if images is not None:
        if marks != len(images):
            raise ValueError(
                f"{name}: {marks} image placeholder{'s' * (marks != 1)} ('{PLACEHOLDER}' or image parts) "
                f"but {len(images)} image{'s' * (len(images) != 1)} in '{column}'"
            )
        refs = [
            image_ref(v, f"{column}[{k}]" if column == "images" else column) for k, v in enumerate(images)
        ]
    return out, tuple(refs)


def _content(content: Any, where: str, *, column: bool) -> tuple[str, list[ImageRef | None]]:
    """A message's content as one string (each image as ``IMAGE_MARK``) and its images in order:
    an ``ImageRef`` where the content gives the image, None where it is a placeholder for the
    row's ``images`` column (``column``)."""
    if isinstance(content, str):
        return _text(content, f"{where}.content", column=column)
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
    pieces: list[str] = []
    found: list[ImageRef | None] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at} must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text, marks = _text(part.get("text"), f"{at}.text", column=column)
            pieces.append(text)
            found.extend(marks)
            continue
        if kind not in ("image_url", "image"):
            raise ValueError(f"{at}: unknown part type {kind!r} (use text, image_url or image)")
        pieces.append(IMAGE_MARK)
        found.append(_image_part(part, at, column=column))
    return "".join(pieces), found


def _text(value: Any, where: str, *, column: bool) -> tuple[str, list[ImageRef | None]]:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    if not column:
        return value, []
    count = value.count(PLACEHOLDER)
    return value.replace(PLACEHOLDER, IMAGE_MARK), [None] * count


def _image_part(part: dict[str, Any], at: str, *, column: bool) -> ImageRef | None:
    """An image part's reference, or None for a placeholder part of the ``images`` column."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        value, field = (
            (url.get("url"), f"{at}.image_url.url") if isinstance(url, dict) else (url, f"{at}.image_url")
        )
    else:
        key = next((k for k in ("image", "url", "path") if part.get(k) is not None), None)
        value, field = (None, at) if key is None else (part[key], f"{at}.{key}")
    if column:
        if value is not None:
            raise ValueError(
                f"{field}: this row's images are in its 'images' column: an image part is a bare placeholder"
            )
        return None
    if value is None:
        raise ValueError(
            f"{field}: an image part without its image (give image_url.url, or an 'images' column)"
        )
    return image_ref(value, field)


def _check_turns(out: list[dict[str, str]], name: str, end: str) -> None:
    """The turns' order: an optional system turn, user and assistant alternating, ending with ``end``."""
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
