"""``/v1/chat/completions`` with ``image_url`` parts, driven by the pinned ``openai`` client against a
live server and a real worker: a tiny vision-language model's greedy answer about a data-URL image
equals ``model.generate`` on the processor's inputs (whole and streamed); the text-only model
refuses the image with a 400 naming the part; an http(s) URL is refused while the operator does not
allow fetching. A job's checkpoints of a VLM, a LoRA adapter and a full fine-tune, answer an image
in the playground as ``model.generate`` does on them."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from engine.inference.images import chat_prompt
from engine.model.loading import load_model, load_processor_for
from server.app import create_app
from server.services import checkpoints
from tests.engine.tiny_vision import png, tiny_vlm, tiny_vlm_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import served
from tests.server.test_openai_api import LiveServer
from tests.utils.jobs import start_job

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


def recorded_checkpoints(served: tuple[LiveServer, WorkerProcess], base: Path) -> tuple[str, dict[str, Path]]:
    """A queued job on the VLM ``base`` with two checkpoints on disk, recorded as the worker does: a
    LoRA adapter at step 2 and a full fine-tune at step 4 (the sending app's queue has no worker)."""
    from peft import LoraConfig, get_peft_model

    settings = served[0].settings
    app = create_app(settings.model_copy(update={"queue": "nobody"}))
    with TestClient(app) as sender:
        sender.headers["Authorization"] = f"Bearer {served[0].key}"
        rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)).encode()
        r = sender.post("/api/datasets", files={"file": ("rows.jsonl", rows)})
        assert r.status_code == 201, r.text
        job = start_job(sender, r.json()["id"], base_model=base.name, data={"max_length": 128})
        out = Path(job["config"]["output_dir"]) / "checkpoints"
        folders = {"adapter": out / "step_000002", "full": out / "step_000004"}
        torch.manual_seed(3)
        lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
        get_peft_model(tiny_vlm("qwen2_5_vl"), lora).save_pretrained(str(folders["adapter"]))
        tiny_vlm("qwen2_5_vl", seed=9).save_pretrained(folders["full"])
        for folder in folders.values():  # the tokenizer and processor files, as exports have
            for path in base.iterdir():
                if path.name not in ("config.json", "generation_config.json", "model.safetensors"):
                    shutil.copy(path, folder / path.name)
        with app.state.sessions() as session:
            for (kind, folder), step in zip(folders.items(), (2, 4), strict=True):
                checkpoints.record(
                    session, job_id=job["id"], step=step, path=str(folder), kind=kind, metrics={}
                )
    return str(job["id"]), folders


def test_a_job_s_lora_and_full_vlm_checkpoints_answer_images_in_the_playground(
    served: tuple[LiveServer, WorkerProcess],
) -> None:
    from peft import PeftModel

    server, _ = served
    base = server.settings.models_dir / "tiny-vlm-qwen"
    if not (base / "config.json").is_file():
        tiny_vlm_folder(base, "qwen2_5_vl")
    job_id, folders = recorded_checkpoints(served, base)
    image = png(26, 18, 5)
    message = ask(data_url(image))
    references = {
        2: PeftModel.from_pretrained(load_model(base), str(folders["adapter"])),
        4: load_model(folders["full"]),
    }
    answers = {}
    with server.http() as http:
        for step, model in references.items():
            body = {"checkpoint": {"job_id": job_id, "step": step}, "messages": message, "temperature": 0}
            r = http.post("/api/generate", json={**body, "max_tokens": 8})
            assert r.status_code == 200 and "event: done" in r.text, r.text
            answers[step] = "".join(
                json.loads(line[6:])["text"]
                for block in r.text.split("\n\n")
                if block.startswith("event: delta")
                for line in block.splitlines()
                if line.startswith("data: ")
            )
            assert answers[step] == generated(model, load_processor_for(base), image), step
    assert answers[2] != answers[4]


def generated(model: Any, processor: Any, image: bytes, tokens: int = 8) -> str:
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}],
        }
    ]
    prompt = chat_prompt(processor.tokenizer, messages, processor=processor)
    x = torch.tensor([prompt.ids])
    with torch.no_grad():
        out = model.eval().generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            **prompt.inputs,
            max_new_tokens=tokens,
            do_sample=False,
        )
    return str(processor.tokenizer.decode(out[0, len(prompt.ids) :], skip_special_tokens=True))
