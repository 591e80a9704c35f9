"""Saving a LoRA adapter: no model hub lookup, and the embeddings saved exactly when peft's own
"auto" rule (offline) saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.model.export import save_export
from tests.engine.tiny import tiny_model, tiny_tokenizer


def _lora(targets: list[str] | str) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=targets))


@pytest.mark.parametrize(
    "targets",
    [["q_proj", "v_proj"], ["q_proj", "embed_tokens"], r".*\.(q_proj|embed_tokens)", "all-linear"],
)
def test_an_adapter_saves_without_a_hub_lookup_and_as_peft_would_offline(
    targets: list[str] | str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import peft.utils.save_and_load as peft_save

    looked_up: list[tuple[str, str]] = []

    def lookup(repo_id: str, filename: str, **_: object) -> None:
        looked_up.append((repo_id, filename))

    # online (the variable unset), peft's "auto" would ask the hub whether the base's config exists
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    real = peft_save.check_file_exists_on_hf_hub
    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", lookup)
    model = _lora(targets)
    weights = model.state_dict()
    save_export(model, weights, tiny_tokenizer(), tmp_path / "ours", base_name="some-org/some-model")
    assert looked_up == []
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")

    # peft's own rule, offline (no lookup: it assumes the vocabulary was not resized)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", real)
    model.save_pretrained(tmp_path / "peft", state_dict=weights)
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    embedded = any("embed_tokens" in k and "lora_" not in k for k in ours)
    assert embedded == (targets != "all-linear" and "embed_tokens" in str(targets))
