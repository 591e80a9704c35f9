"""The family table: what the adapter knows about each supported architecture."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from engine.config import method_options
from engine.errors import ConfigError
from engine.model.adapter import AdaptedModel, count_label_tokens, run_layer
from engine.model.block_context import BlockContext
from engine.model.families import (
    DEFAULT_LORA_TARGETS,
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    FamilySpec,
    family_for,
    model_kind,
)
from tests.engine.tiny import FAMILIES as TINY_FAMILIES
from tests.engine.tiny import MOE_FAMILIES, SPECS, tiny_model


def test_family_for_an_unknown_class_names_it_and_the_supported_list() -> None:
    with pytest.raises(ConfigError) as exc:
        family_for("GPT2LMHeadModel")
    assert str(exc.value) == (
        "unsupported architecture GPT2LMHeadModel: the engine supports LlamaForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, SmolLM3ForCausalLM, "
        "Glm4ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM, GraniteForCausalLM, Gemma3ForCausalLM, "
        "Qwen3MoeForCausalLM, GptOssForCausalLM, DeepseekV3ForCausalLM (optionally wrapped by peft)"
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
    # a mixture-of-experts family's expert weights: one 3-D stack per MoE block and name
    shapes = [p.dim() for n, p in model.named_parameters() for e in spec.expert_parameters if n.endswith(e)]
    assert (spec.moe is None) == (not spec.expert_parameters) and set(shapes) <= {3}
    assert len(shapes) == len(spec.expert_parameters) * sum(
        1
        for i in range(model.config.num_hidden_layers)
        if spec.moe and i not in spec.moe.dense_blocks(model.config)
    )


def test_the_default_lora_targets_are_those_of_every_llama_layout_family() -> None:
    assert method_options().target_modules == list(DEFAULT_LORA_TARGETS)
    # fused gate_up_proj (and Phi-3's qkv_proj); the mixture-of-experts families: their attention
    fused = {
        "Glm4ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV3ForCausalLM",
    }
    assert all(
        spec.lora_targets == DEFAULT_LORA_TARGETS for name, spec in FAMILIES.items() if name not in fused
    )
    assert FAMILIES["Glm4ForCausalLM"].lora_targets == (
        *DEFAULT_LORA_TARGETS[:4],
        "gate_up_proj",
        "down_proj",
    )
    assert FAMILIES["Phi3ForCausalLM"].lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    for name in ("Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        assert FAMILIES[name].lora_targets == DEFAULT_LORA_TARGETS[:4]
    assert FAMILIES["DeepseekV3ForCausalLM"].lora_targets == (
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    )


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


def test_every_entry_names_its_family_and_builds_its_tiny_model() -> None:
    # the tests' families are the table's, by a short name each
    assert len(TINY_FAMILIES) == len(FAMILIES) and set(SPECS.values()) == set(FAMILIES.values())
    names = [spec.display_name for spec in FAMILIES.values()]
    assert all(names) and len(set(names)) == len(names)
    for family in TINY_FAMILIES:
        spec = SPECS[family]
        model = tiny_model(family)
        assert type(model).__name__ == spec.architecture and model.config.model_type == spec.model_type
        assert model.config.num_hidden_layers == 3 and model.config.hidden_size == 32
        for key, value in spec.tiny_config.items():
            assert key == "rope_parameters" or getattr(model.config, key) == value, (family, key)


def test_a_family_says_what_its_blocks_are_called_with(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    class HouseForCausalLM(LlamaForCausalLM):
        pass

    calls: list[str] = []

    class HouseContext(BlockContext):
        def block_arguments(self, context: Any, attention_type: str) -> dict[str, Any]:
            calls.append(attention_type)
            return super().block_arguments(context, attention_type)

    spec = FamilySpec("HouseForCausalLM", context=HouseContext())
    monkeypatch.setitem(FAMILIES, "HouseForCausalLM", spec)
    model = HouseForCausalLM(tiny_model("llama").config).eval()
    adapted = AdaptedModel(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = adapted.layers[0].module(ids)
        ctx = adapted.build_context(adapted.rotary, hidden, None)
        for layer in adapted.layers[1:-1]:
            hidden = run_layer(layer, layer.module, hidden, ctx)
        assert torch.equal(adapted.layers[-1].module(hidden), model(input_ids=ids).logits)
    assert calls == ["full_attention"] * 3


def test_a_run_with_the_default_targets_adapts_its_family_s_linears() -> None:
    from engine.model.families import DEFAULT_LORA_TARGETS, FAMILIES
    from engine.training.run import lora_targets

    phi3 = FAMILIES["Phi3ForCausalLM"].lora_targets
    assert "qkv_proj" in phi3 and lora_targets(DEFAULT_LORA_TARGETS, "Phi3ForCausalLM") == list(phi3)
    assert lora_targets(DEFAULT_LORA_TARGETS, "LlamaForCausalLM") == list(DEFAULT_LORA_TARGETS)
    assert lora_targets(["o_proj"], "Phi3ForCausalLM") == ["o_proj"]  # what a run names is kept


def test_gemma3_soft_caps_its_logits_and_has_a_rotary_table_per_attention_type() -> None:
    model = tiny_model("gemma3").eval()
    adapted = AdaptedModel(model)
    output = adapted.layers[-1].module
    assert output.logit_softcap == model.config.final_logit_softcapping == 0.2
    assert [layer.attention_type for layer in adapted.layers[1:-1]] == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = adapted.layers[0].module(ids)
        # the embedding module scales by sqrt(hidden_size) itself: the input layer adds nothing
        assert torch.equal(hidden, model.model.embed_tokens.weight[ids] * model.config.hidden_size**0.5)
        ctx = adapted.build_context(adapted.rotary, hidden, None)
        for layer in adapted.layers[1:-1]:
            hidden = run_layer(layer, layer.module, hidden, ctx)
        raw = output.lm_head(output.norm(hidden))
        capped = output(hidden)
    # the cap bites: the largest logits lose a visible share of their size
    assert (raw - capped).abs().max() > 0.1 * raw.abs().max()
    # local and global rope_theta: the two attention types get different rotary tables
    local, full = ctx.position_embeddings["sliding_attention"], ctx.position_embeddings["full_attention"]
    assert not torch.allclose(local[0], full[0])


def test_gemma3_with_bidirectional_attention_is_refused() -> None:
    model = tiny_model("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ConfigError) as exc:
        AdaptedModel(model)
    assert str(exc.value).startswith(
        "Gemma3ForCausalLM: config.use_bidirectional_attention=True is not supported: bidirectional"
    )
    assert exc.value.field == "model.path"
    kind = model_kind(model.config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    assert not kind.supported and kind.reason == str(exc.value)
    assert model_kind(
        tiny_model("gemma3").config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    ).supported


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_tiny_routers_have_no_near_ties(family: str, batches: list[dict[str, torch.Tensor]]) -> None:
    # The engine's micro-batches round the hidden states differently from the whole batch (~1e-7
    # relative): a token whose k-th and (k+1)-th expert scores were that close could be routed
    # differently by the engine and the plain loop. Over the 3 SGD steps of the equivalence tests
    # the smallest gap is 1.2e-4 (Qwen3-MoE), 7.6e-6 (GPT-OSS), 3.7e-5 (DeepSeek-V3).
    model = copy.deepcopy(tiny_model(family))
    spec = family_for(type(model).__name__)
    assert spec.moe is not None
    k = model.config.num_experts_per_tok
    gaps: list[float] = []

    def gap(module: torch.nn.Module, args: Any, out: Any) -> None:
        scores = out[0].detach().float()
        if family == "deepseek_v3":  # DeepSeek-V3 selects by sigmoid score plus a bias
            scores = scores.sigmoid() + module.e_score_correction_bias
        top = scores.topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    for m in model.modules():
        if type(m).__name__ == spec.moe.router:
            m.register_forward_hook(gap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert gaps and min(gaps) > 1e-6
