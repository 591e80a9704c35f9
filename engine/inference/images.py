"""A conversation with images, as a vision-language model's prompt: token ids and image tensors.

A message's ``content`` is text, or a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": <the image file's bytes>}``. ``chat_prompt`` renders it:

- a text model (a tokenizer): the chat template over the text; an image part is refused with a
  ``ValueError`` naming it (``messages.<i>.content.<j>``);
- a VLM (its processor): each image part becomes the family's placeholder in the text
  (``engine.data.sequences.image_placeholder``), rendered by the chat template exactly as a
  training row with images is; the processor then expands each placeholder into the image's
  tokens and makes the image tensors that the model's first forward takes (``Prompt.inputs``),
  what ``model.generate`` is given for the same conversation.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.data.sequences import ensure_chat_template, image_placeholder


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its token ids (image tokens expanded) and the image tensors of its first
    forward (``pixel_values`` and the family's others; empty for a text prompt)."""

    ids: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def images(self) -> bool:
        return bool(self.inputs)


def parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as a list of parts (text content is one text part)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def image_fields(messages: list[dict[str, Any]]) -> list[str]:
    """The field of every image part, in order (``messages.0.content.1``)."""
    return [
        f"messages.{i}.content.{j}"
        for i, m in enumerate(messages)
        for j, p in enumerate(parts(m.get("content", "")))
        if p.get("type") == "image"
    ]


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation with each message's text parts joined (no image part left).

    Raises:
        ValueError: an image part (the message names the first one).
    """
    found = image_fields(messages)
    if found:
        raise ValueError(f"{found[0]}: this model reads no images (it is a text-only model)")
    return [
        {"role": m["role"], "content": "".join(str(p.get("text", "")) for p in parts(m["content"]))}
        for m in messages
    ]


def architecture_of(model: Any) -> str:
    """The class name a model's config declares, else its class's (a ``PeftModel``'s base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    archs = getattr(getattr(base, "config", None), "architectures", None) or []
    return str(archs[0]) if archs else type(base).__name__


def render(processor: Any, messages: list[dict[str, Any]]) -> tuple[str, list[bytes]]:
    """The conversation's text, ready for the assistant's turn, and its images in order."""
    tokenizer = processor.tokenizer
    ensure_chat_template(tokenizer)
    placeholder = image_placeholder(processor)
    images = [p["image"] for m in messages for p in parts(m["content"]) if p.get("type") == "image"]
    shown = [
        {
            "role": m["role"],
            "content": "".join(
                placeholder if p.get("type") == "image" else str(p["text"]) for p in parts(m["content"])
            ),
        }
        for m in messages
    ]
    text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    return str(text), images


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], *, processor: Any = None) -> Prompt:
    """The prompt of a conversation for the assistant's turn.

    Args:
        tokenizer: the model's tokenizer (given the fallback chat template if it has none).
        messages: ``[{"role", "content"}]``, content as text or a list of parts.
        processor: a VLM's processor (``engine.model.load_processor_for``); None for a text model.

    Raises:
        ValueError: an image for a text-only model, or an image that cannot be read (the message
            names its field), or placeholders the processor cannot match to the images.
    """
    from engine.vision.pixels import open_image

    fields = image_fields(messages)
    if processor is None or not fields:
        ensure_chat_template(tokenizer)
        plain = text_messages(messages)
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return Prompt(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    text, data = render(processor, messages)
    images = []
    for where, raw in zip(fields, data, strict=True):
        try:
            images.append(open_image(raw))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    try:
        out = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    except ValueError as exc:
        raise ValueError(f"messages: {exc}") from exc
    ids = [int(t) for t in out["input_ids"][0]]
    inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return Prompt(ids, inputs)


def token_types(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input that marks image positions for ids made without the processor, as the processor
    makes it: ``mm_token_type_ids`` for 3-D rotary positions (Qwen2.5-VL), ``token_type_ids`` for
    bidirectional attention inside images (Gemma 3); empty for the other families and text models."""
    from engine.model.block_context import BidirectionalImages
    from engine.vision import vision_spec

    spec = vision_spec(architecture_of(model))
    if spec is None:
        return {}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    is_image = torch.eq(ids, int(getattr(base.config, spec.image_token))).long()
    if spec.positions == "mrope":
        return {"mm_token_type_ids": is_image}
    if isinstance(spec.text.context, BidirectionalImages):
        return {"token_type_ids": is_image}
    return {}


def rope_holder(model: Any) -> Any:
    """The submodule that keeps Qwen2.5-VL's ``rope_deltas`` after a forward with images (None:
    a model without 3-D rotary positions)."""
    return next((m for m in model.modules() if hasattr(m, "rope_deltas")), None)


def next_position(holder: Any, prompt: Prompt) -> int:
    """The position id of the first new token after ``prompt``'s forward: its length, moved by
    the rotary offset its images left (Qwen2.5-VL counts an image's tokens as fewer positions)."""
    if holder is None or not prompt.images or holder.rope_deltas is None:
        return len(prompt.ids)
    return len(prompt.ids) + int(holder.rope_deltas.reshape(-1)[0])


def on_device(inputs: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Image inputs on the model's device, floating ones in its dtype (the processor makes fp32)."""
    param = next(model.parameters())
    return {
        k: v.to(param.device, dtype=param.dtype if v.is_floating_point() else v.dtype)
        for k, v in inputs.items()
    }


def image_inputs(processor: Any, model: Any, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
    """The image tensors of a row's ``images`` for a forward of ``model``: what the processor gives
    besides the ids, for a row it did not tokenize here (``engine.data`` encodes a row with images
    with its image tokens expanded). With ``token_types`` of its ids, the forward's inputs.

    Raises:
        ValueError: an image that cannot be read.
    """
    from engine.vision import open_image

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    accepted = inspect.signature(base.forward).parameters
    out = processor.image_processor(images=[[open_image(b) for b in images]], return_tensors="pt")
    return {k: v for k, v in out.items() if k in accepted and isinstance(v, torch.Tensor)}
