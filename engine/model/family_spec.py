"""What the engine knows about one family of causal LMs: ``FamilySpec`` (and ``MoeSpec`` for a
mixture of experts), with the Llama defaults its fields start from.

The table of the supported families is ``engine.model.families.FAMILIES``. No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# the attention and MLP projections of a Llama-shaped decoder block
LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """An attribute of a config object or a key of a ``config.json`` dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


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


def llama_block_arguments(context: Any, attention_type: str) -> dict[str, Any]:
    """The keyword arguments of a Llama-shaped decoder block besides its hidden states.

    Args:
        context: the micro-batch's ``engine.model.adapter.Context`` (masks and rotary tables by
            attention type, position ids).
        attention_type: the block's attention kind, which picks its mask and rotary tables.

    Returns:
        The mask and rotary ``(cos, sin)`` of the block's attention type, the position ids, and
        no KV cache.
    """
    return {
        "attention_mask": context.masks[attention_type],
        "position_embeddings": context.position_embeddings[attention_type],
        "position_ids": context.position_ids,
        "cache": None,
        "use_cache": False,
    }


@dataclass(frozen=True)
class BlockSizes:
    """The sizes of a decoder block the planner reads from a ``config.json``."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def two_norms_only(sizes: BlockSizes) -> int:
    """A Llama-shaped block: no parameters beyond its two norms."""
    return 0


@dataclass(frozen=True)
class FamilySpec:
    """What the engine, the planner and the model listings need to know about one family of
    causal LMs, and how the tests build its tiny model.

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
        logit_softcap: the config attribute with the final logit soft-cap ``c`` (Gemma 3's
            ``final_logit_softcapping``: ``logits = tanh(logits / c) * c``), or None; a config
            value of None means no cap.
        rotary_per_attention_type: the rotary embedding takes the block's attention type
            (Gemma 3: local and global ``rope_theta``) and is called once per type.
        refused: ``(attribute, why)`` pairs: config flags the engine cannot train with when set.
        moe: the expert facts of a mixture-of-experts family, or None.
        expert_parameters: the expert weights LoRA can adapt (peft ``target_parameters``
            names): what ``"experts"`` stands for in a run's ``method.target_parameters``.
        block_arguments: ``block_arguments(context, attention_type)``: the keyword arguments a
            decoder block is called with besides its hidden states (``llama_block_arguments``).
        display_name: the readable family name listings show ("Qwen3-MoE"); None: the service
            shortens the class name.
        short_name: the family's lower-case name ("gemma3"), which the tests and benchmarks
            use to ask for its tiny model.
        model_type: the ``model_type`` of the family's (text) config; the planner finds the
            extra norms and biases of a config's blocks by it, as a multimodal model's
            ``text_config`` names its text family there.
        fused_qkv: q, k and v are one ``qkv_proj`` (Phi-3).
        fused_gate_up: the MLP's gate and up projections are one ``gate_up_proj`` (GLM-4, Phi-3).
        qkv_bias: q, k and v have biases whatever ``attention_bias`` says (Qwen2).
        block_extra: ``block_extra(sizes)``: parameters per decoder block beyond its two norms
            and its linears (q/k norms, extra norms, attention sinks), from its ``BlockSizes``.
        latent_attention: multi-head latent attention (DeepSeek-V3): low-rank q and kv whose
            sizes the config gives.
        fp32_norms: the blocks' two norms and the final norm stay in fp32 whatever the compute
            dtype (GPT-OSS's ``_keep_in_fp32_modules``, which the engine's host state follows).
        fp32_router: a mixture-of-experts block's router weight stays in fp32 (DeepSeek-V3's
            ``_keep_in_fp32_modules_strict``). The planner counts both at 4 bytes a value;
            ``tests/engine/test_planner_quantized.py`` checks them against what the host keeps.
        tiny_config: the config values of the family's tiny test model on top of the shared tiny
            sizes (``tests/engine/tiny.py``): what its ``*Config`` needs to be small and valid and
            to exercise what the family does differently.
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
    logit_softcap: str | None = None
    rotary_per_attention_type: bool = False
    refused: tuple[tuple[str, str], ...] = ()
    moe: MoeSpec | None = None
    expert_parameters: tuple[str, ...] = ()
    block_arguments: Callable[[Any, str], dict[str, Any]] = llama_block_arguments
    display_name: str | None = None
    short_name: str = ""
    model_type: str = ""
    fused_qkv: bool = False
    fused_gate_up: bool = False
    qkv_bias: bool = False
    block_extra: Callable[[BlockSizes], int] = two_norms_only
    latent_attention: bool = False
    fp32_norms: bool = False
    fp32_router: bool = False
    tiny_config: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def refusal(self, config: Any) -> str | None:
        """Why the engine cannot train a model with ``config`` (None when it can)."""
        for attribute, why in self.refused:
            value = config_value(config, attribute, None)
            if value:
                return f"{self.architecture}: config.{attribute}={value!r} is not supported: {why}"
        return None


@dataclass(frozen=True)
class MoeSpec:
    """Where a mixture-of-experts family keeps its expert facts.

    Attributes:
        experts: the config attribute with the number of routed experts per MoE block.
        active: the config attribute with the experts each token is routed to.
        expert_intermediate: the config attribute with one expert's MLP width.
        router: the class name of the router module; its forward returns the router logits
            first (what the auxiliary load-balancing loss is computed from).
        aux_loss: whether the family's ``*ForCausalLM`` adds the load-balancing loss
            (``router_aux_loss_coef``) when asked for router logits.
        shared_experts: the config attribute with the number of always-active shared experts
            (DeepSeek-V3), or None.
        dense_blocks: ``dense_blocks(config)``: indexes of the decoder blocks whose MLP is dense.
        biases: the experts and the router have biases (GPT-OSS).
        peft_remap: peft (>= 0.18, with transformers 5) rewrites LoRA targets of the MLP into
            the stacked expert weights: ``gate_proj``/``up_proj`` become the experts'
            ``gate_up_proj`` at twice the rank, ``down_proj`` their ``down_proj``, ``gate`` the
            router's weight; the dense and shared MLPs then carry no adapter.
    """

    experts: str
    active: str = "num_experts_per_tok"
    expert_intermediate: str = "moe_intermediate_size"
    router: str = ""
    aux_loss: bool = True
    shared_experts: str | None = None
    dense_blocks: Callable[[Any], frozenset[int]] = lambda config: frozenset()
    biases: bool = False
    peft_remap: bool = False
