"""``GET /api/models`` on a real app: each model's family and experts; a folder the engine cannot
train (an unknown architecture, a broken or hostile ``config.json`` or safetensors header) is
listed as unsupported with the reason, and a job or plan with it is a 422 naming ``base_model``."""

from __future__ import annotations

import json
import os
import pathlib
import struct
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.model.families import SUPPORTED_ARCHITECTURES
from server.services.models import family_name
from server.settings import Settings

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "num_local_experts": 32, "num_experts_per_tok": 4}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
}

# folder -> (config.json as text or bytes, what the reason must say)
HOSTILE: dict[str, tuple[str | bytes, str]] = {
    "bert": ('{"architectures": ["BertForMaskedLM"]}', "unsupported architecture BertForMaskedLM"),
    "no-architecture": ('{"model_type": "llama"}', "names no architecture"),
    "empty-architectures": ('{"architectures": []}', "names no architecture"),
    "not-json": ('{"architectures": ["LlamaForCausalLM"', "config.json is not valid JSON"),
    "not-utf8": (b'{"architectures": ["Llama\xff"]}', "config.json is not valid JSON"),
    "deeply-nested": ("[" * 100_000 + "]" * 100_000, "config.json is not valid JSON"),
    "an-array": ('["LlamaForCausalLM"]', "config.json is not a JSON object: it is an array"),
    "null": ("null", "config.json is not a JSON object: it is null"),
    "a-number": ("12", "config.json is not a JSON object: it is a number"),
    "architectures-a-string": ('{"architectures": "LlamaForCausalLM"}', "not a list of class names"),
    "architectures-nested": ('{"architectures": [["LlamaForCausalLM"]]}', "not a list of class names"),
    "architectures-object": ('{"architectures": {"a": 1}}', "not a list of class names"),
    "architectures-number": ('{"architectures": [7]}', "not a list of class names"),
    "architectures-not-a-name": ('{"architectures": ["<script>"]}', "not a list of class names"),
    "experts-a-word": (json.dumps(QWEN3_MOE | {"num_experts": "lots"}), "wrong type"),
    "experts-a-list": (json.dumps(QWEN3_MOE | {"num_experts_per_tok": [8]}), "wrong type"),
    "experts-infinite": (json.dumps(QWEN3_MOE)[:-1] + ', "num_experts": 1e400}', "wrong type"),
    "experts-zero": (json.dumps(QWEN3_MOE | {"num_experts": 0}), "expert count must be from 1"),
    "more-active-than-experts": (json.dumps(GPT_OSS | {"num_experts_per_tok": 64}), "64 experts of only 32"),
    "mlp-only-layers-a-number": (json.dumps(QWEN3_MOE | {"mlp_only_layers": 3}), "wrong type"),
    "layers-astronomical": (json.dumps(QWEN3_MOE | {"num_hidden_layers": 10**15}), "num_hidden_layers"),
    "layers-a-string": (json.dumps(QWEN3_MOE | {"num_hidden_layers": "4"}), "num_hidden_layers"),
    "dense-blocks-astronomical": (
        json.dumps(DEEPSEEK_V3 | {"first_k_dense_replace": 10**15}),
        "first_k_dense_replace",
    ),
}


def write_config(folder: Path, config: dict[str, Any] | str | bytes) -> Path:
    folder.mkdir(parents=True)
    if isinstance(config, dict):
        config = json.dumps(config)
    path = folder / "config.json"
    if isinstance(config, bytes):
        path.write_bytes(config)
    else:
        path.write_text(config)
    return folder


def listed(client: TestClient) -> dict[str, dict[str, Any]]:
    r = client.get("/api/models")
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()["data"]}


def test_models_say_their_family_and_experts(client: TestClient, settings: Settings) -> None:
    write_config(settings.models_dir / "qwen3-moe", QWEN3_MOE)
    write_config(settings.models_dir / "gpt-oss", GPT_OSS)
    write_config(settings.models_dir / "deepseek", DEEPSEEK_V3)
    found = listed(client)
    tiny = found["tiny"]
    assert tiny["family"] == "Llama" and tiny["supported"] and tiny["unsupported_reason"] is None
    assert not tiny["moe"] and tiny["experts"] is None and tiny["active_experts"] is None
    facts = {
        name: (m["family"], m["moe"], m["experts"], m["active_experts"], m["supported"])
        for name, m in found.items()
    }
    assert facts["qwen3-moe"] == ("Qwen3-MoE", True, 128, 8, True)
    assert facts["gpt-oss"] == ("GPT-OSS", True, 32, 4, True)
    assert facts["deepseek"] == ("DeepSeek-V3", True, 256, 8, True)
    assert all(m["unsupported_reason"] is None for m in found.values() if m["supported"])
    if "demo" in found:  # listed even before its first preparation, as a Llama
        assert found["demo"]["family"] == "Llama" and found["demo"]["supported"]


