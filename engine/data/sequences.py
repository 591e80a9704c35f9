"""Token sequences of examples: the model's chat template, the tokens trained, and how a preview
shows them.

Chat and instruction rows are rendered with ``tokenizer.apply_chat_template``; the loss covers
exactly the assistant turns (their content and the template's end-of-turn marker), found by
rendering each conversation prefix and mapping character spans to tokens. Prompt/completion rows
are plain text (prompt + completion + EOS) with the loss on the completion; text rows train on
every token. A preference row becomes two sequences (``EncodedPair``), the prompt with the preferred
answer and the prompt with the rejected one, each with the loss on its answer alone (its last
assistant turn, end-of-turn marker included), never on assistant turns of the prompt. An unpaired
preference row (KTO) is one such sequence and its label (``EncodedUnpaired``). A prompt row
(GRPO) is its prompt alone (``PromptItem``), with the generation prompt of a chat prompt.

A row with images (``Example.images``) encodes with a vision-language model's processor, given
where a tokenizer is: each image's mark becomes the family's placeholder (``image_placeholder``),
the conversation is rendered with the processor's tokenizer's chat template, and the processor
expands each placeholder into the image's tokens (as many as the image's size gives); the
assistant turns' character spans move by what the expansions before them added, and the loss
covers them alone. The row's image bytes travel with its sequence (``Encoded.images``).

Fallback: a tokenizer without a chat template gets ``FALLBACK_CHAT_TEMPLATE`` (ChatML-style
``<|im_start|>role ... <|im_end|>`` turns written as plain text, the end of each assistant turn
followed by the EOS token), recorded with the exported tokenizer so inference renders the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.data.images import IMAGE_MARK, thumbnail
from engine.data.rows import Example

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Encoded:
    """Token ids and labels (-100 where no loss is taken) of one example."""

    line: int
    input_ids: list[int]
    labels: list[int]
    length: int  # before truncation
    truncated: bool
    # the row's image file bytes, in the order of its placeholders (a text row: none)
    images: tuple[bytes, ...] = ()

    @property
    def trained_tokens(self) -> int:
        return sum(1 for t in self.labels[1:] if t != -100)


@dataclass
class EncodedPair:
    """The two sequences of one preference row: its prompt and each answer, the loss on the answer."""

    line: int
    chosen: Encoded
    rejected: Encoded


@dataclass
class EncodedUnpaired:
    """One unpaired preference row (KTO): its prompt and completion as one sequence, the loss on
    the completion alone (as one side of a pair), and whether the completion is desirable."""

    line: int
    sequence: Encoded
    label: bool

    def _first_trained(self) -> int:
        labels = self.sequence.labels
        return next((i for i, t in enumerate(labels) if t != -100), len(labels))

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens before the completion (the chat template's, the prompt's)."""
        return self.sequence.input_ids[: self._first_trained()]

    @property
    def completion_ids(self) -> list[int]:
        """The completion's tokens (with the template's end-of-turn marker), as far as kept."""
        return self.sequence.input_ids[self._first_trained() :]


# what a row encodes to: one sequence, a preference pair, or an unpaired row's sequence and label
EncodedRow = Encoded | EncodedPair | EncodedUnpaired


@dataclass(frozen=True)
class PromptItem:
    """One prompt row encoded: its token ids and the fields its graders read.

    Attributes:
        line: the row's line (or Parquet row) in its file.
        input_ids: the prompt's token ids (a chat prompt with its generation prompt).
        text: the prompt as rendered, for the job page's samples.
        fields: the row's other fields (``item`` to a grader).
        truncated: the prompt was longer than its budget and lost its first tokens.
    """

    line: int
    input_ids: list[int]
    text: str
    fields: dict[str, Any]
    truncated: bool = False


# the text each processor expands into one image's tokens, where it is not the processor's image token
_PLACEHOLDERS = {
    "Qwen2_5_VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen3VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
}


