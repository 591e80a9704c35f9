"""A vision-language model fine-tuned end to end by a live server and a real worker: a zip of
OpenAI vision rows and their PNG files is uploaded, a LoRA job on a tiny Qwen2.5-VL base model
trains its vision tower whole (``method.vision_tower: full``, its projector too) on the stored
images (the worker reads them from ``data.image_store``), and the checkpoint downloaded carries the
trained tower's weights and the processor files; the same through the OpenAI fine-tuning API."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.vision.processing import PROCESSOR_FILES
from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import served
from tests.server.test_openai_api import LiveServer
from tests.utils.jobs import FINAL, JOB_BODY, start_job, wait_for, wait_for_job

__all__ = ["served"]  # the module's live server and worker

VLM = "tiny-vlm-wiring"
ROWS = 8
TOWER = "visual."  # Qwen2.5-VL's vision tower (its weights' names hold it)
HYPER = {"max_steps": 2, "batch_size": 4, "learning_rate": 0.5, "optimizer": "sgd"}
# the projector trains whole too: Qwen2.5-VL's projector (visual.merger) is inside its tower
METHOD = {"lora_r": 4, "vision_tower": "full", "projector": "full"}


def pictures() -> bytes:
    """A zip of ``vision/train.jsonl`` (OpenAI vision rows naming their pictures by file name) and
    the pictures, each of its own size."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        rows = []
        for i in range(ROWS):
            name = f"pics/{i}.png"
            zf.writestr(f"vision/{name}", png(16 + 4 * (i % 3), 16 + 4 * (i % 2), seed=i))
            content = [
                {"type": "text", "text": "what colour?"},
                {"type": "image_url", "image_url": {"url": name}},
            ]
            answer = {"role": "assistant", "content": f"colour {i % 2}"}
            rows.append({"messages": [{"role": "user", "content": content}, answer]})
        zf.writestr("vision/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return out.getvalue()


def base_folder(server: LiveServer) -> Path:
    base = server.settings.models_dir / VLM
    if not (base / "config.json").is_file():
        tiny_vlm_folder(base, "qwen2_5_vl")
    return base


def tower_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The vision tower's weights a folder's safetensors hold, by their name from the tower on."""
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        for name, value in load_file(file).items():
            if TOWER in name:
                out[TOWER + name.split(TOWER, 1)[1]] = value
    return out


def check_checkpoint(archive: bytes, base: Path, tmp_path: Path) -> None:
    """The downloaded LoRA checkpoint holds every tower weight, trained (changed from the base's),
    and the processor files a VLM loads with."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    folder = next(tmp_path.rglob("adapter_config.json")).parent
    tuned, before = tower_weights(folder), tower_weights(base)
    assert before and set(tuned) == set(before), sorted(set(before) ^ set(tuned))[:5]
    changed = [n for n in before if not torch.equal(tuned[n].to(before[n].dtype), before[n])]
    assert changed, "the tower's weights did not train"
    for name in PROCESSOR_FILES[:2]:  # the image processor's settings and the processor's
        assert (folder / name).is_file() and (folder / name).read_bytes() == (base / name).read_bytes(), name


@pytest.mark.slow
def test_a_lora_job_trains_a_vlm_s_tower_on_an_uploaded_zip_of_pictures(
    served: tuple[LiveServer, WorkerProcess], tmp_path: Path
) -> None:
    server, worker = served
    base = base_folder(server)
    with server.http() as http:
        r = http.post("/api/datasets", files={"file": ("vision.zip", pictures())}, data={"name": "pictures"})
        assert r.status_code == 201, r.text
        dataset = r.json()
        assert dataset["rows"] == ROWS
        job = start_job(
            http,
            dataset["id"],
            base_model=VLM,
            data={"max_length": 200},
            method={"kind": "lora", **METHOD},
            hyper=HYPER,
        )
        assert job["config"]["data"]["image_store"] == str(server.settings.home.resolve() / "images")
        done = wait_for_job(http, job["id"], FINAL, timeout=300, logs=[worker])
        assert done["status"] == "succeeded", (done.get("error"), worker.tail())
        archive = http.get(f"/api/jobs/{job['id']}/checkpoints/2/download")
        assert archive.status_code == 200, archive.text
    check_checkpoint(archive.content, base, tmp_path)


@pytest.mark.slow
def test_the_same_job_through_the_openai_fine_tuning_api(
    served: tuple[LiveServer, WorkerProcess], tmp_path: Path
) -> None:
    server, worker = served
    base = base_folder(server)
    client = server.client()
    file = client.files.create(file=("vision.zip", pictures()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=VLM,
        training_file=file.id,
        extra_body={
            "roundhouse": {
                "data": {"max_length": 200},
                "method": METHOD,
                "hyper": HYPER,
                "engine": JOB_BODY["engine"],
                "checkpoint": JOB_BODY["checkpoint"],
            }
        },
    )
    done: Any = wait_for(
        lambda: client.fine_tuning.jobs.retrieve(job.id),
        until=FINAL,
        timeout=300,
        what=f"fine-tuning job {job.id}",
        details=worker.tail,
    )
    assert done.status == "succeeded", (done.error, worker.tail())
    assert done.fine_tuned_model is not None
    with server.http() as http:
        archive = http.get(f"/api/jobs/{job.id.removeprefix('ftjob-')}/checkpoints/2/download")
        assert archive.status_code == 200, archive.text
    check_checkpoint(archive.content, base, tmp_path)
