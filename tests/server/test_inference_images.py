"""Images in chat requests: the worker's inference service (``server/worker/inference.py``) answers
a conversation with images on a VLM base model, a LoRA adapter on it and a full fine-tuned VLM
exactly as ``model.generate`` does on the processor's inputs; a text-only model refuses an image
with a 400 naming the part before it loads; the API's ``image_url`` parts
(``server/api/openai/images.py``) take data URLs, and http(s) URLs only where the operator allows."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from engine.inference.images import chat_prompt
from engine.model.loading import load_model, load_processor_for
from server.api.openai.completion_shapes import ChatMessage, ImagePart
from server.api.openai.images import fetch_image, image_bytes, payload_messages
from server.errors import ApiError
from server.worker.inference import Service, create_app
from tests.engine.tiny import tiny_model_folder
from tests.engine.tiny_vision import png, tiny_vlm, tiny_vlm_folder
from tests.utils.aio import run_coroutine as run

TOKEN = "secret"
TOKENS = 10


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat(image: bytes, question: str = "what is it?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "data": b64(image)}, {"type": "text", "text": question}],
        }
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("vlms")
    base = tiny_vlm_folder(root / "base", "qwen2_5_vl")
    tuned = tiny_vlm("qwen2_5_vl", seed=5)  # a "full fine-tune": other weights, the same processor
    tuned.save_pretrained(root / "full")
    torch.manual_seed(3)
    lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    get_peft_model(tiny_vlm("qwen2_5_vl"), lora).save_pretrained(str(root / "adapter"))
    for folder in (root / "full", root / "adapter"):  # the tokenizer and processor files, as exports have
        for path in base.iterdir():
            if path.name not in ("config.json", "generation_config.json", "model.safetensors"):
                (folder / path.name).write_bytes(path.read_bytes())
    return {
        "base": base,
        "full": root / "full",
        "adapter": root / "adapter",
        "text": tiny_model_folder(root / "text"),
    }


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[Service, TestClient]]:
    svc = Service(token=TOKEN, gpus=0, cpu_max_params=10**9, release_grace_s=1.0)
    with TestClient(create_app(svc)) as client:
        yield svc, client
    svc.batcher.close()


def post(client: TestClient, **body: Any) -> tuple[int, list[dict[str, Any]]]:
    r = client.post("/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    if r.status_code != 200:
        return r.status_code, [r.json()]
    return 200, [json.loads(line) for line in r.text.splitlines() if line.strip()]


def answer(lines: list[dict[str, Any]]) -> str:
    return "".join(line["text"] for line in lines if line["type"] in ("token", "end"))


def expected(model: Any, processor: Any, image: bytes, question: str = "what is it?") -> str:
    """``model.generate``'s greedy answer on the processor's inputs, special tokens left out."""
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}
    ]
    prompt = chat_prompt(processor.tokenizer, messages, processor=processor)
    x = torch.tensor([prompt.ids])
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            **prompt.inputs,
            max_new_tokens=TOKENS,
            do_sample=False,
        )
    return str(processor.tokenizer.decode(out[0, len(prompt.ids) :], skip_special_tokens=True))


def test_a_base_vlm_a_lora_adapter_and_a_full_fine_tune_answer_images_as_generate(
    folders: dict[str, Path], service: tuple[Service, TestClient]
) -> None:
    from peft import PeftModel

    _, client = service
    image = png(28, 20, 7)
    sampling = {"temperature": 0.0, "max_tokens": TOKENS}
    processor = load_processor_for(folders["base"])
    cases = {
        "base": ({"model": str(folders["base"])}, load_model(folders["base"])),
        "adapter": (
            {"model": str(folders["base"]), "adapter": str(folders["adapter"])},
            PeftModel.from_pretrained(load_model(folders["base"]), str(folders["adapter"])),
        ),
        "full": ({"model": str(folders["full"])}, load_model(folders["full"])),
    }
    answers = {}
    for name, (where, reference) in cases.items():
        status, lines = post(client, name=name, messages=chat(image), **where, **sampling)
        assert status == 200, lines
        assert (
            lines[0]["type"] == "start"
            and lines[-1]["type"] == "end"
            and lines[-1]["reason"] in ("stop", "length")
        )
        answers[name] = answer(lines)
        assert answers[name] == expected(reference, processor, image), name
    assert len(set(answers.values())) == 3  # the adapter and the other weights are applied
    # text alone still works on a VLM
    status, lines = post(
        client,
        name="base",
        model=str(folders["base"]),
        messages=[{"role": "user", "content": "hi"}],
        **sampling,
    )
    assert status == 200 and lines[-1]["type"] == "end"


def test_an_image_for_a_text_model_or_an_unreadable_one_is_a_400_naming_the_part(
    folders: dict[str, Path], service: tuple[Service, TestClient]
) -> None:
    svc, client = service
    text = str(folders["text"])
    status, (error,) = post(client, name="tiny", model=text, messages=chat(png(8, 8)), max_tokens=4)
    assert status == 400 and error["param"] == "messages.0.content.0", error
    assert "text-only" in error["message"] and "tiny" in error["message"]
    assert text not in svc.models.loaded  # refused before the model loads
    base = str(folders["base"])
    status, (error,) = post(client, name="vlm", model=base, messages=chat(b"not an image"), max_tokens=4)
    assert (
        status == 400
        and error["param"] == "messages.0.content.0"
        and "not a readable image" in error["message"]
    )
    bad = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "data": "%%%"}]}]
    status, (error,) = post(client, name="vlm", model=base, messages=bad, max_tokens=4)
    assert status == 400 and error["param"] == "messages.0.content.1" and "base64" in error["message"]


def image_message(url: str) -> ChatMessage:
    return ChatMessage.model_validate(
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    )


def test_image_url_parts_take_data_urls_and_http_only_where_allowed() -> None:
    picture = png(10, 10, 1)
    url = f"data:image/png;base64,{b64(picture)}"
    (message,) = run(payload_messages([image_message(url)], allow_urls=False))
    assert message == {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image", "data": b64(picture)}],
    }
    # text-only parts stay text; developer is system
    developer = ChatMessage.model_validate(
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]}
    )
    assert run(payload_messages([developer], allow_urls=False)) == [{"role": "system", "content": "be brief"}]
    param = "messages.0.content.1.image_url.url"
    for bad, why in (
        ("https://example.com/cat.png", "ROUNDHOUSE_ALLOW_IMAGE_URLS"),
        ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
        ("data:image/png;base64,!!!", "base64 is invalid"),
        ("ftp://example.com/cat.png", "data:image/"),
    ):
        with pytest.raises(ApiError) as refused:
            run(payload_messages([image_message(bad)], allow_urls=False))
        assert refused.value.status == 400 and refused.value.param == param and why in refused.value.message


def test_an_allowed_http_image_is_fetched_once_and_its_failures_name_the_part() -> None:
    picture = png(6, 6, 2)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/cat.png":
            return httpx.Response(200, content=picture)
        return httpx.Response(404)

    async def fetch(url: str) -> bytes:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await fetch_image(client, url, "messages.0.content.0.image_url.url")

    assert run(fetch("http://images.test/cat.png")) == picture
    with pytest.raises(ApiError) as missing:
        run(fetch("http://images.test/dog.png"))
    assert missing.value.param == "messages.0.content.0.image_url.url" and "HTTP 404" in missing.value.message
    part = ImagePart.model_validate({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}})
    with pytest.raises(ApiError) as unreachable:  # allowed, but nothing answers there
        run(image_bytes(part, "messages.0.content.0.image_url.url", allow_urls=True))
    assert "could not be fetched" in unreachable.value.message


def sse(text: str) -> list[tuple[str, Any]]:
    found = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            found.append((fields.get("event", "message"), json.loads(fields["data"])))
    return found


def test_the_playground_takes_image_parts_and_names_a_bad_one(client: TestClient) -> None:
    """``POST /api/generate`` takes the chat completions' parts; a refused image is the stream's
    error event, naming the part (no worker is asked)."""
    message = image_message("https://example.com/cat.png").model_dump(exclude_none=True)
    r = client.post("/api/generate", json={"model": "tiny", "messages": [message]})
    assert r.status_code == 200, r.text
    kind, data = sse(r.text)[-1]
    assert kind == "error" and data["error"]["param"] == "messages.0.content.1.image_url.url"
    assert "ROUNDHOUSE_ALLOW_IMAGE_URLS" in data["error"]["message"]
    video = {"role": "user", "content": [{"type": "video", "video": "x"}]}
    r = client.post("/api/generate", json={"model": "tiny", "messages": [video]})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("messages.0.content")