def is_processor(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a vision-language model's processor (it has an image processor)."""
    return getattr(tokenizer, "image_processor", None) is not None


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer itself, or a processor's tokenizer."""
    return tokenizer.tokenizer if is_processor(tokenizer) else tokenizer


def image_placeholder(processor: Any) -> str:
    """The text that stands for one image in a chat rendered for ``processor``: Qwen2.5-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``, Idefics3's
    ``<image>``."""
    return _PLACEHOLDERS.get(type(processor).__name__) or str(processor.image_token)


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer (a processor's tokenizer) without a chat template the documented fallback."""
    tokenizer = text_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool = False) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], *, last_only: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (``last_only``:
    of the last message alone, an assistant turn).

    Raises:
        ValueError: the template does not render a conversation's prefixes as prefixes.
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (last_only and i < len(messages) - 1):
            continue
        before = _render(tokenizer, messages[:i], generation=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError("the chat template does not render conversation prefixes as prefixes")
        spans.append((len(before), len(upto)))
    return full, spans


def encode(example: Example, tokenizer: Any, max_length: int) -> Encoded:
    """Token ids and loss labels of one example, truncated to ``max_length``.

    A preference row encodes as its prompt and preferred answer, an unpaired preference row as its
    prompt and completion, the loss on that answer alone. ``tokenizer`` may be a vision-language
    model's processor: a row with images needs one.

    Raises:
        ValueError: a chat template that renders prefixes differently; a row with images and no
            processor, or whose image tokens would be cut by ``max_length``.
    """
    if example.images:
        return encode_images(example, tokenizer, max_length)
    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)
    if example.messages is not None:
        answer_only = example.rejected is not None or example.label is not None
        text, spans = assistant_spans(tokenizer, example.messages, last_only=answer_only)
        if is_processor(processor):
            _check_placeholders(processor, text)
        special = False
    elif example.prompt is not None and example.completion is not None:
        text = example.prompt + example.completion + (tokenizer.eos_token or "")
        spans = [(len(example.prompt), len(text))]
        special = True
    else:
        text = (example.text or "") + (tokenizer.eos_token or "")
        spans = [(0, len(text))]
        special = True
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"], strict=True):
        trained = b > a and any(s <= a < e for s, e in spans)
        labels.append(tok if trained else -100)
    n = len(ids)
    return Encoded(example.line, ids[:max_length], labels[:max_length], n, n > max_length)


