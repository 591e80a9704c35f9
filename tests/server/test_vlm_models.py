"""Vision-language models in the service: the models listing names a supported VLM's family and
an unsupported one's reason (and a job with it is refused); a VLM job's downloads carry the
processor files (its own checkpoint's and the merged folder), and its GGUF is refused naming the
mmproj file it would need, before anything is built."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from fastapi.testclient import TestClient

from engine.model.export import save_export
from engine.model.loading import load_model, load_processor_for
from engine.vision.processing import PROCESSOR_FILES
from server.services import checkpoints
from server.settings import Settings
from tests.engine.tiny_vision import tiny_vlm_folder
from tests.utils.jobs import start_job

DOWNLOAD = "/api/jobs/{job_id}/checkpoints/{step}/download"
TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}
REFUSED = {
    # Qwen3-VL-MoE: named with the reason (mixture-of-experts blocks); LLaVA: a VLM of no
    # supported family
    "qwen3-vl-moe": (
        {
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "text_config": TEXT,
            "vision_config": {"depth": 2},
        },
        "mixture-of-experts",
    ),
    "llava": (
        {"architectures": ["LlavaForConditionalGeneration"], "text_config": TEXT, "vision_config": {}},
        "unsupported vision-language model LlavaForConditionalGeneration",
    ),
}


def text_dataset(client: TestClient) -> str:
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)).encode()
    return str(client.post("/api/datasets", files={"file": ("rows.jsonl", rows)}).json()["id"])


def members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        found = {m.name.split("/", 1)[1]: tar.extractfile(m) for m in tar.getmembers() if m.isfile()}
        return {name: f.read() for name, f in found.items() if f is not None}


def test_the_listing_names_a_vlm_s_family_or_why_it_is_refused(
    client: TestClient, settings: Settings
) -> None:
    tiny_vlm_folder(settings.models_dir / "tiny-vlm", "qwen2_5_vl")
    for name, (config, _) in REFUSED.items():
        (settings.models_dir / name).mkdir(parents=True)
        (settings.models_dir / name / "config.json").write_text(json.dumps(config))
    listed = {m["name"]: m for m in client.get("/api/models").json()["data"]}
    vlm = listed["tiny-vlm"]
    assert vlm["supported"] and vlm["family"] == "Qwen2.5-VL", vlm
    assert vlm["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    for name, (_, reason) in REFUSED.items():
        assert not listed[name]["supported"] and reason in listed[name]["unsupported_reason"], listed[name]
    dataset = text_dataset(client)
    for name, (_, reason) in REFUSED.items():
        r = client.post(
            "/api/jobs", json={"base_model": name, "dataset_id": dataset, "hyper": {"max_steps": 2}}
        )
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "unsupported_model" and reason in error["message"], error


def test_a_vlm_job_s_downloads_carry_its_processor_and_its_gguf_is_refused(
    client: TestClient, settings: Settings
) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_vlm_folder(settings.models_dir / "tiny-vlm", "idefics3")
    wanted = {name: (base / name).read_bytes() for name in PROCESSOR_FILES if (base / name).is_file()}
    assert "preprocessor_config.json" in wanted
    job = start_job(client, text_dataset(client), base_model="tiny-vlm")
    step = 2
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / f"step_{step:06d}"
    lora = LoraConfig(r=4, target_modules=r".*text_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    model = get_peft_model(load_model(base), lora)
    weights = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    # a checkpoint written without its processor files: the download adds its base's
    save_export(model, weights, load_processor_for(base).tokenizer, folder, base_name="org/tiny-vlm")
    assert not (folder / "preprocessor_config.json").exists()
    (folder / "state").mkdir()
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=step, path=str(folder), kind="adapter", metrics={})

    formats = {f["name"]: f for f in client.get(f"/api/jobs/{job['id']}/checkpoints/formats").json()["data"]}
    assert formats["checkpoint"]["refused"] is None and formats["merged"]["refused"] is None
    assert "mmproj" in formats["gguf"]["refused"], formats["gguf"]
    url = DOWNLOAD.format(job_id=job["id"], step=step)
    r = client.get(url, params={"format": "gguf"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "format" and "mmproj" in error["message"], error
    exports = Path(job["config"]["output_dir"]) / "exports"
    assert not exports.exists() or not any(exports.iterdir())  # nothing was built

    own = client.get(url, params={"format": "checkpoint"})
    assert own.status_code == 200, own.text
    files = members(own.content)
    assert "adapter_model.safetensors" in files
    assert {name: files.get(name) for name in wanted} == wanted
    merged = client.get(url, params={"format": "merged"})
    assert merged.status_code == 200, merged.text
    files = members(merged.content)
    assert "config.json" in files and any(name.endswith(".safetensors") for name in files)
    assert {name: files.get(name) for name in wanted} == wanted
