"""The GGML type of each tensor of a GGUF export, chosen by llama.cpp's rules.

The rules are those of ``llama-quantize`` (src/llama-quant.cpp at llama.cpp commit 0c1e57098:
``tensor_allows_quantization``, ``llama_tensor_get_type_impl``, ``tensor_type_fallback``) for the
dense families we export, with no importance matrix and no overrides, so that our file has the
types llama.cpp gives the same f16 GGUF:

- 1-D tensors and ``*_norm.weight``: float32;
- ``f16`` / ``bf16``: every matrix in that type;
- ``q8_0``: Q8_0 (a tensor whose name does not end in ``weight`` stays float16, as llama.cpp
  leaves it in the f16 file);
- ``q4_k_m``: Q4_K, except Q6_K for ``output.weight`` (``token_embd.weight`` when the output is
  tied to it), and for ``attn_v`` / fused ``attn_qkv`` and ``ffn_down`` of the blocks where
  ``use_more_bits`` holds (the first and last eighth, and every third between).

A block type needs rows (the last dimension) that are a multiple of its block (256 for K-quants,
32 for Q8_0 / Q5_0): otherwise llama.cpp falls back, Q4_K -> Q5_0, Q6_K -> Q8_0, and to F16 when
the row is not a multiple of 32 either. The output matrix whose rows are not a multiple of 256
takes Q8_0 by the output's own rule. Each such choice is returned as a ``TensorType`` with the
type it replaced, so the export can say which tensors fell back and to what.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# llama.cpp's fallbacks for a row that a block type does not divide (tensor_type_fallback)
FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32}


@dataclass(frozen=True)
class TensorType:
    """A tensor's GGML type name (``gguf.GGMLQuantizationType``'s), and the type the mix asked
    for when the rows did not fit it (``wanted``; None when nothing fell back)."""

    name: str
    wanted: str | None = None

    @property
    def qtype(self) -> Any:
        import gguf

        return gguf.GGMLQuantizationType[self.name]

    def describe(self, tensor: str, cols: int) -> str:
        """One line for the export's messages: which tensor fell back, from what, to what."""
        if self.wanted is None:
            raise ValueError(f"{tensor}: {self.name} is no fallback")
        return (
            f"{tensor}: rows of {cols} are not a multiple of {BLOCK[self.wanted]}: "
            f"{self.name} instead of {self.wanted}, as llama-quantize writes it"
        )


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the blocks whose value and down projections keep more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fitted(wanted: str, cols: int) -> TensorType:
    if cols % BLOCK[wanted] == 0:
        return TensorType(wanted)
    fallback = FALLBACKS.get(wanted, wanted)
    if cols % BLOCK[fallback] != 0:
        fallback = "F16"
    return TensorType(fallback, wanted)


def _q4_k_m(name: str, cols: int, *, layer: int | None, layers: int, tied: bool) -> TensorType:
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if cols % 256 != 0:  # the output's own rule, then Q8_0's fallback
            return TensorType(_fitted("Q8_0", cols).name, "Q6_K")
        return TensorType("Q6_K")
    more = layer is not None and use_more_bits(layer, layers)
    # attn_qkv counts as attn_v in llama.cpp (category_is_attn_v), before its own Q5_K rule
    if "attn_v.weight" in name or "attn_qkv.weight" in name or "ffn_down" in name:
        return _fitted("Q6_K" if more else "Q4_K", cols)
    return _fitted("Q4_K", cols)


def tensor_type(
    quant: str, name: str, shape: tuple[int, ...], *, layer: int | None, layers: int, tied: bool
) -> TensorType:
    """The GGML type of the GGUF tensor ``name`` (llama.cpp's layout: rows last) in the export
    ``quant`` (f16, bf16, q8_0, q4_k_m).

    Args:
        quant: the export's type.
        name: the GGUF tensor name (``blk.3.attn_v.weight``).
        shape: the array's shape, the row last.
        layer: the block the tensor belongs to (None outside the blocks).
        layers: the number of blocks.
        tied: the file has no ``output.weight`` (llama.cpp then reads ``token_embd.weight``).

    Returns:
        The type, with the type it replaced when the row length forced a fallback.

    Raises:
        ValueError: an unknown ``quant``.
    """
    if len(shape) < 2 or name.endswith("_norm.weight"):
        return TensorType("F32")
    if quant == "f16":
        return TensorType("F16")
    if quant == "bf16":
        return TensorType("BF16")
    cols = shape[-1]
    if not name.endswith("weight"):
        return TensorType("F16")  # llama.cpp leaves it as the f16 file has it
    if quant == "q8_0":
        return _fitted("Q8_0", cols)
    if quant == "q4_k_m":
        return _q4_k_m(name, cols, layer=layer, layers=layers, tied=tied)
    raise ValueError(f"quant: one of f16, bf16, q8_0, q4_k_m (got {quant!r})")
