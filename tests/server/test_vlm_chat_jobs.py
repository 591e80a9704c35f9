"""A job's tuned vision-language model answers images: a tiny Qwen2.5-VL is fine-tuned (LoRA, and
full) on rows with images by a live server's worker; then ``/v1/chat/completions`` by the job's
``ft:`` name, with an ``image_url`` part, answers greedily what ``model.generate`` answers on the
checkpoint as downloaded (``/api/jobs/{id}/checkpoints/{step}/download``), and the base model
answers otherwise."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.inference.chat import stop_ids
from engine.inference.generate import load_for_inference, load_processor
from engine.inference.images import chat_prompt
from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import served
from tests.server.test_openai_api import LiveServer
from tests.utils.jobs import FINAL, start_job, wait_for_job

__all__ = ["served"]  # the module's live server and worker

VLM = "tiny-vlm-jobs"
TOKENS = 8


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def vision_row(i: int) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png(16 + 4 * (i % 3), 16, i))}},
        {"type": "text", "text": "what colour?"},
    ]
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": f"colour {i % 2}"},
        ]
    }


def reference(folder: Path, base: Path | None, image: bytes) -> str:
    """``model.generate``'s greedy answer from a downloaded checkpoint (a LoRA adapter on ``base``,
    or a whole model) on the processor's inputs."""
    model, _ = load_for_inference(base, adapter=folder) if base is not None else load_for_inference(folder)
    processor = load_processor(base if base is not None else folder)
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "what colour?"}],
        }
    ]
    prompt = chat_prompt(processor.tokenizer, messages, processor=processor)
    x = torch.tensor([prompt.ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            **prompt.inputs,
            max_new_tokens=TOKENS,
            do_sample=False,
            eos_token_id=sorted(stop_ids(model, processor.tokenizer)),  # where the service ends a turn
        )
    return str(processor.tokenizer.decode(out[0, len(prompt.ids) :], skip_special_tokens=True))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_tuned_vlm_answers_an_image_as_its_downloaded_checkpoint_does(
    served: tuple[LiveServer, WorkerProcess], kind: str, tmp_path: Path
) -> None:
    server, worker = served
    base = server.settings.models_dir / VLM
    if not (base / "config.json").is_file():
        tiny_vlm_folder(base, "qwen2_5_vl")
    client = server.client()
    with server.http() as http:
        rows = "".join(json.dumps(vision_row(i)) + "\n" for i in range(8))
        r = http.post(
            "/api/datasets", files={"file": ("vision.jsonl", rows)}, data={"name": f"vision-{kind}"}
        )
        assert r.status_code == 201, r.text
        dataset_id = r.json()["id"]
        job = start_job(
            http,
            dataset_id,
            base_model=VLM,
            data={"max_length": 200},
            method={"kind": kind, "lora_r": 4} if kind == "lora" else {"kind": "full"},
            hyper={"max_steps": 2, "batch_size": 4, "learning_rate": 0.5, "optimizer": "sgd"},
        )
        done = wait_for_job(http, job["id"], FINAL, timeout=300, logs=[worker])
        assert done["status"] == "succeeded", (done.get("error"), worker.tail())
        archive = http.get(f"/api/jobs/{job['id']}/checkpoints/2/download")
        assert archive.status_code == 200, archive.text
        if kind == "lora":  # an evaluation on the stored image rows (sha256: images in the store)
            url = f"/api/jobs/{job['id']}/evaluations"
            asked = {"dataset_id": dataset_id, "max_rows": 4, "max_new_tokens": 2, "num_samples": 2}
            r = http.post(url, json=asked)
            assert r.status_code == 201, r.text
            evaluation = f"{url}/{r.json()['id']}"
            deadline = time.monotonic() + 300
            while (found := http.get(evaluation).json())["status"] not in ("succeeded", "failed"):
                assert time.monotonic() < deadline, (found, worker.tail())
                time.sleep(0.5)
            assert found["status"] == "succeeded", (found.get("error"), worker.tail())
            assert found["metrics"]["rows"] == 4 and found["metrics"]["image_rows"] == 4, found["metrics"]
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        tar.extractall(tmp_path / "download", filter="data")
    marker = "adapter_config.json" if kind == "lora" else "config.json"
    folder = next((tmp_path / "download").rglob(marker)).parent
    name = client.fine_tuning.jobs.retrieve(job["id"]).fine_tuned_model
    assert name is not None
    image = png(20, 16, 11)
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "what colour?"},
            ],
        }
    ]
    tuned = client.chat.completions.create(
        model=name, messages=messages, temperature=0, max_completion_tokens=TOKENS
    )
    expected = reference(folder, base if kind == "lora" else None, image)
    assert tuned.choices[0].message.content == expected
    plain = client.chat.completions.create(
        model=VLM, messages=messages, temperature=0, max_completion_tokens=TOKENS
    )
    assert plain.choices[0].message.content == reference(base, None, image)
    assert plain.choices[0].message.content != expected  # the tuned weights are applied
