"""A model's sizes from its ``config.json``: parameters per engine layer, the parameters one token
computes with, and the LoRA adapters a run adds.

Dense Llama-shaped blocks, and the mixture-of-experts families of ``engine.model.families``
(their expert facts come from ``model_kind``): Qwen3-MoE (routed experts, some blocks dense),
GPT-OSS (experts and router with biases, attention sinks), DeepSeek-V3 (multi-head latent
attention, shared experts, the first blocks dense). The planner does not lay a block out itself:
it asks the family's ``FamilySpec.block_kind`` for the block's weights and their sizes (fused
projections, latent attention, extra norms, biases, experts). A block's
weights are every expert's (what is uploaded and kept in host RAM); its *active* weights are the
ones a token runs through (the routed experts it picks, the shared experts, the router,
attention), which is what its FLOPs count.

A vision-language model is its language model's shape (``text_config``, laid out by its
``VisionSpec.text``) with its vision tower and projector (``engine.planner.vision.Tower``) in the
input layer, as the engine runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.model.block_layout import BlockKind, Mla, Moe
from engine.model.families import FAMILIES, family_of_model_type, model_kind
from engine.model.family_spec import BlockSizes, FamilySpec
from engine.planner.vision import Tower
from engine.vision.families import vision_spec

__all__ = ["SHAPE_LIMITS", "Mla", "Moe", "Shape"]
# the blocks of an architecture the engine does not train are counted as Llama's
_LLAMA = FamilySpec("LlamaForCausalLM")

# The largest value of each size in a config.json a plan accepts: far above any real model (the
# largest open ones have ~128 layers, hidden 16k, vocabularies of 256k, 384 experts), small
# enough that the FLOP and byte counts stay finite floats. Depth is held closer: the partition
# search grows fast with it (256 layers take seconds, 1024 minutes).
SHAPE_LIMITS: dict[str, int] = {
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_hidden_layers": 256,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
    "experts": 1 << 14,
    "active_experts": 1 << 14,
    "shared_experts": 1 << 10,
    "expert_intermediate": 1 << 22,
    "q_lora_rank": 1 << 20,
    "kv_lora_rank": 1 << 20,
    "qk_rope_head_dim": 1 << 16,
    "qk_nope_head_dim": 1 << 16,
    "v_head_dim": 1 << 16,
}
# peft's rewrite of LoRA targets into stacked expert weights (``MoeSpec.peft_remap``)
_REMAP = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
    "gate": "gate.weight",
}


@dataclass(frozen=True)
class Shape:
    """What a decoder-only model's ``config.json`` says about its sizes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    architecture: str | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    block_extra: int = 0  # per block, beyond the two norms: q/k norms, attention sinks
    moe: Moe | None = None
    mla: Mla | None = None
    context: int | None = None  # max_position_embeddings, when the config gives a sane one
    # "mxfp4": the checkpoint stores the expert weights in MXFP4 (GPT-OSS), kept so in a 4-bit base
    stored_experts: str | None = None
    tower: Tower | None = None  # a vision-language model's vision tower and projector

    @classmethod
    def from_config(cls, config: dict[str, Any], *, processor: dict[str, Any] | None = None) -> Shape:
        """Read the sizes of a Llama-shaped or mixture-of-experts config (text config of a
        multimodal one, and a vision-language model's tower, its image costs by the image
        processor's settings ``processor`` when given).

        Raises:
            ConfigError: a size is missing or not a positive integer (``field`` is its key).
        """
        cfg = config.get("text_config") or config
        if not isinstance(cfg, dict):
            raise ConfigError("text_config", f"config.json: text_config={cfg!r} must be a mapping")
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        sizes = {key: _size(key, cfg.get(key)) for key in need}
        for key in ("num_key_value_heads", "head_dim"):  # optional: derived when absent
            if cfg.get(key) is not None:
                sizes[key] = _size(key, cfg[key])
        heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        head_dim = sizes.get("head_dim", hidden // heads)
        if head_dim < 1:
            raise ConfigError(
                "num_attention_heads",
                f"config.json: num_attention_heads={heads} exceeds hidden_size={hidden} (no head_dim given)",
            )
        kind = _kind(cfg | {"architectures": config.get("architectures") or cfg.get("architectures")})
        family = _family(kind.architecture)
        vision = vision_spec(kind.architecture)
        moe = None
        if kind.moe:
            moe = Moe(
                experts=_size("experts", kind.experts),
                active=_size("active_experts", kind.active_experts),
                shared=_size("shared_experts", kind.shared_experts) if kind.shared_experts else 0,
                intermediate=_size("expert_intermediate", kind.expert_intermediate),
                dense_blocks=kind.dense_blocks,
                biases=family is not None and family.moe is not None and family.moe.biases,
            )
            if moe.active > moe.experts:
                raise ConfigError(
                    "active_experts",
                    f"config.json: {moe.active} experts per token exceed the {moe.experts} experts",
                    value=moe.active,
                )
        mla = None
        if family is not None and family.attention.latent:
            q_rank = cfg.get("q_lora_rank")
            mla = Mla(
                q_rank=0 if q_rank is None else _size("q_lora_rank", q_rank),
                **{
                    name: _size(key, cfg.get(key))
                    for name, key in (
                        ("kv_rank", "kv_lora_rank"),
                        ("rope", "qk_rope_head_dim"),
                        ("nope", "qk_nope_head_dim"),
                        ("v", "v_head_dim"),
                    )
                },
            )
        kv_heads = sizes.get("num_key_value_heads", heads)
        # the norms and biases a block holds follow the family its (text) config's model_type names
        layout = vision.text if vision is not None else family_of_model_type(cfg.get("model_type"))
        extra = 0 if layout is None else layout.block_extra(BlockSizes(hidden, heads, kv_heads, head_dim))
        if mla is not None:  # the q and kv latents' norms
            extra = mla.q_rank + mla.kv_rank
        bias = bool(cfg.get("attention_bias", False))
        context = cfg.get("max_position_embeddings")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            context = None
        quantization = config.get("quantization_config")
        stored = (
            isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4" and moe is not None
        )
        return cls(
            hidden=hidden,
            intermediate=sizes["intermediate_size"],
            layers=sizes["num_hidden_layers"],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=sizes["vocab_size"],
            tied=bool(
                (config if vision is not None and "tie_word_embeddings" in config else cfg).get(
                    "tie_word_embeddings", False
                )
            ),  # a VLM's head is tied (or not) by its top config
            architecture=kind.architecture,
            qkv_bias=bias or (layout is not None and layout.qkv_bias),
            o_bias=bias,
            block_extra=extra,
            moe=moe,
            mla=mla,
            context=context,
            stored_experts="mxfp4" if stored else None,
            tower=Tower.from_config(config, processor) if vision is not None else None,
        )

    @property
    def family(self) -> FamilySpec | None:
        """The spec of the config's architecture (a VLM's: its language model's; None when the
        engine does not train it)."""
        return _family(self.architecture)

    def is_moe_block(self, block: int) -> bool:
        """Whether decoder block ``block`` (0-based) routes its tokens to experts."""
        return self.moe_of(block) is not None

    def moe_of(self, block: int) -> Moe | None:
        """The experts of decoder block ``block`` (0-based); None in a dense block."""
        return self.moe if self.moe is not None and block not in self.moe.dense_blocks else None

    def block_kind(self, block: int = 0) -> BlockKind:
        """Decoder block ``block`` (0-based) with the sizes of its weights, as its family lays
        it out (``FamilySpec.block_kind``; Llama's layout for an architecture the engine does not
        train)."""
        return (self.family or _LLAMA).block_kind(self, self.moe_of(block))

    def linears(self, block: int = 0) -> dict[str, tuple[int, int]]:
        """(in, out) features of each ``nn.Linear`` of one decoder block, by module path."""
        return self.block_kind(block).linears

    def experts(self, block: int) -> dict[str, tuple[int, int, int]]:
        """(experts, in, out) of each stacked expert parameter of a block (none in a dense one)."""
        return self.block_kind(block).experts

    def block_params(self, block: int = 0) -> int:
        """Parameters of decoder block ``block``: every expert's, the router, attention, norms."""
        return self.block_kind(block).params

    def block_fp32(self, block: int) -> int:
        """Parameters of block ``block`` the engine keeps in fp32 whatever the compute dtype:
        the family's fp32 norms and router (``FamilySpec.fp32_norms``, ``fp32_router``)."""
        return self.block_kind(block).fp32

    @property
    def head_fp32(self) -> int:
        """Parameters of the output layer kept in fp32: the final norm of an fp32-norm family."""
        family = self.family
        return self.hidden if family is not None and family.fp32_norms else 0

    def packable(self, block: int, multiple: int) -> list[int]:
        """Sizes (values) of the weights of block ``block`` a 4-bit base packs in NF4
        (``engine.parallel.host.HostState``): its frozen matrices (linear weights and stacked
        expert weights, but those stored in MXFP4: ``stored``) whose size is a multiple of
        ``multiple``; never the router, norms, biases (GPT-OSS's expert biases are matrices too)
        or other vectors."""
        sizes = [a * b for a, b in self.linears(block).values()]
        if self.stored_experts is None:
            sizes += [e * a * b for e, a, b in self.experts(block).values()]
        return [n for n in sizes if n % multiple == 0]

    def stored(self, block: int) -> list[int]:
        """Sizes (values) of the weights of block ``block`` the checkpoint stores in MXFP4 (a
        4-bit base keeps them so: ``engine.model.prequantized``)."""
        if self.stored_experts is None:
            return []
        return [e * a * b for e, a, b in self.experts(block).values()]

    def active_block_params(self, block: int = 0) -> int:
        """Parameters one token of block ``block`` computes with: the routed experts it picks,
        not all of them (equal to ``block_params`` for a dense block)."""
        return self.block_kind(block).active_params

    def layer_params(self) -> list[int]:
        """Parameters per engine layer: input layer (a VLM's vision tower and projector too), each
        block, output layer (a tied head counts once)."""
        embed = self.vocab * self.hidden
        head = self.hidden + (0 if self.tied else embed)
        vision = self.tower.params if self.tower is not None else 0
        return [embed + vision, *[self.block_params(b) for b in range(self.layers)], head]

    def mlp_width(self, block: int) -> int:
        """The MLP intermediate width one token's activations have in a block (its routed and
        shared experts' widths in a mixture-of-experts block)."""
        moe = self.moe_of(block)
        if moe is None:
            return self.intermediate
        return (moe.active + moe.shared) * moe.intermediate

    def lora_block_params(
        self, block: int, rank: int, targets: tuple[str, ...], parameters: tuple[str, ...] = ()
    ) -> int:
        """Trainable parameters of one block's LoRA adapters, as peft makes them.

        Args:
            block: the decoder block (0-based).
            rank: the LoRA rank r; a linear (in, out) gets r * (in + out).
            targets: ``target_modules``: a module matches when its path is a target or ends in
                ``.target`` (peft's rule); the families that fuse projections have modules of
                those names (Phi-3's ``qkv_proj``, Phi-3's and GLM-4's ``gate_up_proj``).
            parameters: ``target_parameters``: stacked expert parameters (``experts.down_proj``),
                each adding r * (in + out) per expert.
        """
        modules = self.linears(block)
        params: dict[str, int] = {p: rank for p in parameters}
        family = self.family
        if family is not None and family.moe is not None and family.moe.peft_remap:
            remapped = [t for t in targets if _leaf(t) in _REMAP]
            targets = tuple(t for t in targets if t not in remapped)
            for t in remapped:  # gate and up fuse: both or neither (peft refuses one alone)
                params[_REMAP[_leaf(t)]] = rank * (2 if _leaf(t) in ("gate_proj", "up_proj") else 1)
        count = sum(rank * (a + b) for name, (a, b) in modules.items() if _matches(name, targets))
        stacked = self.experts(block)
        moe = self.moe_of(block)
        if moe is not None:  # the router's weight (peft's remap of a ``gate`` target)
            stacked |= {"mlp.gate.weight": (1, self.hidden, moe.experts)}
        for name, (e, a, b) in stacked.items():
            ranks = [r for target, r in params.items() if _matches(name, (target,))]
            count += sum(e * r * (a + b) for r in ranks[:1])
        return count

    def lora_params(self, rank: int, targets: tuple[str, ...], parameters: tuple[str, ...] = ()) -> int:
        """Trainable parameters of the LoRA adapters of every block."""
        return sum(self.lora_block_params(b, rank, targets, parameters) for b in range(self.layers))


def _family(architecture: str | None) -> FamilySpec | None:
    """The family spec of an architecture: a text family's, a VLM's language model's, else None."""
    spec = vision_spec(architecture)
    return spec.text if spec is not None else FAMILIES.get(architecture or "")


def _leaf(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    """peft's rule for a list of targets: the whole path, or its tail after a dot."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _kind(config: dict[str, Any]) -> Any:
    """``model_kind`` of a config dict; a malformed family number is a ``ConfigError``."""
    try:
        return model_kind(config)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(
            "architectures", f"config.json: unreadable mixture-of-experts sizes ({exc})"
        ) from exc


def _size(key: str, value: Any) -> int:
    """A config.json size: a positive integer within ``SHAPE_LIMITS``, else ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SHAPE_LIMITS[key]:
        raise ConfigError(
            key, f"config.json: {key}={value!r} must be an integer from 1 to {SHAPE_LIMITS[key]}", value=value
        )
    return value
