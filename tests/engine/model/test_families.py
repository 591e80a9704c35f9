"""The family table: what the adapter knows about each supported architecture."""

from __future__ import annotations

import pytest
import torch

from engine.config import MethodSpec
from engine.errors import ConfigError
from engine.model.adapter import AdaptedModel
from engine.model.families import (
    DEFAULT_LORA_TARGETS,
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    FamilySpec,
    family_for,
)
from tests.engine.tiny import FAMILIES as TINY_FAMILIES
from tests.engine.tiny import tiny_model


def test_family_for_an_unknown_class_names_it_and_the_supported_list() -> None:
    with pytest.raises(ConfigError) as exc:
        family_for("GPT2LMHeadModel")
    assert str(exc.value) == (
        "unsupported architecture GPT2LMHeadModel: the engine supports LlamaForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM (optionally wrapped by peft)"
    )
    assert exc.value.field == "model.path" and exc.value.value == "GPT2LMHeadModel"


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_adapts_and_its_lora_targets_are_linear_layers(family: str) -> None:
    model = tiny_model(family)
    spec = family_for(type(model).__name__)
    adapted = AdaptedModel(model)
    assert adapted.family is spec and adapted.architecture in SUPPORTED_ARCHITECTURES
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(spec.lora_targets) <= linear


def test_the_default_lora_targets_are_those_of_every_family() -> None:
    assert MethodSpec().target_modules == list(DEFAULT_LORA_TARGETS)
    assert all(spec.lora_targets == DEFAULT_LORA_TARGETS for spec in FAMILIES.values())


def test_a_llama_shaped_family_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    class HouseForCausalLM(LlamaForCausalLM):
        pass

    model = HouseForCausalLM(tiny_model("llama").config)
    with pytest.raises(ConfigError, match="unsupported architecture HouseForCausalLM"):
        AdaptedModel(model)
    monkeypatch.setitem(FAMILIES, "HouseForCausalLM", FamilySpec("HouseForCausalLM"))
    adapted = AdaptedModel(model)
    assert adapted.architecture == "HouseForCausalLM"
    assert [layer.kind for layer in adapted.layers] == ["input", "block", "block", "block", "output"]
