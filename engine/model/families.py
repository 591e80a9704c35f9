"""The Hugging Face model families the engine trains, one ``FamilySpec`` each.

A spec says where the adapter finds the parts of a ``*ForCausalLM`` (embeddings, decoder
blocks, final norm, rotary embedding, LM head), which attention mask each block gets, and which
linear layers LoRA adapts by default. The families supported today share the Llama skeleton,
so adding another Llama-shaped family is one line in ``FAMILIES``; what a family does outside
its decoder blocks besides the Llama steps (Granite scales the embeddings and divides the
logits, Gemma 3 soft-caps the logits and has one rotary table per attention type) is a config
attribute or a flag named in its spec. Whatever differs inside the blocks (Gemma 3's extra
norms, GPT-OSS's attention sinks, DeepSeek-V3's latent attention, the experts and routers of
the mixture-of-experts families) runs in the model's own block modules. No torch import here.
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


def qwen3_moe_dense_blocks(config: Any) -> frozenset[int]:
    """Qwen3-MoE: blocks in ``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense."""
    step = int(_get(config, "decoder_sparse_step", 1) or 1)
    only = set(_get(config, "mlp_only_layers", None) or ())
    blocks = int(_get(config, "num_hidden_layers", 0))
    return frozenset(i for i in range(blocks) if i in only or (i + 1) % step != 0)


def deepseek_dense_blocks(config: Any) -> frozenset[int]:
    """DeepSeek-V3: the first ``first_k_dense_replace`` blocks are dense."""
    return frozenset(range(int(_get(config, "first_k_dense_replace", 0) or 0)))


def _get(config: Any, name: str, default: Any = None) -> Any:
    """An attribute of a config object or a key of a ``config.json`` dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


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
        logit_softcap: the config attribute with the final logit soft-cap ``c`` (Gemma 3's
            ``final_logit_softcapping``: ``logits = tanh(logits / c) * c``), or None; a config
            value of None means no cap.
        rotary_per_attention_type: the rotary embedding takes the block's attention type
            (Gemma 3: local and global ``rope_theta``) and is called once per type.
        refused: ``(attribute, why)`` pairs: config flags the engine cannot train with when set.
        moe: the expert facts of a mixture-of-experts family, or None.
        expert_parameters: the expert weights LoRA can adapt (peft ``target_parameters``
            names): what ``"experts"`` stands for in a run's ``method.target_parameters``.
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

    def refusal(self, config: Any) -> str | None:
        """Why the engine cannot train a model with ``config`` (None when it can)."""
        for attribute, why in self.refused:
            value = _get(config, attribute, None)
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
    """

    experts: str
    active: str = "num_experts_per_tok"
    expert_intermediate: str = "moe_intermediate_size"
    router: str = ""
    aux_loss: bool = True
    shared_experts: str | None = None
    dense_blocks: Callable[[Any], frozenset[int]] = lambda config: frozenset()


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
        FamilySpec(
            "Gemma3ForCausalLM",
            logit_softcap="final_logit_softcapping",
            rotary_per_attention_type=True,
            refused=GEMMA3_REFUSED,
        ),
        FamilySpec(
            "Qwen3MoeForCausalLM",
            lora_targets=ATTENTION_LINEAR,
            moe=MoeSpec("num_experts", router="Qwen3MoeTopKRouter", dense_blocks=qwen3_moe_dense_blocks),
            expert_parameters=EXPERT_PARAMETERS,
        ),
        FamilySpec(
            "GptOssForCausalLM",
            lora_targets=ATTENTION_LINEAR,
            expert_parameters=EXPERT_PARAMETERS,
            moe=MoeSpec(
                "num_local_experts", expert_intermediate="intermediate_size", router="GptOssTopKRouter"
            ),
        ),
        FamilySpec(
            "DeepseekV3ForCausalLM",
            lora_targets=DEEPSEEK_ATTENTION,
            expert_parameters=EXPERT_PARAMETERS,
            moe=MoeSpec(
                "n_routed_experts",
                router="DeepseekV3TopkRouter",
                aux_loss=False,
                shared_experts="n_shared_experts",
                dense_blocks=deepseek_dense_blocks,
            ),
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
    archs = _get(config, "architectures", None) or []
    if not archs:
        return ModelKind(None, False, "config.json names no architecture")
    spec = FAMILIES.get(archs[0])
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
        value = _get(config, name, None)
        if value is None and name in _ALIASES:
            value = _get(config, _ALIASES[name], None)
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
    if spec is None:
        raise ConfigError(
            "model.path",
            f"unsupported architecture {architecture}: the engine supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (optionally wrapped by peft)",
            value=architecture,
        )
    return spec