def test_unsupported_and_hostile_folders_are_listed_with_the_reason(
    client: TestClient, settings: Settings
) -> None:
    for name, (config, _) in HOSTILE.items():
        write_config(settings.models_dir / name, config)
    write_config(settings.models_dir / "gpt2", {"architectures": ["GPT2LMHeadModel"]})
    found = listed(client)
    for name, (_, reason) in HOSTILE.items():
        m = found[name]
        assert not m["supported"] and reason in m["unsupported_reason"], (name, m)
        assert len(m["unsupported_reason"]) <= 1000, name
    assert found["bert"]["family"] == "Bert" and found["bert"]["architecture"] == "BertForMaskedLM"
    assert "LlamaForCausalLM" in found["bert"]["unsupported_reason"]  # names what would work
    gpt2 = found["gpt2"]
    assert gpt2["family"] == "GPT-2" and not gpt2["supported"] and not gpt2["moe"]
    for architecture in SUPPORTED_ARCHITECTURES:  # the whole list, not cut short
        assert architecture in found["bert"]["unsupported_reason"], architecture
    assert found["not-json"]["family"] is None and found["not-json"]["architecture"] is None
    assert found["tiny"]["supported"]  # the good ones are still there


def test_an_unreadable_config_is_listed_with_the_reason(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = write_config(settings.models_dir / "locked", {"architectures": ["LlamaForCausalLM"]})
    real_open = pathlib.Path.open

    def open_unless_locked(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == locked / "config.json":  # as for another user's 0600 file (the tests may run as root)
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_unless_locked)
    m = listed(client)["locked"]
    assert not m["supported"] and m["unsupported_reason"] == "config.json cannot be read: Permission denied"


def test_a_folder_name_that_is_not_utf8_is_listed_but_not_startable(
    client: TestClient, settings: Settings
) -> None:
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(os.fsdecode(os.fsencode(settings.models_dir) + b"/odd-\xff-name"))
    write_config(folder, {"architectures": ["LlamaForCausalLM"]})
    (m,) = (m for name, m in listed(client).items() if name.startswith("odd-"))
    assert m["name"] == "odd-\ufffd-name" and not m["supported"] and "UTF-8" in m["unsupported_reason"]


def safetensors(header: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header


@pytest.mark.parametrize(
    "content",
    [
        b"\x01\x02\x03",  # shorter than the length field
        safetensors(b"{not json"),
        safetensors(b"{}", length=2**62),  # a header length no one can allocate
        safetensors(b"{}", length=2**64 - 1),
        safetensors(b'{"w": {"dtype": "F32", "shape": "4x4", "data_offsets": [0, 64]}}'),
        safetensors(b'{"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}'),
        safetensors(b'{"w": [1, 2]}'),
        safetensors(b"[1, 2]"),
    ],
    ids=[
        "truncated",
        "not-json",
        "huge-length",
        "length-overflow",
        "shape-string",
        "shape-float",
        "meta-list",
        "array",
    ],
)
def test_a_broken_safetensors_header_does_not_break_the_listing(
    client: TestClient, settings: Settings, content: bytes
) -> None:
    folder = write_config(settings.models_dir / "broken", {"architectures": ["LlamaForCausalLM"]})
    (folder / "model.safetensors").write_bytes(content)
    m = listed(client)["broken"]
    assert m["parameters"] is None or isinstance(m["parameters"], int)
    if not m["supported"]:
        assert "safetensors" in m["unsupported_reason"], m


def test_jobs_and_plans_refuse_an_unsupported_model(client: TestClient, settings: Settings) -> None:
    write_config(settings.models_dir / "bert", {"architectures": ["BertForMaskedLM"]})
    write_config(settings.models_dir / "not-json", '{"architectures": [')
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 8
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    dataset = client.post("/api/datasets", files={"file": ("train.jsonl", content)}).json()
    for name, reason in (
        ("bert", "unsupported architecture BertForMaskedLM"),
        ("not-json", "not valid JSON"),
    ):
        body = {"base_model": name, "dataset_id": dataset["id"], "hyper": {"max_steps": 2, "batch_size": 4}}
        for route in ("/api/jobs", "/api/plan"):
            r = client.post(route, json=body)
            assert r.status_code == 422, (route, name, r.text)
            error = r.json()["error"]
            assert error["code"] == "unsupported_model" and error["param"] == "base_model", error
            assert f"base model {name!r} cannot be fine-tuned" in error["message"], error
            assert reason in error["message"], error
    assert client.get("/api/jobs").json()["data"] == []  # nothing was started
    ok = {"base_model": "tiny", "dataset_id": dataset["id"], "hyper": {"max_steps": 2, "batch_size": 4}}
    assert client.post("/api/plan", json=ok).status_code == 200


def test_family_names_read_well() -> None:
    assert family_name("Qwen3MoeForCausalLM") == "Qwen3-MoE"
    assert family_name("GptOssForCausalLM") == "GPT-OSS"
    assert family_name("Gemma3ForCausalLM") == "Gemma 3"
    assert family_name("BertForMaskedLM") == "Bert"
    assert family_name("AcmeMoeForCausalLM") == "Acme-MoE"  # derived from an unknown class name
    assert family_name("GPTNeoXForCausalLM") == "GPTNeoX"
    assert family_name(None) is None and family_name("") is None
    for architecture in SUPPORTED_ARCHITECTURES:
        name = family_name(architecture)
        assert name and not name.endswith("ForCausalLM"), architecture
