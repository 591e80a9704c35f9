"""What llama.cpp expects of each dense family the engine trains, as GGUF.

``GGUF_FAMILIES`` is keyed by the architecture name of the family's ``FamilySpec``
(``engine.model.families.FAMILIES``): every registered family has an entry here unless its spec
says why it has no GGUF export (``FamilySpec.no_gguf``), and every entry names a registered
family (``tests/engine/model/test_family_registry.py``).

Per family: the llama.cpp architecture (a ``gguf.MODEL_ARCH`` name), the layout changes its
tensors need, the metadata only that family has, and what its config may hold that llama.cpp
cannot run (refused with the field and the value, so no file is written wrong).

- ``permute_qk``: transformers rotates the two halves of each head's q/k vector; llama.cpp's
  Llama-style ("normal") rotary rotates adjacent pairs. The rows of q_proj/k_proj (and their
  biases) are reordered per head, first half and second half interleaved.
- ``norm_offset``: Gemma's RMSNorm multiplies by ``1 + weight``; llama.cpp multiplies by the
  stored weight, so ``weight + 1`` is stored.
- ``swa``: llama.cpp runs sliding-window attention for the architecture (window and per-layer
  pattern from the metadata). For the others a sliding window in the config caps the file's
  context length at the window, where the two attentions agree.
No torch or gguf import at module import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.model.families import FAMILIES
from engine.model.family_spec import config_value
from engine.vision.families import NO_VLM_GGUF, is_vision_config, vision_spec

Writer = Any  # gguf.GGUFWriter
Metadata = Callable[[Any, Writer], None]


@dataclass(frozen=True)
class GgufFamily:
    """How one transformers architecture is written for llama.cpp."""

    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False
    norm_offset: float = 0.0
    swa: bool = False
    metadata: Metadata | None = None
    refusal: Callable[[Any], str | None] | None = None
    llama3_rope: bool = False  # llama.cpp reads Llama 3's rotary scaling from a rope_freqs tensor


def value(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def head_dim(config: Any) -> int:
    explicit = value(config, "head_dim")
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any, attention: str = "full_attention") -> dict[str, Any]:
    """The rotary parameters of one attention type (Gemma 3 keeps one set per type)."""
    params = dict(value(config, "rope_parameters", None) or {})
    if attention in params and isinstance(params[attention], dict):
        return dict(params[attention])
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        return dict(params["full_attention"])
    if "rope_theta" not in params and value(config, "rope_theta") is not None:
        params["rope_theta"] = config.rope_theta
    return params


def sliding_layers(config: Any) -> list[bool] | None:
    """Which blocks attend through a sliding window; None when none do."""
    window = value(config, "sliding_window")
    if not window:
        return None
    types = value(config, "layer_types")
    if types is not None:
        pattern = [t == "sliding_attention" for t in types]
        return pattern if any(pattern) else None
    if value(config, "use_sliding_window") is False:
        return None
    return [True] * config.num_hidden_layers


def _swa_metadata(config: Any, writer: Writer) -> None:
    pattern = sliding_layers(config)
    if pattern is None:
        return
    writer.add_sliding_window(int(config.sliding_window))
    writer.add_sliding_window_pattern(pattern)
    local = value(config, "rope_parameters", {}) or {}
    if isinstance(local.get("sliding_attention"), dict) and "rope_theta" in local["sliding_attention"]:
        writer.add_rope_freq_base_swa(float(local["sliding_attention"]["rope_theta"]))


def _gemma3_metadata(config: Any, writer: Writer) -> None:
    _swa_metadata(config, writer)
    cap = value(config, "final_logit_softcapping")
    if cap:
        writer.add_final_logit_softcapping(float(cap))


def _gemma3_refusal(config: Any) -> str | None:
    if value(config, "attn_logit_softcapping") is not None:
        return f"attn_logit_softcapping: llama.cpp's Gemma 3 has none (got {config.attn_logit_softcapping})"
    if value(config, "use_bidirectional_attention"):
        return "use_bidirectional_attention: llama.cpp's Gemma 3 is causal"
    # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 62-block 27B
    scalar = float(value(config, "query_pre_attn_scalar", head_dim(config)))
    expected = (
        config.hidden_size / config.num_attention_heads
        if config.num_hidden_layers == 62
        else head_dim(config)
    )
    if not math.isclose(scalar, expected):
        return f"query_pre_attn_scalar: llama.cpp's Gemma 3 uses {expected:g} here (got {scalar:g})"
    return None


def _granite_metadata(config: Any, writer: Writer) -> None:
    writer.add_attention_scale(float(config.attention_multiplier))
    writer.add_embedding_scale(float(config.embedding_multiplier))
    writer.add_residual_scale(float(config.residual_multiplier))
    writer.add_logit_scale(float(config.logits_scaling))


def _granite_refusal(config: Any) -> str | None:
    explicit = value(config, "head_dim")
    if explicit and explicit != config.hidden_size // config.num_attention_heads:
        return f"head_dim: llama.cpp's Granite uses hidden_size / num_attention_heads (got {explicit})"
    return None


def _smollm3_refusal(config: Any) -> str | None:
    # llama.cpp's SmolLM3 leaves out the rotary embedding in every 4th block, fixed
    used = value(config, "no_rope_layers")
    expected = [int((i + 1) % 4 != 0) for i in range(config.num_hidden_layers)]
    if used is not None and [int(bool(u)) for u in used] != expected:
        return (
            "no_rope_layers: llama.cpp's SmolLM3 skips the rotary embedding every 4th block "
            f"(got {list(used)})"
        )
    return None


def _phi3_metadata(config: Any, writer: Writer) -> None:
    original = value(config, "original_max_position_embeddings")
    if original:
        writer.add_rope_scaling_orig_ctx_len(int(original))


GGUF_FAMILIES: dict[str, GgufFamily] = {
    "LlamaForCausalLM": GgufFamily("LLAMA", permute_qk=True, llama3_rope=True),
    "MistralForCausalLM": GgufFamily("LLAMA", permute_qk=True),
    "Qwen2ForCausalLM": GgufFamily("QWEN2"),
    "Qwen3ForCausalLM": GgufFamily("QWEN3"),
    "SmolLM3ForCausalLM": GgufFamily("SMOLLM3", permute_qk=True, refusal=_smollm3_refusal),
    "Glm4ForCausalLM": GgufFamily("GLM4"),
    "Olmo2ForCausalLM": GgufFamily("OLMO2", swa=True, metadata=_swa_metadata),
    "Phi3ForCausalLM": GgufFamily("PHI3", metadata=_phi3_metadata),
    "GraniteForCausalLM": GgufFamily(
        "GRANITE", permute_qk=True, metadata=_granite_metadata, refusal=_granite_refusal
    ),
    "Gemma3ForCausalLM": GgufFamily(
        "GEMMA3", norm_offset=1.0, swa=True, metadata=_gemma3_metadata, refusal=_gemma3_refusal
    ),
}


def family_for(config: Any) -> GgufFamily:
    """The GGUF family of a model config.

    Raises:
        ValueError: an architecture with no GGUF export yet, or a config llama.cpp cannot run
            (naming the field and the value).
    """
    archs = value(config, "architectures") or []
    name = archs[0] if archs else type(config).__name__
    vlm = vlm_gguf_refusal(config)
    if vlm is not None:
        raise ValueError(f"GGUF export: {vlm}")
    family = GGUF_FAMILIES.get(name)
    if family is None:
        spec = FAMILIES.get(name)
        why = f" ({spec.no_gguf})" if spec is not None and spec.no_gguf else ""
        raise ValueError(
            f"GGUF export: {name} cannot be exported yet{why}; "
            f"the families exported are {', '.join(GGUF_FAMILIES)}"
        )
    reason = family.refusal(config) if family.refusal else None
    if reason is None:
        reason = rope_refusal(config, family)
    if reason is not None:
        raise ValueError(f"GGUF export of {name}: {reason}")
    return family


def vlm_gguf_refusal(config: Any) -> str | None:
    """Why a vision-language model (a config object or ``config.json`` dict) has no GGUF export:
    llama.cpp runs its vision tower and projector from a second file (its ``mmproj``), which is not
    written, and a GGUF of the language model alone would drop the images. None: not a VLM."""
    if not is_vision_config(config):
        return None
    archs = config_value(config, "architectures", None) or []
    name = archs[0] if archs else type(config).__name__
    spec = vision_spec(name)
    if spec is None:
        return f"{name}: {NO_VLM_GGUF}"
    return f"{spec.display_name} ({name}): {spec.no_gguf}"


SUPPORTED_ROPE = ("default", "linear", "yarn")


def rope_refusal(config: Any, family: GgufFamily) -> str | None:
    kinds = {
        rope_parameters(config, a).get("rope_type", "default")
        for a in ("full_attention", "sliding_attention")
    }
    for kind in kinds:
        if kind == "llama3" and family.llama3_rope:
            continue
        if kind not in SUPPORTED_ROPE:
            written = ", ".join(SUPPORTED_ROPE)
            return f"rope_parameters.rope_type {kind!r} is not written yet (written: {written})"
    return None
