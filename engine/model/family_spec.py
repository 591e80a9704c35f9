"""What the engine knows about one family of causal LMs: ``FamilySpec`` (and ``MoeSpec`` for a
mixture of experts), with the Llama defaults its fields start from.

A spec carries its family's behaviour, not only flags: the context its blocks need and what they
are called with (``context``, an ``engine.model.block_context.BlockContext``), and the kinds of
its decoder blocks with the sizes of their weights (``block_kind``, from its ``attention`` and
``mlp`` layouts of ``engine.model.block_layout``), which the planner counts.

The table of the supported families is ``engine.model.families.FAMILIES``; the facts other
layers keep about a family are keyed by the same architecture name beside it: its GGUF export
(``engine.export.gguf_families.GGUF_FAMILIES``, unless ``no_gguf`` says why there is none) and
its measured activation coefficients (``engine.planner.activation_table.TABLE``, unless
``unmeasured`` says why the planner estimates them); ``tests/engine/model/test_family_registry.py``
checks both ways. No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.model.block_context import LLAMA_CONTEXT, BlockContext
from engine.model.block_layout import (
    ATTENTION,
    GATED_MLP,
    Attention,
    BlockDims,
    BlockKind,
    GatedMlp,
    Moe,
)

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
        refused: ``(attribute, why)`` pairs: config flags the engine cannot train with when set.
        moe: the expert facts of a mixture-of-experts family, or None.
        expert_parameters: the expert weights LoRA can adapt (peft ``target_parameters``
            names): what ``"experts"`` stands for in a run's ``method.target_parameters``.
        context: the ``BlockContext`` that builds the masks and rotary tables of a micro-batch
            and says what a block is called with (``RotaryPerAttentionType`` for Gemma 3's
            rotary embedding, which takes the attention type: local and global ``rope_theta``).
        display_name: the readable family name listings show ("Qwen3-MoE"); None: the service
            shortens the class name.
        short_name: the family's lower-case name ("gemma3"), which the tests and benchmarks
            use to ask for its tiny model.
        model_type: the ``model_type`` of the family's (text) config; the planner finds the
            extra norms and biases of a config's blocks by it, as a multimodal model's
            ``text_config`` names its text family there.
        attention: the attention projections of a block (``Attention``: separate q/k/v/o;
            ``FusedQkvAttention``: Phi-3's ``qkv_proj``; ``LatentAttention``: DeepSeek-V3's
            multi-head latent attention, low-rank q and kv whose sizes the config gives).
        mlp: the dense MLP of a block (``GatedMlp``; ``FusedGateUpMlp``: GLM-4's and Phi-3's
            ``gate_up_proj``); a mixture-of-experts block's experts are ``moe``'s.
        qkv_bias: q, k and v have biases whatever ``attention_bias`` says (Qwen2).
        block_extra: ``block_extra(sizes)``: parameters per decoder block beyond its two norms
            and its linears (q/k norms, extra norms, attention sinks), from its ``BlockSizes``.
        fp32_norms: the blocks' two norms and the final norm stay in fp32 whatever the compute
            dtype (GPT-OSS's ``_keep_in_fp32_modules``, which the engine's host state follows).
        fp32_router: a mixture-of-experts block's router weight stays in fp32 (DeepSeek-V3's
            ``_keep_in_fp32_modules_strict``). The planner counts both at 4 bytes a value;
            ``tests/engine/test_planner_quantized.py`` checks them against what the host keeps.
        tiny_config: the config values of the family's tiny test model on top of the shared tiny
            sizes (``tests/engine/tiny.py``): what its ``*Config`` needs to be small and valid and
            to exercise what the family does differently.
        no_gguf: why the family has no GGUF export (None: ``GGUF_FAMILIES`` has its entry).
        unmeasured: why the planner has no measured activation coefficients for the family and
            estimates them (None: ``activation_table.TABLE`` has its entry).
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
    refused: tuple[tuple[str, str], ...] = ()
    moe: MoeSpec | None = None
    expert_parameters: tuple[str, ...] = ()
    context: BlockContext = LLAMA_CONTEXT
    display_name: str | None = None
    short_name: str = ""
    model_type: str = ""
    attention: Attention = ATTENTION
    mlp: GatedMlp = GATED_MLP
    qkv_bias: bool = False
    block_extra: Callable[[BlockSizes], int] = two_norms_only
    fp32_norms: bool = False
    fp32_router: bool = False
    tiny_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    no_gguf: str | None = None
    unmeasured: str | None = None

    def refusal(self, config: Any) -> str | None:
        """Why the engine cannot train a model with ``config`` (None when it can)."""
        for attribute, why in self.refused:
            value = config_value(config, attribute, None)
            if value:
                return f"{self.architecture}: config.{attribute}={value!r} is not supported: {why}"
        return None

    def block_kind(self, dims: BlockDims, moe: Moe | None = None) -> BlockKind:
        """A decoder block of this family and the sizes of all its weights.

        Args:
            dims: the model's sizes (the planner's ``Shape``).
            moe: the block's experts; None for a dense block.
        """
        h = dims.hidden
        attention = {f"self_attn.{k}": v for k, v in self.attention.linears(dims).items()}
        norms = 2 * h + dims.block_extra
        fp32_norms = 2 * h if self.fp32_norms else 0
        if moe is None:
            mlp = {f"mlp.{k}": v for k, v in self.mlp.linears(dims).items()}
            biases = self.attention.biases(dims)
            return BlockKind("dense", attention | mlp, biases=biases, norms=norms, fp32=fp32_norms)
        e, i = moe.experts, moe.intermediate
        s = moe.shared * i  # the shared experts as one MLP of their summed width
        shared = {"gate_proj": (h, s), "up_proj": (h, s), "down_proj": (s, h)} if s else {}
        router = e * h
        per_expert = h * 2 * i + i * h + ((2 * i + h) if moe.biases else 0)
        return BlockKind(
            "experts",
            attention | {f"mlp.shared_experts.{k}": v for k, v in shared.items()},
            experts={"mlp.experts.gate_up_proj": (e, h, 2 * i), "mlp.experts.down_proj": (e, i, h)},
            router=router,
            # the experts' biases (gate_up and down) and the router's
            biases=self.attention.biases(dims) + (e * (2 * i + h) + e if moe.biases else 0),
            norms=norms,
            fp32=fp32_norms + (router if self.fp32_router else 0),
            inactive=(e - moe.active) * per_expert,
        )


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
