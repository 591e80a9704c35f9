"""Answers about images (``engine/inference/images.py`` with ``chat`` and ``batching``): for each
tiny VLM family, greedy answers to a conversation with images (alone, and batched with text and
with other images, of other sizes) equal ``model.generate`` on the processor's inputs for the same
conversation; a LoRA adapter on a VLM answers as peft's model does; bad images and images for a
text model are refused naming the field."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.inference.batching import Ask, Batcher, End, Event, Model, Token
from engine.inference.chat import Finish, Piece, Sampling, chat_stream, sample, stop_ids
from engine.inference.images import Prompt, chat_prompt, next_position, rope_holder
from tests.engine.tiny import tiny_tokenizer
from tests.engine.tiny_vision import VLM_FAMILIES, png, tiny_processor, tiny_vlm

TOKENS = 12


def ask_about(image: bytes, question: str = "what is it?", *more: bytes) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    content += [{"type": "image", "image": b} for b in more]
    return [{"role": "system", "content": "look closely"}, {"role": "user", "content": content}]


def generated(model: Any, prompt: Prompt, tokens: int = TOKENS, stop: set[int] | None = None) -> list[int]:
    """``model.generate``'s greedy tokens for the prompt's ids and image tensors."""
    return scored(model, prompt, tokens, stop)[0]


def scored(
    model: Any, prompt: Prompt, tokens: int = TOKENS, stop: set[int] | None = None
) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens and each one's log-probability."""
    x = torch.tensor([prompt.ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            **prompt.inputs,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=sorted(stop) if stop else None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    ids = [int(t) for t in out.sequences[0, len(prompt.ids) :]]
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, ids, strict=True)
    ]
    return ids, logprobs


def vlm(family: str) -> tuple[Any, Any]:
    return tiny_vlm(family).eval(), tiny_processor(family)


def prompt_of(model: Any, processor: Any, messages: list[dict[str, Any]]) -> Prompt:
    return chat_prompt(processor.tokenizer, messages, processor=processor)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_greedy_answers_about_images_equal_generate(family: str) -> None:
    model, processor = vlm(family)
    for messages in (ask_about(png(24, 16, 1)), ask_about(png(40, 28, 2), "and these?", png(12, 20, 3))):
        prompt = prompt_of(model, processor, messages)
        assert prompt.images and "pixel_values" in prompt.inputs
        mine = list(sample(model, prompt, Sampling(temperature=0.0, max_tokens=TOKENS), stop=set()))
        assert mine == generated(model, prompt)
    if family == "qwen2_5_vl":  # its images move the later positions: the decode steps must follow
        assert next_position(rope_holder(model), prompt) < len(prompt.ids)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_chat_stream_answers_an_image_as_generate_does(family: str) -> None:
    model, processor = vlm(family)
    tokenizer = processor.tokenizer
    messages = ask_about(png(20, 20, 4))
    events = list(
        chat_stream(
            model, tokenizer, messages, sampling=Sampling(temperature=0.0, max_tokens=8), processor=processor
        )
    )
    finish = events[-1]
    assert isinstance(finish, Finish)
    prompt = prompt_of(model, processor, messages)
    expected = generated(model, prompt, 8, stop_ids(model, tokenizer))
    text = "".join(e.text for e in events if isinstance(e, Piece))
    assert text == tokenizer.decode(
        [t for t in expected if t not in stop_ids(model, tokenizer)], skip_special_tokens=True
    )
    assert finish.prompt_tokens == len(prompt.ids)


def test_an_image_changes_the_answer() -> None:
    model, processor = vlm("qwen2_5_vl")
    first = prompt_of(model, processor, ask_about(png(24, 16, 1)))
    other = prompt_of(model, processor, ask_about(png(24, 16, 9)))
    assert first.ids == other.ids  # the same tokens: only the pixels differ
    with torch.no_grad():
        a = model(input_ids=torch.tensor([first.ids]), **first.inputs).logits[0, -1]
        b = model(input_ids=torch.tensor([other.ids]), **other.inputs).logits[0, -1]
    assert not torch.allclose(a, b)


