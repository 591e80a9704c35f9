"""The Hugging Face model families the engine trains, one ``FamilySpec`` each.

A spec says where the adapter finds the parts of a ``*ForCausalLM`` (embeddings, decoder
blocks, final norm, rotary embedding, LM head), which attention mask each block gets, and which
linear layers LoRA adapts by default. The families supported today share the Llama skeleton,
so adding another Llama-shaped family is one line in ``FAMILIES``; what a family does outside
its decoder blocks besides the Llama steps (Granite scales the embeddings and divides the
logits) is a config attribute named in its spec. No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

# the attention and MLP projections of a Llama-shaped decoder block
LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# GLM-4 fuses the MLP's gate and up projections; Phi-3 also fuses q/k/v
GLM4_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
PHI3_LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def config_attention_type(config: Any, block_index: int) -> str:
    """The attention kind of decoder block ``block_index``, read from the model config.

    ``layer_types`` (per-block, Qwen2/Qwen3) wins; else a ``sliding_window`` (Mistral) makes
    every block sliding; else full causal attention.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[block_index])
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


@dataclass(frozen=True)
class FamilySpec:
    """What the adapter needs to know about one family of causal LMs.

    Attributes:
        architecture: the ``*ForCausalLM`` class name (as in ``config.architectures``).
        embeddings, blocks, norm, rotary, lm_head: dotted attribute paths from the
            ``*ForCausalLM`` to the token embeddings, the list of decoder blocks, the final norm,
            the rotary embedding and the LM head.
        lora_targets: the module names LoRA adapts when a run names none.
        attention_type: ``attention_type(config, block_index)``: the attention kind
            (``"full_attention"`` or ``"sliding_attention"``) of a block, which picks its mask.
        embedding_multiplier: the config attribute the token embeddings are multiplied by
            before the first block (Granite's ``embedding_multiplier``), or None.
        logits_divisor: the config attribute the LM head's logits are divided by (Granite's
            ``logits_scaling``), or None.
    """

    architecture: str
    embeddings: str = "model.embed_tokens"
    blocks: str = "model.layers"
    norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    lm_head: str = "lm_head"
    lora_targets: tuple[str, ...] = LLAMA_LINEAR
    attention_type: Callable[[Any, int], str] = config_attention_type
    embedding_multiplier: str | None = None
    logits_divisor: str | None = None


FAMILIES: dict[str, FamilySpec] = {
    spec.architecture: spec
    for spec in (
        FamilySpec("LlamaForCausalLM"),
        FamilySpec("Qwen2ForCausalLM"),
        FamilySpec("Qwen3ForCausalLM"),
        FamilySpec("MistralForCausalLM"),
        FamilySpec("SmolLM3ForCausalLM"),
        FamilySpec("Glm4ForCausalLM", lora_targets=GLM4_LINEAR),
        FamilySpec("Olmo2ForCausalLM"),
        FamilySpec("Phi3ForCausalLM", lora_targets=PHI3_LINEAR),
        FamilySpec(
            "GraniteForCausalLM", embedding_multiplier="embedding_multiplier", logits_divisor="logits_scaling"
        ),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# LoRA's default targets in a run configuration, before the model (and its family) is known:
# the Llama block layout (a family with fused projections, GLM-4 or Phi-3, has its own
# ``lora_targets``)
DEFAULT_LORA_TARGETS = LLAMA_LINEAR


def family_for(architecture: str) -> FamilySpec:
    """The spec of a ``*ForCausalLM`` class name.

    Raises:
        ConfigError: the architecture is not supported (field ``model.path``; the message names
            the class and the supported list).
    """
    spec = FAMILIES.get(architecture)
    if spec is None:
        raise ConfigError(
            "model.path",
            f"unsupported architecture {architecture}: the engine supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (optionally wrapped by peft)",
            value=architecture,
        )
    return spec
