"""What trains in a VLM: the language model by the run's tuning, the vision tower and the
projector each frozen, LoRA or full (``method.vision_tower``, ``method.projector``); and the
engine equal to the plain loop on the adapted model."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine import EngineConfig
from engine.errors import ConfigError
from engine.training.run import tuned
from engine.vision.families import VISION_FAMILIES
from tests.engine.tiny import engine_loop, tiny_model
from tests.engine.tiny_vision import ENGINE_VLM_FAMILIES, tiny_processor, tiny_vlm, vision_batches
from tests.engine.vision.test_equivalence import STEPS, TOL, far, plain


def options(tuning: str = "lora", tower: str = "frozen", projector: str = "frozen") -> SimpleNamespace:
    return SimpleNamespace(
        tuning=tuning,
        lora=tuning == "lora",
        lora_r=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=[],
        vision_tower=tower,
        projector=projector,
    )


def trained(model: Any) -> set[str]:
    """Which part each trained parameter belongs to: language, tower, projector."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    spec = VISION_FAMILIES[type(base).__name__]
    parts = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain_name = name.replace("base_model.model.", "").replace(".modules_to_save.default", "")
        if plain_name.startswith(spec.projector + "."):
            parts.add("projector")
        elif plain_name.startswith(spec.tower + "."):
            parts.add("tower")
        else:
            parts.add("language")
    return parts


@pytest.mark.parametrize("family", ENGINE_VLM_FAMILIES)
@pytest.mark.parametrize(
    ("tuning", "tower", "projector", "parts"),
    [
        ("lora", "frozen", "frozen", {"language"}),
        ("lora", "lora", "full", {"language", "tower", "projector"}),
        ("lora", "full", "frozen", {"language", "tower"}),
        ("lora", "full", "full", {"language", "tower", "projector"}),
        ("full", "frozen", "full", {"language", "projector"}),
        ("full", "full", "full", {"language", "tower", "projector"}),
    ],
)
def test_the_parts_train_as_asked_and_the_engine_equals_the_plain_loop(
    family: str, tuning: str, tower: str, projector: str, parts: set[str]
) -> None:
    torch.manual_seed(0)
    model = tuned(tiny_vlm(family), options(tuning, tower, projector))
    assert trained(model) == parts
    plain_batch, engine_batch = vision_batches(family, tiny_processor(family))
    ref_losses, ref_state = plain(model, plain_batch)
    config = EngineConfig(devices=["cpu"] * 2, num_microbatches=3, optimizer="sgd", lr=0.1)
    losses, state, _ = engine_loop(model, [engine_batch] * STEPS, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
    assert not far(state, ref_state), far(state, ref_state)[:3]
    # nothing frozen moved
    start = {k: v.detach().float() for k, v in model.state_dict().items()}
    moved = {k for k in start if not torch.equal(start[k], state[k])}
    frozen = {n.replace("base_model.model.", "") for n, p in model.named_parameters() if not p.requires_grad}
    assert not {m.replace("base_model.model.", "") for m in moved} & frozen


def test_lora_on_a_projector_without_linear_layers_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"method\.projector='lora': Gemma 3 .* no linear layer") as info:
        tuned(tiny_vlm("gemma3_vl"), options("lora", "frozen", "lora"))
    assert info.value.field == "method.projector"


def test_tower_settings_a_model_or_tuning_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs tuning 'lora'") as info:
        tuned(tiny_vlm("idefics3"), options("full", "lora", "frozen"))
    assert info.value.field == "method.vision_tower"
    with pytest.raises(ConfigError, match="not a vision-language model"):
        tuned(tiny_model("llama"), options("lora", "full", "frozen"))
    with pytest.raises(ConfigError, match="projector is inside its vision tower"):
        tuned(tiny_vlm("qwen2_5_vl"), options("lora", "full", "lora"))


def test_lora_leaves_the_towers_same_named_layers_alone() -> None:
    """Qwen2.5-VL's tower has gate_proj/up_proj/down_proj too: a frozen tower gets no adapter."""
    model = tuned(copy.deepcopy(tiny_vlm("qwen2_5_vl")), options("lora"))
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    assert adapted and all(".language_model." in n for n in adapted)
