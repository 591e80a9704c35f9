"""Chatting with a model: the chat template, a KV-cached sampling loop, text streamed in pieces.

``chat_stream(model, tokenizer, messages, sampling=...)`` renders the conversation through the
model's chat template (``engine.data.encode.ensure_chat_template``: the documented fallback where a
tokenizer has none), then decodes one token at a time, each step feeding only the new token and
the model's own KV cache (``cache``). Each step picks the next token by temperature and top-p
(nucleus) sampling, or greedily at temperature 0 (exactly ``model.generate(do_sample=False)``).
It yields ``Piece`` objects (new text) and ends with one ``Finish`` (why it stopped, token counts).
The API's playground and ``roundhouse chat`` both use it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.inference.images import (
    Prompt,
    chat_prompt,
    next_position,
    on_device,
    rope_holder,
)

ROLES = ("system", "user", "assistant")
MAX_TOKENS = 4096  # the most new tokens one answer may ask for
MAX_TEMPERATURE = 2.0
# end-of-turn markers of common chat templates: a turn ends there even where the model's
# generation config names only the end of the whole text
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked.

    temperature: 0 picks the most likely token (greedy); above, logits are divided by it.
    top_p: sample only among the most likely tokens whose probabilities sum to ``top_p``.
    max_tokens: the most new tokens of one answer.
    seed: the random generator's seed (None: a fresh one each time).
    """

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None

    def check(self) -> None:
        """Raises:
        ValueError: a value out of range; the message names the field and the value."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be from 0 to {MAX_TEMPERATURE:g} (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be above 0 and at most 1 (got {self.top_p})")
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens: must be from 1 to {MAX_TOKENS} (got {self.max_tokens})")


@dataclass(frozen=True)
class Piece:
    """New text of the answer (never a partial UTF-8 character)."""

    text: str


@dataclass(frozen=True)
class Finish:
    """The end of an answer: ``stop`` (an end-of-turn token), ``length`` (``max_tokens`` or the
    model's context), or ``cancelled``."""

    reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int


def check_messages(messages: list[dict[str, Any]]) -> None:
    """A conversation's shape: each message's ``content`` text, or a list of ``text`` and ``image``
    parts (``engine.inference.images``).

    Raises:
        ValueError: not a conversation that ends with a user turn, or a bad part (the message
            names the turn or the part)."""
    if not messages:
        raise ValueError("messages: give at least one message")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"messages.{i}.role: must be one of {', '.join(ROLES)} (got {m.get('role')!r})")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages.{i}.content: must be text or a list of parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind == "image" and isinstance(part.get("image"), bytes | bytearray):
                if m["role"] != "user":
                    raise ValueError(f"messages.{i}.content.{j}: only a user message may hold an image")
                continue
            raise ValueError(
                f"messages.{i}.content.{j}: a part is {{type: text, text}} or {{type: image, image}}"
            )
    if messages[-1]["role"] != "user":
        raise ValueError(f"messages.{len(messages) - 1}.role: the last message must be the user's")


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The conversation rendered through the chat template, ready for the assistant's turn.

    Raises:
        ValueError: an image part (a text model's prompt; ``images.chat_prompt`` takes images).
    """
    return chat_prompt(tokenizer, messages).ids


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end an answer: the generation config's EOS ids, the tokenizer's EOS, and
    the end-of-turn marker of the template when the tokenizer has it as a special token."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    for token in END_OF_TURN:
        if token in specials:
            ids.add(int(tokenizer.convert_tokens_to_ids(token)))
    return ids


def context_length(model: Any) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's logits ``[vocab]``."""
    if sampling.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the likelier tokens
        sorted_probs[before >= sampling.top_p] = 0.0  # the first token is always kept
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    model: Any,
    ids: list[int] | Prompt,
    sampling: Sampling,
    *,
    stop: set[int],
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """New token ids, one model step each, with the model's own KV cache; ends after a ``stop``
    token (yielded), after ``max_tokens``, at the model's context length, or when ``cancel`` is set.

    ``ids`` may be a ``Prompt`` with images: its image tensors go into the first forward, and each
    later step's position id is counted from where that forward left it (``next_position``).

    Raises:
        ValueError: ``ids`` is empty or already fills the model's context.
    """
    sampling.check()
    prompt = ids if isinstance(ids, Prompt) else Prompt(list(ids))
    limit = context_length(model)
    if not prompt.ids:
        raise ValueError("messages: the rendered conversation is empty")
    if limit is not None and len(prompt.ids) >= limit:
        raise ValueError(
            f"messages: the conversation is {len(prompt.ids)} tokens; the model's context is {limit}"
        )
    generator = torch.Generator()
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    budget = sampling.max_tokens if limit is None else min(sampling.max_tokens, limit - len(prompt.ids))
    device = next(model.parameters()).device
    with torch.inference_mode():
        step = torch.tensor([prompt.ids], device=device)
        mask = torch.ones_like(step)
        extra = on_device(prompt.inputs, model)
        cache = None
        position = 0
        for _ in range(budget):
            if cancel is not None and cancel.is_set():
                return
            # only the new tokens go in; the cache holds every earlier position's keys and values
            out = model(
                input_ids=step, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1, **extra
            )
            if cache is None:
                position = next_position(rope_holder(model), prompt)
            cache = out.cache
            token = pick(out.logits[0, -1], sampling, generator)
            yield token
            if token in stop:
                return
            step = torch.tensor([[token]], device=device)
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            extra = {"position_ids": torch.tensor([[position]], device=device)}
            position += 1


class TextStream:
    """Decodes a growing list of token ids into text pieces: each piece is the text the new
    tokens added, held back while it ends in an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def rest(self) -> str:
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        piece = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return piece


def chat_stream(
    model: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    sampling: Sampling,
    cancel: threading.Event | None = None,
    processor: Any = None,
) -> Iterator[Piece | Finish]:
    """The assistant's answer to ``messages``, as text pieces, then one ``Finish``.

    Args:
        model: a causal LM (a ``PeftModel`` too), in eval mode.
        tokenizer: its tokenizer; given the fallback chat template if it has none.
        messages: ``[{"role", "content"}]``, ending with a user turn; content as text or a list
            of text and image parts (``engine.inference.images``).
        sampling: temperature, top-p, max tokens, seed.
        cancel: set it (from any thread) to stop after the current token.
        processor: a VLM's processor, for images (None: a text model, which refuses them).

    Raises:
        ValueError: bad messages or sampling values, an image a text model cannot take, or a
            conversation longer than the context.
    """
    check_messages(messages)
    sampling.check()
    prompt = chat_prompt(tokenizer, messages, processor=processor)
    stop = stop_ids(model, tokenizer)
    text = TextStream(tokenizer)
    count = 0
    reason: Literal["stop", "length", "cancelled"] = "length"
    for token in sample(model, prompt, sampling, stop=stop, cancel=cancel):
        count += 1
        if token in stop:
            reason = "stop"
            break
        piece = text.add(token)
        if piece:
            yield Piece(piece)
    else:
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
    rest = text.rest()
    if rest:
        yield Piece(rest)
    yield Finish(reason, len(prompt.ids), count)