class Answers:
    def __init__(self, n: int = 1) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.ends: dict[int, End] = {}
        self.n, self.done = n, threading.Event()

    def emit(self, event: Event) -> None:
        if isinstance(event, Token):
            self.tokens[event.index].append(event.token)
            if event.logprob is not None:
                self.logprobs[event.index].append(event.logprob)
        else:
            self.ends[event.index] = event
            if len(self.ends) == self.n:
                self.done.set()

    def wait(self) -> Answers:
        assert self.done.wait(60), "the answer did not end"
        return self


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_batch_of_image_and_text_prompts_answers_as_generate(family: str) -> None:
    model, processor = vlm(family)
    tokenizer = processor.tokenizer
    conversations = [
        ask_about(png(24, 16, 1)),
        [{"role": "user", "content": "no picture here, just words"}],
        ask_about(png(36, 12, 5), "two of them?", png(16, 16, 6)),
    ]
    prompts = [prompt_of(model, processor, m) for m in conversations]
    assert not prompts[1].images and len({len(p.ids) for p in prompts}) == 3
    batcher, served = Batcher(), Model(model, name=family)
    answers = [Answers(n=2) for _ in prompts]
    for prompt, a in zip(prompts, answers, strict=True):  # queued before the thread starts: one batch
        ask = Ask(
            prompt.ids, Sampling(0.0, 1.0, TOKENS), tokenizer, a.emit, n=2, logprobs=0, inputs=prompt.inputs
        )
        batcher.submit(served, ask)
    batcher.start()
    try:
        for prompt, a in zip(prompts, answers, strict=True):
            a.wait()
            tokens, logprobs = scored(model, prompt)
            assert a.tokens[0] == a.tokens[1] == tokens
            # the same numbers, not only the same argmax: positions and masks are right
            assert a.logprobs[0] == pytest.approx(logprobs, abs=1e-4)
    finally:
        batcher.close()


def test_a_lora_adapter_on_a_vlm_answers_as_peft_does(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(3)
    lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    get_peft_model(tiny_vlm("qwen2_5_vl"), lora).save_pretrained(str(tmp_path / "adapter"))
    model, processor = vlm("qwen2_5_vl")
    prompt = prompt_of(model, processor, ask_about(png(24, 16, 1)))
    served = Model(model, name="tiny vlm")
    name = served.adapter(str(tmp_path / "adapter"))
    batcher = Batcher()
    tuned, plain = Answers(), Answers()
    for adapter, a in ((name, tuned), (None, plain)):
        batcher.submit(
            served,
            Ask(
                prompt.ids,
                Sampling(0.0, 1.0, TOKENS),
                processor.tokenizer,
                a.emit,
                adapter=adapter,
                inputs=prompt.inputs,
            ),
        )
    batcher.start()
    try:
        reference = PeftModel.from_pretrained(tiny_vlm("qwen2_5_vl"), str(tmp_path / "adapter")).eval()
        assert tuned.wait().tokens[0] == generated(reference, prompt)
        assert plain.wait().tokens[0] == generated(tiny_vlm("qwen2_5_vl").eval(), prompt)
        assert tuned.tokens != plain.tokens  # the adapter is applied
    finally:
        batcher.close()


def test_bad_images_and_images_for_a_text_model_name_the_field() -> None:
    model, processor = vlm("idefics3")
    with pytest.raises(ValueError, match=r"^messages\.1\.content\.0: not a readable image"):
        prompt_of(model, processor, ask_about(b"not a picture"))
    with pytest.raises(ValueError, match=r"^messages\.1\.content\.2: the image is empty"):
        prompt_of(model, processor, ask_about(png(8, 8), "two?", b""))
    text_model = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^messages\.1\.content\.0: this model reads no images"):
        chat_prompt(text_model, ask_about(png(8, 8)))
    # text parts alone are text, for any model
    plain = [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
    ]
    assert (
        chat_prompt(text_model, plain).ids
        == chat_prompt(text_model, [{"role": "user", "content": "hi there"}]).ids
    )
    from engine.inference.chat import check_messages

    with pytest.raises(ValueError, match=r"^messages\.0\.content\.0: only a user message may hold an image"):
        check_messages(
            [
                {"role": "assistant", "content": [{"type": "image", "image": png(8, 8)}]},
                {"role": "user", "content": "x"},
            ]
        )
    with pytest.raises(ValueError, match=r"^messages\.0\.content\.1: a part is"):
        check_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]}])
