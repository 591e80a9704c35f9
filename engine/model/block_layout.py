"""The kinds of decoder block a family has, and the sizes of their weights.

A block is an attention part and an MLP part. The attention is ``Attention`` (separate q, k, v
and o projections: Llama), ``FusedQkvAttention`` (one ``qkv_proj``: Phi-3) or
``LatentAttention`` (DeepSeek-V3's low-rank q and kv); the MLP is ``GatedMlp`` (gate, up,
down), ``FusedGateUpMlp`` (one ``gate_up_proj``: GLM-4, Phi-3) or, in a mixture-of-experts
block, the family's ``MoeSpec`` (stacked experts, a router, shared experts). A family's
``FamilySpec.block_kind`` puts them together into a ``BlockKind``: every weight of one block
with its size, which the planner counts (``engine.planner.shapes.Shape``) instead of deriving
the layout itself.

The sizes come from a ``BlockDims`` (the planner's ``Shape`` is one). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# (in, out) features of each nn.Linear, by module path inside the block
Linears = dict[str, tuple[int, int]]
# (experts, in, out) of each stacked expert parameter, by parameter path inside the block
Stacks = dict[str, tuple[int, int, int]]


@dataclass(frozen=True)
class Moe:
    """The experts of a mixture-of-experts block (``engine.model.families.ModelKind``)."""

    experts: int
    active: int
    shared: int
    intermediate: int  # one expert's MLP width
    dense_blocks: frozenset[int]
    biases: bool = False  # GPT-OSS: expert and router biases


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention: low-rank q (``q_lora_rank``, 0: a plain q_proj)
    and a shared low-rank kv with a separate rotary key."""

    q_rank: int
    kv_rank: int
    rope: int
    nope: int
    v: int


class BlockDims(Protocol):
    """The sizes of a model's blocks that their weights' sizes follow from (``Shape`` has them)."""

    @property
    def hidden(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def block_extra(self) -> int: ...
    @property
    def mla(self) -> Mla | None: ...


class Attention:
    """Separate q, k, v and o projections (Llama)."""

    latent = False  # the config's latent sizes (``Mla``) are read

    def linears(self, d: BlockDims) -> Linears:
        q, kv, h = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.hidden
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def biases(self, d: BlockDims) -> int:
        """The projections' biases: q, k and v when the config or family has them, o when the
        config's ``attention_bias`` is set."""
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        return (q + 2 * kv if d.qkv_bias else 0) + (d.hidden if d.o_bias else 0)


class FusedQkvAttention(Attention):
    """q, k and v as one ``qkv_proj`` (Phi-3)."""

    def linears(self, d: BlockDims) -> Linears:
        q, kv, h = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.hidden
        return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h)}


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V3): low-rank q and kv, a separate rotary key."""

    latent = True

    def linears(self, d: BlockDims) -> Linears:
        m, n, h = d.mla, d.heads, d.hidden
        if m is None:
            raise RuntimeError("latent attention: the shape has no latent sizes (Shape.mla)")
        qk = m.nope + m.rope
        q: Linears = (
            {"q_proj": (h, n * qk)}
            if not m.q_rank
            else {"q_a_proj": (h, m.q_rank), "q_b_proj": (m.q_rank, n * qk)}
        )
        return q | {
            "kv_a_proj_with_mqa": (h, m.kv_rank + m.rope),
            "kv_b_proj": (m.kv_rank, n * (m.nope + m.v)),
            "o_proj": (n * m.v, h),
        }


class GatedMlp:
    """Gate, up and down projections (Llama)."""

    def linears(self, d: BlockDims) -> Linears:
        h, i = d.hidden, d.intermediate
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


class FusedGateUpMlp(GatedMlp):
    """Gate and up as one ``gate_up_proj`` (GLM-4, Phi-3)."""

    def linears(self, d: BlockDims) -> Linears:
        h, i = d.hidden, d.intermediate
        return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


ATTENTION = Attention()
FUSED_QKV_ATTENTION = FusedQkvAttention()
LATENT_ATTENTION = LatentAttention()
GATED_MLP = GatedMlp()
FUSED_GATE_UP_MLP = FusedGateUpMlp()


@dataclass(frozen=True)
class BlockKind:
    """One kind of decoder block and the sizes of all its weights.

    Attributes:
        name: ``"dense"`` or ``"experts"`` (a mixture-of-experts block).
        linears: (in, out) of each ``nn.Linear``, by module path in the block.
        experts: (experts, in, out) of each stacked expert weight.
        router: the router's weights.
        biases: every bias (projections, experts, router).
        norms: the two norms and what the family adds (q/k norms, extra norms, attention sinks,
            the latent norms).
        fp32: parameters kept in fp32 whatever the compute dtype (``FamilySpec.fp32_norms``,
            ``fp32_router``).
        inactive: parameters of the routed experts one token does not visit.
    """

    name: str
    linears: Linears
    experts: Stacks = field(default_factory=dict)
    router: int = 0
    biases: int = 0
    norms: int = 0
    fp32: int = 0
    inactive: int = 0

    @property
    def params(self) -> int:
        """Every parameter of the block: all experts, the router, attention, norms."""
        dense = sum(a * b for a, b in self.linears.values())
        stacked = sum(e * a * b for e, a, b in self.experts.values())
        return dense + stacked + self.router + self.biases + self.norms

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: the routed experts it picks, not all."""
        return self.params - self.inactive
