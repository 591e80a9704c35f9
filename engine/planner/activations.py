"""What autograd keeps of one decoder block for its backward, per token, from measured coefficients.

The bytes a block saves per token are a linear function of its widths (``FEATURES``): the hidden
size, the widths of q and of k/v, the attention heads (fused attention's fp32 log-sum-exp), the
dense MLP's width, and in a mixture-of-experts block the routed experts' MLP width, the tokens
dispatched to them (``active x hidden``), the router's logits (``experts``) and the routing
indices and weights (``active``). ``engine.model.activations`` measures tiny blocks of each
family with saved-tensor hooks and fits the coefficients per compute dtype (norms upcast to fp32,
so a bf16 block keeps more than half of an fp32 one); the table is ``activation_table.TABLE``.
No torch here: the planner reads the table as plain numbers.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError
from engine.planner.activation_table import TABLE
from engine.planner.shapes import Shape

FEATURES = (
    "hidden",
    "q",
    "kv",
    "heads",
    "mlp",
    "moe_hidden",
    "expert_mlp",
    "routed_hidden",
    "experts",
    "routed",
    "one",
)
# float16 blocks keep what bfloat16 blocks keep (same sizes, same upcasts)
_DTYPE_ROW = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


def features(shape: Shape, block: int) -> dict[str, float]:
    """The widths of decoder block ``block`` (0-based) the coefficients multiply.

    A multi-head latent attention block (DeepSeek-V3) has no q/kv widths of this kind; its
    family is not in the table and is estimated otherwise.
    """
    moe = shape.moe_of(block)
    f = dict.fromkeys(FEATURES, 0.0)
    f["hidden"] = shape.hidden
    f["q"] = shape.heads * shape.head_dim
    f["kv"] = shape.kv_heads * shape.head_dim
    f["heads"] = shape.heads
    f["one"] = 1.0
    if moe is None:
        f["mlp"] = shape.intermediate
    else:
        f["moe_hidden"] = shape.hidden
        f["expert_mlp"] = moe.active * moe.intermediate
        f["routed_hidden"] = moe.active * shape.hidden
        f["experts"] = moe.experts
        f["routed"] = moe.active
        f["mlp"] = moe.shared * moe.intermediate  # shared experts run on every token
    return f


def measured_families(dtype: str) -> frozenset[str]:
    """The architectures the table has coefficients for in ``dtype``."""
    row = _DTYPE_ROW.get(dtype)
    return frozenset(arch for arch, rows in TABLE.items() if row in rows)


def block_bytes_per_token(shape: Shape, block: int, dtype: str) -> float | None:
    """Bytes autograd keeps per token of decoder block ``block`` in compute dtype ``dtype``.

    Returns:
        None when the table has no coefficients for the shape's architecture and dtype (the
        caller falls back to its own estimate).
    """
    rows = TABLE.get(shape.architecture or "")
    row = None if rows is None else rows.get(_DTYPE_ROW.get(dtype, ""))
    if row is None or shape.mla is not None:
        return None
    f = features(shape, block)
    return sum(c * f[name] for name, c in row.items())


def model_shape(config: Any, architecture: str) -> Shape | None:
    """The planner's ``Shape`` of a loaded model's config object (``*ForCausalLM.config``).

    Returns:
        None when the config's sizes are not ones the planner reads (the caller then keeps its
        own estimate).
    """
    try:
        return Shape.from_config(config.to_dict() | {"architectures": [architecture]})
    except ConfigError:
        return None
