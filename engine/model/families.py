"""The Hugging Face model families the engine trains, one ``FamilySpec`` each
(``engine.model.family_spec``).

A spec says where the adapter finds the parts of a ``*ForCausalLM`` (embeddings, decoder
blocks, final norm, rotary embedding, LM head), which attention mask each block gets, how the
context of a micro-batch is built and how a block is called (its ``BlockContext``), which linear
layers LoRA adapts by default; the kinds of its blocks with the sizes of their weights (its
attention and MLP layouts, its experts), which the planner counts; the family's readable name;
and the config of its tiny test model. The families supported today share the Llama skeleton,
so adding another Llama-shaped family is one entry in ``FAMILIES`` plus its GGUF entry
(``engine.export.gguf_families``, or a ``no_gguf`` reason) and its measured activations
(``python -m engine.model.activations``, or an ``unmeasured`` reason). What a family does
outside its decoder blocks besides the Llama steps (Granite scales the embeddings and divides
the logits, Gemma 3 soft-caps the logits and has one rotary table per attention type) is a
config attribute or a ``BlockContext`` named in its spec. Whatever differs inside the blocks
(Gemma 3's extra norms, GPT-OSS's attention sinks, DeepSeek-V3's latent attention, the experts
and routers of the mixture-of-experts families) runs in the model's own block modules. No torch
import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.model.block_context import RotaryPerAttentionType
from engine.model.block_layout import FUSED_GATE_UP_MLP, FUSED_QKV_ATTENTION, LATENT_ATTENTION
from engine.model.family_spec import LLAMA_LINEAR, FamilySpec, MoeSpec, config_value
from engine.vision.families import is_vision_config, vision_refusal, vision_spec

# GLM-4 fuses the MLP's gate and up projections; Phi-3 also fuses q/k/v
GLM4_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
PHI3_LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The mixture-of-experts families adapt their attention by default. Their MLP names are no
# default: on Qwen3-MoE and DeepSeek-V3 peft rewrites ``gate_proj``/``up_proj``/``down_proj`` in
# target_modules into the fused expert weights (its transformers 4 -> 5 conversion), which also
# drops the dense blocks' and shared experts' MLPs; LoRA on the experts is asked for with
# ``method.target_parameters`` (``EXPERT_PARAMETERS``).
ATTENTION_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj")
# DeepSeek-V3's multi-head latent attention: low-rank q and kv projections
DEEPSEEK_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# the fused 3-D expert weights of the transformers 5 mixture-of-experts blocks, in peft's
# ``target_parameters`` naming (module path suffix + parameter name)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Gemma 3: bidirectional attention (its embedding variant) would let each position see the
# token it is trained to predict
GEMMA3_REFUSED = (
    (
        "use_bidirectional_attention",
        "bidirectional attention lets every position see the token the next-token loss asks it "
        "to predict; the engine trains causal LMs",
    ),
)

# why the mixture-of-experts families have no GGUF export (``FamilySpec.no_gguf``)
NO_MOE_GGUF = "the GGUF export writes dense families; its mixture-of-experts tensors are not written yet"


def qwen3_moe_dense_blocks(config: Any) -> frozenset[int]:
    """Qwen3-MoE: blocks in ``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense."""
    step = int(config_value(config, "decoder_sparse_step", 1) or 1)
    only = set(config_value(config, "mlp_only_layers", None) or ())
    blocks = int(config_value(config, "num_hidden_layers", 0))
    return frozenset(i for i in range(blocks) if i in only or (i + 1) % step != 0)


def deepseek_dense_blocks(config: Any) -> frozenset[int]:
    """DeepSeek-V3: the first ``first_k_dense_replace`` blocks are dense."""
    return frozenset(range(int(config_value(config, "first_k_dense_replace", 0) or 0)))


# The tiny test models' special token ids, for the families whose configs' defaults lie outside
# the tiny vocabulary
_TINY_TOKEN_IDS: dict[str, Any] = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
# the YaRN rotary of the tiny GPT-OSS and DeepSeek-V3 models (as their released models)
_TINY_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

FAMILIES: dict[str, FamilySpec] = {
    spec.architecture: spec
    for spec in (
        FamilySpec("LlamaForCausalLM", display_name="Llama", short_name="llama", model_type="llama"),
        FamilySpec(
            "Qwen2ForCausalLM",
            display_name="Qwen2",
            short_name="qwen2",
            model_type="qwen2",
            qkv_bias=True,
            # alternate attention types: the lowest block full, the others with a sliding window
            tiny_config={
                "tie_word_embeddings": True,
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
            },
        ),
        FamilySpec(
            "Qwen3ForCausalLM",
            display_name="Qwen3",
            short_name="qwen3",
            model_type="qwen3",
            block_extra=lambda s: 2 * s.head_dim,  # q and k norms per head
            tiny_config={"tie_word_embeddings": True},
        ),
        FamilySpec(
            "MistralForCausalLM",
            display_name="Mistral",
            short_name="mistral",
            model_type="mistral",
            # shorter than the test sequences: exercises the sliding mask
            tiny_config={"sliding_window": 8},
        ),
        FamilySpec(
            "SmolLM3ForCausalLM",
            display_name="SmolLM3",
            short_name="smollm3",
            model_type="smollm3",
            # every third block without rotary embedding (NoPE) and, as SmolLM3 pairs them, sliding
            tiny_config=_TINY_TOKEN_IDS
            | {
                "tie_word_embeddings": True,
                "no_rope_layer_interval": 3,
                "use_sliding_window": True,
                "sliding_window": 8,
            },
        ),
        FamilySpec(
            "Glm4ForCausalLM",
            display_name="GLM-4",
            short_name="glm4",
            model_type="glm4",
            lora_targets=GLM4_LINEAR,
            mlp=FUSED_GATE_UP_MLP,
            block_extra=lambda s: 2 * s.hidden,  # two extra norms
            # head_dim: the config's default is 128. No attention bias: with GLM-4's half rotary
            # the unrotated half of k_proj.bias has a gradient that is exactly zero but for
            # rounding (~1e-11), which AdamW blows up into steps of lr; q/k/v biases are covered
            # by Qwen2.
            tiny_config=_TINY_TOKEN_IDS | {"head_dim": 8, "attention_bias": False},
        ),
        FamilySpec(
            "Olmo2ForCausalLM",
            display_name="OLMo 2",
            short_name="olmo2",
            model_type="olmo2",
            block_extra=lambda s: (s.heads + s.kv_heads) * s.head_dim,  # q and k norms, whole width
            tiny_config=_TINY_TOKEN_IDS,
        ),
        FamilySpec(
            "Phi3ForCausalLM",
            display_name="Phi-3",
            short_name="phi3",
            model_type="phi3",
            lora_targets=PHI3_LINEAR,
            attention=FUSED_QKV_ATTENTION,
            mlp=FUSED_GATE_UP_MLP,
            tiny_config=_TINY_TOKEN_IDS | {"sliding_window": 8},  # every block sliding
        ),
        FamilySpec(
            "GraniteForCausalLM",
            display_name="Granite",
            short_name="granite",
            model_type="granite",
            embedding_multiplier="embedding_multiplier",
            logits_divisor="logits_scaling",
            # the scales away from 1.0, so a scale the engine forgot shows up in the weights
            tiny_config=_TINY_TOKEN_IDS
            | {
                "tie_word_embeddings": True,
                "embedding_multiplier": 2.5,
                "residual_multiplier": 0.5,
                "attention_multiplier": 0.3,
                "logits_scaling": 4.0,
            },
        ),
        FamilySpec(
            "Gemma3ForCausalLM",
            display_name="Gemma 3",
            short_name="gemma3",
            model_type="gemma3_text",
            logit_softcap="final_logit_softcapping",
            context=RotaryPerAttentionType(),
            refused=GEMMA3_REFUSED,
            block_extra=lambda s: 2 * s.hidden + 2 * s.head_dim,  # two extra norms, q and k norms
            # head_dim: the config's default is 256. Blocks alternate sliding (window 8, shorter
            # than the test sequences) and full attention, whose rotary tables differ (local and
            # global rope_theta). The tiny logits reach ~0.45: a cap of 0.2 bends them visibly.
            # No attn_logit_softcapping: transformers' Gemma3Attention does not hand it to the
            # attention function, so it would change nothing.
            tiny_config={
                "tie_word_embeddings": True,
                "head_dim": 8,
                "query_pre_attn_scalar": 8,
                "sliding_window": 8,
                "sliding_window_pattern": 2,
                "final_logit_softcapping": 0.2,
            },
        ),
        FamilySpec(
            "Qwen3MoeForCausalLM",
            display_name="Qwen3-MoE",
            short_name="qwen3_moe",
            model_type="qwen3_moe",
            lora_targets=ATTENTION_LINEAR,
            moe=MoeSpec(
                "num_experts",
                router="Qwen3MoeTopKRouter",
                dense_blocks=qwen3_moe_dense_blocks,
                peft_remap=True,
            ),
            expert_parameters=EXPERT_PARAMETERS,
            block_extra=lambda s: 2 * s.head_dim,  # q and k norms per head
            no_gguf=NO_MOE_GGUF,
            # the lowest block dense (mlp_only_layers), the others mixtures of experts
            tiny_config={
                "head_dim": 8,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "mlp_only_layers": [0],
                "norm_topk_prob": True,
            },
        ),
        FamilySpec(
            "GptOssForCausalLM",
            display_name="GPT-OSS",
            short_name="gpt_oss",
            model_type="gpt_oss",
            lora_targets=ATTENTION_LINEAR,
            expert_parameters=EXPERT_PARAMETERS,
            moe=MoeSpec(
                "num_local_experts",
                expert_intermediate="intermediate_size",
                router="GptOssTopKRouter",
                biases=True,
            ),
            block_extra=lambda s: s.heads,  # attention sinks
            fp32_norms=True,
            no_gguf=NO_MOE_GGUF,
            unmeasured=(
                "its attention sinks run the eager attention, which keeps [heads, s, s] scores: the "
                "bytes per token grow with the sequence"
            ),
            # every block a mixture of experts; blocks alternate sliding (window 8) and full
            # attention (the config's default layer_types)
            tiny_config={
                "head_dim": 8,
                "intermediate_size": 16,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 8,
                "rope_parameters": _TINY_YARN | {"rope_theta": 150000.0, "truncate": False},
            },
        ),
        FamilySpec(
            "DeepseekV3ForCausalLM",
            display_name="DeepSeek-V3",
            short_name="deepseek_v3",
            model_type="deepseek_v3",
            lora_targets=DEEPSEEK_ATTENTION,
            expert_parameters=EXPERT_PARAMETERS,
            moe=MoeSpec(
                "n_routed_experts",
                router="DeepseekV3TopkRouter",
                aux_loss=False,
                shared_experts="n_shared_experts",
                dense_blocks=deepseek_dense_blocks,
                peft_remap=True,
            ),
            attention=LATENT_ATTENTION,
            fp32_router=True,
            no_gguf=NO_MOE_GGUF,
            unmeasured="its latent attention has other widths than q and k/v heads",
            # multi-head latent attention (low-rank q and kv, interleaved rotary half); the lowest
            # block dense, the others 4 routed experts (one group) plus a shared expert
            tiny_config={
                "num_key_value_heads": 4,
                "q_lora_rank": 16,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 4,
                "qk_nope_head_dim": 4,
                "v_head_dim": 8,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "moe_intermediate_size": 16,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "rope_parameters": _TINY_YARN | {"rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            },
        ),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# LoRA's default targets in a run configuration, before the model (and its family) is known:
# the Llama block layout (a family that names its projections otherwise, GLM-4 or Phi-3, and
# the mixture-of-experts families have their own ``lora_targets``)
DEFAULT_LORA_TARGETS = LLAMA_LINEAR


# a Qwen3-MoE config.json may name its expert count either way (``num_experts`` is an alias)
_ALIASES = {"num_experts": "num_local_experts"}


@dataclass(frozen=True)
class ModelKind:
    """What a model folder's ``config.json`` says about its family, for listings and planning.

    ``supported`` is False with a ``reason`` when the engine cannot train it.
    """

    architecture: str | None
    supported: bool
    reason: str | None = None
    moe: bool = False
    experts: int | None = None
    active_experts: int | None = None
    shared_experts: int = 0
    expert_intermediate: int | None = None
    dense_blocks: frozenset[int] = frozenset()


def model_kind(config: Any) -> ModelKind:
    """The family facts of a model config (a ``config.json`` dict or a config object)."""
    archs = config_value(config, "architectures", None) or []
    if not archs:
        return ModelKind(None, False, "config.json names no architecture")
    spec = FAMILIES.get(archs[0])
    if spec is None and is_vision_config(config):
        # a vision-language model: trained through its language model's family
        refusal = vision_refusal(config)
        return ModelKind(archs[0], refusal is None, refusal)
    if spec is None:
        return ModelKind(
            archs[0],
            False,
            f"unsupported architecture {archs[0]}: the engine supports {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    refusal = spec.refusal(config)
    if refusal is not None:
        return ModelKind(spec.architecture, False, refusal)
    moe = spec.moe
    if moe is None:
        return ModelKind(spec.architecture, True)

    def number(name: str | None) -> int | None:
        if name is None:
            return None
        value = config_value(config, name, None)
        if value is None and name in _ALIASES:
            value = config_value(config, _ALIASES[name], None)
        return None if value is None else int(value)

    return ModelKind(
        spec.architecture,
        True,
        moe=True,
        experts=number(moe.experts),
        active_experts=number(moe.active),
        shared_experts=number(moe.shared_experts) or 0,
        expert_intermediate=number(moe.expert_intermediate),
        dense_blocks=moe.dense_blocks(config),
    )


def family_for(architecture: str) -> FamilySpec:
    """The spec of a ``*ForCausalLM`` class name.

    Raises:
        ConfigError: the architecture is not supported (field ``model.path``; the message names
            the class and the supported list).
    """
    spec = FAMILIES.get(architecture)
    vision = vision_spec(architecture)
    if spec is None and vision is not None:
        return vision.text
    if spec is None:
        raise ConfigError(
            "model.path",
            f"unsupported architecture {architecture}: the engine supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (optionally wrapped by peft)",
            value=architecture,
        )
    return spec


def family_of_model_type(model_type: Any) -> FamilySpec | None:
    """The spec whose (text) config has ``model_type`` (None when no family has it)."""
    if not model_type:
        return None
    return next((spec for spec in FAMILIES.values() if spec.model_type == model_type), None)
