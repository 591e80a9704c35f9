"""The family table: what the adapter knows about each supported architecture."""

from __future__ import annotations

import pytest
import torch

from engine.config import MethodSpec
from engine.errors import ConfigError
from engine.model.adapter import AdaptedModel, count_label_tokens, run_layer
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
        "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, SmolLM3ForCausalLM, "
        "Glm4ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM, GraniteForCausalLM "
        "(optionally wrapped by peft)"
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


def test_the_default_lora_targets_are_those_of_every_llama_layout_family() -> None:
    assert MethodSpec().target_modules == list(DEFAULT_LORA_TARGETS)
    fused = {"Glm4ForCausalLM", "Phi3ForCausalLM"}  # fused gate_up_proj (and Phi-3's qkv_proj)
    assert all(
        spec.lora_targets == DEFAULT_LORA_TARGETS for name, spec in FAMILIES.items() if name not in fused
    )
    assert FAMILIES["Glm4ForCausalLM"].lora_targets == (
        *DEFAULT_LORA_TARGETS[:4],
        "gate_up_proj",
        "down_proj",
    )
    assert FAMILIES["Phi3ForCausalLM"].lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_input_and_output_layers_reproduce_the_model_outside_its_blocks(family: str) -> None:
    # Granite scales the embeddings and divides the logits: the layers chained by hand give
    # the model's own logits and loss
    model = tiny_model(family).eval()
    adapted = AdaptedModel(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels)
        hidden = adapted.layers[0].module(ids)
        ctx = adapted.build_context(adapted.rotary, hidden, mask)
        for layer in adapted.layers[1:-1]:
            hidden = run_layer(layer, layer.module, hidden, ctx)
        logits = adapted.layers[-1].module(hidden)
        loss_sum = adapted.layers[-1].module(hidden, labels)
    assert torch.equal(logits, expected.logits)
    torch.testing.assert_close(loss_sum / count_label_tokens(labels), expected.loss, rtol=1e-6, atol=1e-6)


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


def test_a_run_with_the_default_targets_adapts_its_family_s_linears() -> None:
    from engine.model.families import DEFAULT_LORA_TARGETS, FAMILIES
    from engine.run import lora_targets

    phi3 = FAMILIES["Phi3ForCausalLM"].lora_targets
    assert "qkv_proj" in phi3 and lora_targets(DEFAULT_LORA_TARGETS, "Phi3ForCausalLM") == list(phi3)
    assert lora_targets(DEFAULT_LORA_TARGETS, "LlamaForCausalLM") == list(DEFAULT_LORA_TARGETS)
    assert lora_targets(["o_proj"], "Phi3ForCausalLM") == ["o_proj"]  # what a run names is kept
