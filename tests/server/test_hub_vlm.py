"""Hub pulls of vision-language models, from a local server that speaks the Hub's API
(``tests/utils/fake_hub.py``): a VLM the engine does not train is refused from its ``config.json``
alone, naming why, before any weight moves; a supported one's pull takes its processor files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.vision.processing import PROCESSOR_FILES
from tests.engine.tiny_vision import tiny_vlm_folder
from tests.server.test_hub_models import TOKEN, api, settings_for
from tests.utils.fake_hub import FakeHub

TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}
WEIGHTS = b"\0" * 3_000_000


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    fake = FakeHub(token=TOKEN).start()
    qwen3_vl = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "text_config": TEXT,
        "vision_config": {},
    }
    llava = {"architectures": ["LlavaForConditionalGeneration"], "text_config": TEXT, "vision_config": {}}
    for repo, config in (("org/qwen3-vl", qwen3_vl), ("org/llava", llava)):
        fake.add(repo, {"config.json": json.dumps(config).encode(), "model.safetensors": WEIGHTS})
    fake.add_folder("org/tiny-vlm", tiny_vlm_folder(tmp_path_factory.mktemp("repo") / "vlm", "qwen2_5_vl"))
    yield fake
    fake.stop()


def test_an_unsupported_vlm_is_refused_from_its_config_naming_why(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub)) as client:
        for repo, reason in (
            ("org/qwen3-vl", "deepstack"),
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
