"""Measure what autograd keeps of a decoder block for its backward, and fit the planner's table.

A block of a small model runs forward with gradients on inside
``torch.autograd.graph.saved_tensors_hooks``; the bytes it keeps are the unique storages of the
saved tensors, less the layer's own weights and the micro-batch's shared context (masks, rotary
tables, position ids: one per stage, not per block). Done over a few small shapes per family, a
least-squares fit gives coefficients over the widths of ``engine.planner.activations.FEATURES``
that the torch-free planner reads from ``engine.planner.activation_table``.

Attention runs as the engine runs it (the model's SDPA), without padding and without a sliding
window shorter than the sequence: then the CPU kernel is the fused one that keeps a log-sum-exp
and no scores, as the GPU kernels do.

Regenerate the table with ``python -m engine.model.activations``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.model.adapter import AdaptedModel, Layer
from engine.model.families import FAMILIES
from engine.planner.activations import FEATURES, features
from engine.planner.shapes import Shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = (2, 32)  # the measured micro-batch: 2 sequences of 32 tokens
# the fitted families: every one whose blocks keep a fixed number of bytes per token (a family
# that does not says why in its spec's ``unmeasured``)
MEASURED = tuple(a for a, spec in FAMILIES.items() if spec.unmeasured is None)
# the sizes each fit varies, on top of a family's tiny config; every width moves in some row
# and no two move together, so each coefficient is determined
VARIATIONS: tuple[dict[str, int], ...] = (
    {},
    {"hidden_size": 48},
    {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4},
    {"intermediate_size": 96, "moe_intermediate_size": 24},
    {"head_dim": 16},
    {"num_key_value_heads": 4},
    {"num_attention_heads": 2, "num_key_value_heads": 1},
    {"experts": 6, "active_experts": 3},
    {"experts": 8, "active_experts": 1, "intermediate_size": 48, "moe_intermediate_size": 8},
)
TABLE_PATH = Path(__file__).resolve().parents[1] / "planner" / "activation_table.py"


def small_config(architecture: str, **sizes: int) -> Any:
    """A small config of ``architecture``: the family's tiny config, 2 blocks, full attention.

    ``experts`` and ``active_experts`` set the family's own attribute names for them.
    """
    import transformers

    spec = FAMILIES[architecture]
    values: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    values.update(copy.deepcopy(dict(spec.tiny_config)))
    if "head_dim" in values or "head_dim" in sizes:
        values["head_dim"] = sizes.pop("head_dim", 8)
    if spec.moe is not None:
        values[spec.moe.experts] = sizes.pop("experts", values.get(spec.moe.experts, 4))
        values[spec.moe.active] = sizes.pop("active_experts", values.get(spec.moe.active, 2))
        if "moe_intermediate_size" in sizes and spec.moe.expert_intermediate != "moe_intermediate_size":
            sizes.pop("moe_intermediate_size")
    else:
        sizes = {k: v for k, v in sizes.items() if k not in ("experts", "active_experts")}
        sizes.pop("moe_intermediate_size", None)
    values.update(sizes)
    # no window shorter than the sequence: the CPU's fused attention kernel takes no mask
    for key in ("sliding_window", "use_sliding_window"):
        if key in values:
            values[key] = 4096 if key == "sliding_window" else False
    config_class = getattr(transformers, architecture).config_class
    return config_class(**values)


def block_saved_bytes(adapted: AdaptedModel, layer: Layer, x: torch.Tensor) -> int:
    """Bytes of the unique storages a block's forward saves for backward, weights and context out.

    Args:
        adapted: the model ``layer`` belongs to (it builds the micro-batch's context).
        layer: a decoder block.
        x: its input hidden states ``[b, s, h]``, requiring grad.
    """
    batch, seq = x.shape[:2]
    ctx = adapted.build_context(adapted.rotary, x, torch.ones(batch, seq, dtype=torch.long))
    shared = [*layer.tensors.values(), ctx.position_ids, *ctx.masks.values()]
    shared += [t for table in ctx.position_embeddings.values() for t in table]
    skip = {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer.module(x, **layer.arguments(ctx, layer.attention_type))
    del out
    return sum(kept.values())


def measure(config: Any, architecture: str, dtype: str) -> list[tuple[Shape, int, float]]:
    """Per-token saved bytes of every block of a model of ``config``: (shape, block, bytes)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).to(DTYPES[dtype])
    model.train()
    adapted = AdaptedModel(model)
    shape = Shape.from_config(config.to_dict() | {"architectures": [architecture]})
    batch, seq = TOKENS
    g = torch.Generator().manual_seed(1)
    rows = []
    for b, layer in enumerate(adapted.layers[1:-1]):
        x = torch.randn(batch, seq, shape.hidden, generator=g).to(DTYPES[dtype]).requires_grad_()
        rows.append((shape, b, block_saved_bytes(adapted, layer, x) / (batch * seq)))
    return rows


