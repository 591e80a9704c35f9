"""Hub pulls of vision-language models, from a local server that speaks the Hub's API
(``tests/utils/fake_hub.py``): a VLM the engine does not train is refused from its ``config.json``
alone, naming why, before any weight moves; a supported one's pull takes its processor files; a
VLM checkpoint's push carries them (its base's, when the checkpoint lacks them) and its GGUF push
is refused naming the mmproj file it would need."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.model.export import save_export
from engine.model.loading import load_model, load_processor_for
from engine.vision.processing import PROCESSOR_FILES
from server.hf_hub.push import run_push
from server.services import checkpoints, transfers
from tests.engine.tiny_vision import tiny_vlm_folder
from tests.server.test_hub_models import TOKEN, api, settings_for
from tests.server.test_worker import dataset
from tests.utils.fake_hub import FakeHub
from tests.utils.jobs import start_job

TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}
WEIGHTS = b"\0" * 3_000_000


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    fake = FakeHub(token=TOKEN).start()
    qwen3_vl_moe = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "text_config": TEXT,
        "vision_config": {},
    }
    llava = {"architectures": ["LlavaForConditionalGeneration"], "text_config": TEXT, "vision_config": {}}
    for repo, config in (("org/qwen3-vl-moe", qwen3_vl_moe), ("org/llava", llava)):
        fake.add(repo, {"config.json": json.dumps(config).encode(), "model.safetensors": WEIGHTS})
    fake.add_folder("org/tiny-vlm", tiny_vlm_folder(tmp_path_factory.mktemp("repo") / "vlm", "qwen2_5_vl"))
    yield fake
    fake.stop()


def test_an_unsupported_vlm_is_refused_from_its_config_naming_why(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub)) as client:
        for repo, reason in (
            ("org/qwen3-vl-moe", "mixture-of-experts"),
            ("org/llava", "unsupported vision-language model LlavaForConditionalGeneration"),
        ):
            r = client.post("/api/models/pulls", json={"repo_id": repo})
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["code"] == "unsupported_model" and error["param"] == "repo_id", error
            assert reason in error["message"] and repo in error["message"], error
            assert 0 < hub.served_bytes(repo) < len(WEIGHTS)  # its config.json, no weights
        assert client.get("/api/models/pulls").json()["data"] == []


def test_a_supported_vlm_s_pull_takes_its_processor_files(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub)) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/tiny-vlm"})
        assert r.status_code == 201, r.text
        names = {f["path"] for f in r.json()["files"]}
        assert {"config.json", "preprocessor_config.json", "model.safetensors"} <= names, names
        assert {"tokenizer.json", "tokenizer_config.json"} <= names, names
        held = hub.repos[("model", "org/tiny-vlm")].files
        processor = {name for name in PROCESSOR_FILES if name in held}
        assert "preprocessor_config.json" in processor and processor <= names, (processor, names)
        client.post(f"/api/transfers/{r.json()['id']}/cancel")


def test_a_vlm_push_refuses_its_gguf_and_carries_its_processor_files(tmp_path: Path, hub: FakeHub) -> None:
    from peft import LoraConfig, get_peft_model

    settings = settings_for(tmp_path, hub, hub_xet=False)  # the fake Hub takes LFS uploads
    base = tiny_vlm_folder(settings.models_dir / "tiny-vlm", "qwen2_5_vl")
    with api(settings) as client:
        job = start_job(client, dataset(client), base_model="tiny-vlm")
        folder = Path(job["config"]["output_dir"]) / "checkpoints" / "step_000002"
        lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)")
        model = get_peft_model(load_model(base), lora)
        weights = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        # written without its processor files: the push adds its base's
        save_export(model, weights, load_processor_for(base).tokenizer, folder, base_name="org/tiny-vlm")
        assert not (folder / "preprocessor_config.json").exists()
        sessions = client.app.state.sessions  # type: ignore[attr-defined]
        with sessions() as session:
            checkpoints.record(
                session, job_id=job["id"], step=2, path=str(folder), kind="adapter", metrics={}
            )
        url = f"/api/jobs/{job['id']}/checkpoints/2/push"
        r = client.post(url, json={"repo_id": "me/vlm-gguf", "format": "gguf"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "format" and "mmproj" in r.json()["error"]["message"]
        r = client.post(url, json={"repo_id": "me/vlm"})
        assert r.status_code == 202, r.text
        with sessions() as session:
            row = transfers.claim(session, transfer_id=r.json()["id"], worker_id="test", lease_seconds=60)
            assert row is not None
            session.expunge(row)
        ended = run_push(settings, sessions, row, "test")
        with sessions() as session:
            done = transfers.get(session, transfer_id=row.id)
            assert ended == transfers.SUCCEEDED, (done.error_code, done.error) if done else None
    pushed = set(hub.pushed["me/vlm"])
    held = {name for name in PROCESSOR_FILES if (base / name).is_file()}
    assert "preprocessor_config.json" in held and held <= pushed, pushed
    assert "adapter_model.safetensors" in pushed and "me/vlm-gguf" not in hub.pushed
