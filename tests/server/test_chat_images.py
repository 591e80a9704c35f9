"""``/v1/chat/completions`` with ``image_url`` parts, driven by the pinned ``openai`` client against a
live server and a real worker: a tiny vision-language model's greedy answer about a data-URL image
equals ``model.generate`` on the processor's inputs (whole and streamed); the text-only model
refuses the image with a 400 naming the part; an http(s) URL is refused while the operator does not
allow fetching."""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest
import torch

from engine.inference.images import chat_prompt
from engine.model.loading import load_model, load_processor_for
from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import served
from tests.server.test_openai_api import LiveServer

__all__ = ["served"]  # the module's live server and worker

VLM = "tiny-vlm"


def ask(url: str, question: str = "what is it?") -> list[Any]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}],
        }
    ]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_a_vlm_answers_an_image_as_generate_does_and_a_text_model_refuses_it(
    served: tuple[LiveServer, WorkerProcess],
) -> None:
    server, _ = served
    folder = tiny_vlm_folder(server.settings.models_dir / VLM, "gemma3_vl")
    client = server.client()
    image = png(30, 22, 4)
    answer = client.chat.completions.create(
        model=VLM, messages=ask(data_url(image)), temperature=0, max_completion_tokens=8
    )
    processor, model = load_processor_for(folder), load_model(folder).eval()
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}],
        }
    ]
    prompt = chat_prompt(processor.tokenizer, messages, processor=processor)
    x = torch.tensor([prompt.ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), **prompt.inputs, max_new_tokens=8, do_sample=False
        )
    expected = processor.tokenizer.decode(out[0, len(prompt.ids) :], skip_special_tokens=True)
    assert answer.choices[0].message.content == expected
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt.ids)
    chunks = client.chat.completions.create(
        model=VLM, messages=ask(data_url(image)), temperature=0, max_completion_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ask(data_url(image)), max_tokens=4)
    assert refused.value.param == "messages.0.content.0" and "text-only" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=VLM, messages=ask("https://example.com/cat.png"), max_tokens=4)
    assert refused.value.param == "messages.0.content.0.image_url.url"
    assert "ROUNDHOUSE_ALLOW_IMAGE_URLS" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=VLM, messages=ask("data:image/png;base64,bm90IGFuIGltYWdl"), max_tokens=4
        )
    assert refused.value.param == "messages.0.content.0" and "not a readable image" in refused.value.message