def fit(rows: Sequence[tuple[Shape, int, float]]) -> dict[str, float]:
    """Least-squares coefficients over ``FEATURES`` (those no row uses left out), rounded to 1/64.

    Raises:
        RuntimeError: the fit misses a measured row by more than 1% (the widths do not explain
            the block).
    """
    table = [features(shape, b) for shape, b, _ in rows]
    used = [name for name in FEATURES if any(f[name] for f in table)]
    a = torch.tensor([[f[name] for name in used] for f in table], dtype=torch.float64)
    y = torch.tensor([bytes_ for _, _, bytes_ in rows], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    coef = {name: round(float(c) * 64) / 64 for name, c in zip(used, solution, strict=True)}
    coef = {name: c for name, c in coef.items() if c}
    for f, (_, _, measured) in zip(table, rows, strict=True):
        predicted = sum(c * f[name] for name, c in coef.items())
        if abs(predicted - measured) > 0.01 * measured:
            raise RuntimeError(f"fit {predicted:.1f} vs measured {measured:.1f} bytes per token")
    return coef


def family_rows(architecture: str, dtype: str) -> list[tuple[Shape, int, float]]:
    """The measured rows of every variation of one family."""
    rows: list[tuple[Shape, int, float]] = []
    for sizes in VARIATIONS:
        rows += measure(small_config(architecture, **sizes), architecture, dtype)
    return rows


def build_table(architectures: Iterable[str] = MEASURED) -> dict[str, dict[str, dict[str, float]]]:
    """Coefficients per architecture and dtype, fitted from fresh measurements."""
    return {a: {dt: fit(family_rows(a, dt)) for dt in DTYPES} for a in architectures}


def render(table: dict[str, dict[str, dict[str, float]]]) -> str:
    """The source of ``engine.planner.activation_table``."""
    lines = ["{"]
    for arch, rows in table.items():
        lines.append(f"    {arch!r}: {{")
        for dtype, coef in rows.items():
            lines.append(f"        {dtype!r}: {{")
            lines += [f"            {name!r}: {c!r}," for name, c in coef.items()]
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    body = "\n".join(lines).replace("'", '"')
    return (
        '"""Bytes per token a decoder block keeps for backward: coefficients over the widths of\n'
        "``engine.planner.activations.FEATURES``, by architecture and compute dtype.\n\n"
        "Generated by ``python -m engine.model.activations`` from saved-tensor measurements; do not\n"
        'edit by hand (``tests/engine/test_activations.py`` re-measures and fails when stale).\n"""\n\n'
        f"TABLE: dict[str, dict[str, dict[str, float]]] = {body}\n"
    )


def main(argv: Sequence[str] = ()) -> None:
    """Measure every family and rewrite the table (``--check``: exit 1 when it is stale)."""
    source = render(build_table())
    if "--check" in argv:
        sys.exit(0 if TABLE_PATH.read_text() == source else 1)
    TABLE_PATH.write_text(source)


if __name__ == "__main__":
    main(sys.argv[1:])