def encode_images(example: Example, processor: Any, max_length: int) -> Encoded:
    """A chat row with images, encoded by a vision-language model's processor (the module's
    docstring says how).

    Raises:
        ValueError: not a processor, images not read, a chat template that renders prefixes
            differently, a processor that refuses the row, image tokens cut by ``max_length``.
    """
    from engine.vision.pixels import open_image  # PIL on first use: text rows never load it

    if not is_processor(processor):
        raise ValueError(
            f"{example.images[0].field}: an image, but the model is a text model (images train a "
            "vision-language model)"
        )
    if example.messages is None:
        raise ValueError("only chat rows hold images")
    data = tuple(ref.data for ref in example.images if ref.data is not None)
    if len(data) != len(example.images):
        raise ValueError(f"line {example.line}: the row's images were not read")
    placeholder = image_placeholder(processor)
    for m in example.messages:
        _check_placeholders(processor, m["content"])
    messages = [{**m, "content": m["content"].replace(IMAGE_MARK, placeholder)} for m in example.messages]
    text, spans = assistant_spans(processor.tokenizer, messages)
    try:
        out = processor(
            text=[text],
            images=[[open_image(b) for b in data]],
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_text_replacement_offsets=True,
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the model's processor refuses the row: {exc}") from None
    replaced = sorted(out["text_replacement_offsets"][0], key=lambda r: r["span"][0])
    if len(replaced) != len(data):
        raise ValueError(f"{len(replaced)} image placeholders in the rendered text for {len(data)} images")

    def moved(at: int) -> int:  # a position of the rendered text in the expanded text
        # a replacement's new end less its old end: what every expansion up to it added
        return at + max((r["new_span"][1] - r["span"][1] for r in replaced if r["span"][1] <= at), default=0)

    spans = [(moved(a), moved(b)) for a, b in spans]
    ids: list[int] = [int(t) for t in out["input_ids"][0]]
    offsets = [(int(a), int(b)) for a, b in out["offset_mapping"][0]]
    labels = [
        tok if b > a and any(s <= a < e for s, e in spans) else -100
        for tok, (a, b) in zip(ids, offsets, strict=True)
    ]
    last_image = replaced[-1]["new_span"][1]
    tokens_of_images = sum(1 for a, _ in offsets if a < last_image)
    if tokens_of_images > max_length:
        raise ValueError(
            f"the images' tokens end at token {tokens_of_images}, past max_length={max_length}: "
            "raise data.max_length or give smaller images"
        )
    n = len(ids)
    return Encoded(example.line, ids[:max_length], labels[:max_length], n, n > max_length, data)


def _check_placeholders(processor: Any, text: str) -> None:
    """Refuse text that holds the model's image placeholder token: the processor would take it for
    an image.

    Raises:
        ValueError: naming the token.
    """
    token = str(processor.image_token)
    if token in text:
        raise ValueError(
            f"the text holds {token!r}, the model's image placeholder: give images as image parts (or "
            "as '<image>' with an images column)"
        )


def rejected_example(example: Example) -> Example:
    """A preference row with its answers swapped: the prompt and the rejected answer."""
    if example.messages is None or example.rejected is None:
        raise ValueError(f"line {example.line}: not a preference row")
    answer = {"role": "assistant", "content": example.rejected}
    return Example(
        example.line, messages=[*example.messages[:-1], answer], rejected=example.messages[-1]["content"]
    )


def encode_pair(example: Example, tokenizer: Any, max_length: int) -> EncodedPair:
    """Both sequences of a preference row, each truncated to ``max_length``.

    Raises:
        ValueError: not a preference row, or a chat template that renders prefixes differently.
    """
    rejected = rejected_example(example)
    return EncodedPair(
        example.line, encode(example, tokenizer, max_length), encode(rejected, tokenizer, max_length)
    )


def encode_prompt(example: Example, tokenizer: Any, max_prompt_tokens: int) -> PromptItem:
    """A prompt row's token ids, keeping its last ``max_prompt_tokens`` (the end of a prompt is
    what the completion follows).

    Raises:
        ValueError: the row is not a prompt row, or its prompt encodes to no token.
    """
    tokenizer = text_tokenizer(tokenizer)
    if example.messages is not None:
        text = _render(tokenizer, example.messages, generation=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    elif example.prompt is not None:
        text = example.prompt
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    else:
        raise ValueError("not a prompt row: give 'messages' ending with a user turn, or 'prompt'")
    if not ids:
        raise ValueError("the prompt encodes to no token")
    kept = ids[-max_prompt_tokens:]
    return PromptItem(example.line, kept, text, dict(example.fields or {}), len(kept) < len(ids))


def encode_prompt_row(example: Example, tokenizer: Any, max_length: int) -> Encoded:
    """A prompt row's prompt as an ``Encoded`` without label tokens: its last ``max_length``
    tokens, and its whole length (its completions are sampled in training).

    Raises:
        ValueError: not a prompt row, or a prompt of no token.
    """
    whole = encode_prompt(example, tokenizer, 1 << 62)
    kept = whole.input_ids[-max_length:]
    n = len(whole.input_ids)
    return Encoded(example.line, kept, [-100] * len(kept), n, len(kept) < n)


def encode_unpaired(example: Example, tokenizer: Any, max_length: int) -> EncodedUnpaired:
    """An unpaired preference row (KTO): its prompt and completion, the loss on the completion.

    Raises:
        ValueError: not such a row, or a chat template that renders prefixes differently.
    """
    if example.messages is None or example.label is None:
        raise ValueError(f"line {example.line}: not an unpaired preference row")
    return EncodedUnpaired(example.line, encode(example, tokenizer, max_length), example.label)


def token_view(tokenizer: Any, ids: list[int], labels: list[int]) -> list[dict[str, Any]]:
    """Each token as its text and whether it is trained on (a preview's row)."""
    tokenizer = text_tokenizer(tokenizer)
    return [
        {"text": tokenizer.decode([t]), "trained": lab != -100} for t, lab in zip(ids, labels, strict=True)
    ]


def sequence_view(tokenizer: Any, encoded: Encoded) -> dict[str, Any]:
    """A preview row of one sequence: its line, its tokens and whether it was cut; a row with
    images also its images as small thumbnails (JPEG data URLs), in order."""
    tokens = token_view(tokenizer, encoded.input_ids, encoded.labels)
    view: dict[str, Any] = {"line": encoded.line, "tokens": tokens, "truncated": encoded.truncated}
    if encoded.images:
        view["images"] = [thumbnail(b) for b in encoded.images]
    return view


def pair_view(tokenizer: Any, pair: EncodedPair) -> dict[str, Any]:
    """A preview row of a preference row: the prompt the two sequences share (up to the first
    trained token of either, and no further than their ids agree), then each answer's tokens."""
    chosen, rejected = pair.chosen, pair.rejected
    cut = 0
    while (
        cut < min(len(chosen.input_ids), len(rejected.input_ids))
        and chosen.input_ids[cut] == rejected.input_ids[cut]
        and chosen.labels[cut] == rejected.labels[cut] == -100
    ):
        cut += 1

    def answer(e: Encoded) -> dict[str, Any]:
        return {"tokens": token_view(tokenizer, e.input_ids[cut:], e.labels[cut:]), "truncated": e.truncated}

    return {
        "line": pair.line,
        "tokens": token_view(tokenizer, chosen.input_ids[:cut], chosen.labels[:cut]),
        "truncated": chosen.truncated or rejected.truncated,
        "chosen": answer(chosen),
        "rejected": answer(rejected),
    }
