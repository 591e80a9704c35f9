"""Frozen base weights in 4 bits: NF4 with block-wise scales, the QLoRA format.

A LoRA run never updates its base, so with ``base_bits=4`` the frozen weights of the decoder
blocks (their linear weights, and a mixture of experts' expert weights) are quantized once at
load and kept *packed* in host memory: the compute copy of such a tensor is one ``uint8`` buffer
holding the NF4 codes, the double-quantized block scales and the constants needed to decode
them. Stages upload it as it is (a quarter of the bytes of bfloat16 on PCIe) and the worker
decodes it on its device, on the compute stream, right before the stage runs (``unpack``).
Embeddings, norms, the LM head and the adapters stay as they are.

The format is torchao's ``NF4Tensor`` (QLoRA's NF4 code book, blocks of 64 values with absmax
scales, the scales quantized again to int8 in blocks of up to 256): its code book and its
double quantization of the scales are used as they are, pure torch operations that run on CPU
workers and on CUDA alike, with no compiled kernels to build. Two steps are our own, for speed
and device memory, and tested against torchao's: the search for each value's code, and the
decoding (``Packed.unpack``: the same arithmetic, bit for bit, without int64 indices). ``unpack``
is deterministic, so an engine run with a 4-bit base equals a plain loop on the same model whose
base weights were replaced by ``dequantized``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# the layout's sizes and their arithmetic live with the planner, which prices packed bytes
# without importing torch
from engine.planner.quantized import ALIGN, BASE_BITS, BLOCK, SCALER_BLOCK, packed_bytes, scaler_block

__all__ = ["ALIGN", "BASE_BITS", "BLOCK", "SCALER_BLOCK", "Packed", "dequantized", "pack"]
__all__ += ["Layout", "attach", "attached", "detach_packed", "lay_out", "packed_bytes", "quantizable"]
__all__ += ["scaler_block", "view_part"]


def _nf4() -> Any:
    """torchao's NF4 tensor class (imported quietly: torchao reports its optional CUDA kernels
    that do not load on this machine, none of which NF4 uses)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return NF4Tensor, SubclassTensorArgs


def _codes(matrix: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Each value's nearest NF4 code, two to a byte (the first in the high nibble), as torchao
    lays them out. Found by a search over the midpoints between the codes, not by torchao's
    distance to all 16 codes, which takes about 50x longer on a CPU; the distances are exact
    (float32), where torchao's are rounded to the weight's dtype, so a bfloat16 value within a
    rounding of halfway between two codes may take the other one."""
    flat = matrix.reshape(-1, BLOCK).float()
    scaled = (flat / flat.abs().amax(dim=1, keepdim=True)).reshape(-1)
    book = book.float()
    codes = torch.bucketize(scaled, (book[1:] + book[:-1]) / 2).to(torch.uint8)
    return codes[::2] << 4 | codes[1::2]


def quantizable(tensor: torch.Tensor) -> bool:
    """Whether a frozen block weight can be packed: a floating matrix (or stack of them, e.g.
    experts) whose size is a whole number of blocks."""
    return tensor.is_floating_point() and tensor.dim() >= 2 and tensor.numel() % (2 * BLOCK) == 0


@dataclass(frozen=True)
class Packed:
    """Where each part of a packed tensor lies in its ``uint8`` buffer, and what it decodes to."""

    shape: torch.Size
    dtype: torch.dtype  # the compute dtype it decodes to
    scaler_block: int
    # (byte offset, number of elements) of: codes (uint8), scales (int8), their factors, the
    # scales' mean, the code book (the last three in ``dtype``)
    parts: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        kinds = (torch.uint8, torch.int8, self.dtype, self.dtype, self.dtype)
        return [view_part(buffer, part, kind) for part, kind in zip(self.parts, kinds, strict=True)]

    def unpack(self, buffer: torch.Tensor) -> torch.Tensor:
        """The dense weight (``dtype``, on ``buffer``'s device) decoded from a packed buffer.

        The same arithmetic as torchao's ``NF4Tensor.get_original_weight`` (so the same bits:
        tests compare them), without its int64 index tensors (8 bytes per value, four times the
        bfloat16 weight being decoded): each byte picks its two values from a 256-entry table.
        """
        codes, scales, factors, mean, book = self._views(buffer)
        blocks = self.numel // BLOCK
        per_block = (scales.view(-1, self.scaler_block) / factors.unsqueeze(-1)).flatten().to(
            self.dtype
        ) + mean
        pairs = torch.stack(torch.meshgrid(book, book, indexing="ij"), dim=-1).reshape(256, 2)
        values = torch.nn.functional.embedding(codes.to(torch.int32), pairs).view(blocks, BLOCK)
        return (values * per_block.unsqueeze(-1)).reshape(self.shape)


def pack(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Packed]:
    """Quantize ``tensor`` (cast to ``dtype``, the compute dtype) to NF4.

    Returns:
        The packed ``uint8`` buffer (on the CPU) and its layout.
    """
    nf4_cls, _ = _nf4()
    shape = tensor.shape
    matrix = tensor.detach().to("cpu", dtype).reshape(-1, shape[-1]).contiguous()
    size = scaler_block(matrix.numel())
    # the code book as torchao builds it (from a block of zeros: nothing else to quantize)
    book = nf4_cls.from_tensor(torch.zeros(2 * BLOCK, dtype=dtype), BLOCK, 1).nf4
    scales, factors, mean = nf4_cls.double_quantize_scalers(matrix.reshape(-1), BLOCK, size)
    buffer, parts = lay_out([_codes(matrix, book), scales, factors, mean.reshape(1), book])
    return buffer, Packed(shape, dtype, size, parts)


def lay_out(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """One ``uint8`` buffer holding ``pieces`` one after the other, each starting ``ALIGN``-byte
    aligned, and each part's (byte offset, number of elements)."""
    parts, offset = [], 0
    for p in pieces:
        parts.append((offset, p.numel()))
        offset += (p.numel() * p.element_size() + ALIGN - 1) // ALIGN * ALIGN
    buffer = torch.zeros(offset, dtype=torch.uint8)
    for (start, _), p in zip(parts, pieces, strict=True):
        flat = p.detach().reshape(-1)
        if flat.stride(0) != 1:  # a one-element tensor keeps any stride, even when contiguous
            flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
        raw = flat.view(torch.uint8)
        buffer[start : start + raw.numel()].copy_(raw)
    return buffer, tuple(parts)


def view_part(buffer: torch.Tensor, part: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Part ``(byte offset, number of elements)`` of a ``lay_out`` buffer, as ``dtype``."""
    offset, n = part
    size = n * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + size].view(dtype)


def dequantized(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a worker computes with for ``tensor`` in a 4-bit base (for reference loops)."""
    buffer, layout = pack(tensor, dtype)
    return layout.unpack(buffer)


class Layout(Protocol):
    """How a packed weight decodes: ``Packed`` (the engine's NF4) and the layouts of checkpoints
    that arrive quantized (``engine.model.prequantized``)."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def unpack(self, buffer: torch.Tensor) -> torch.Tensor: ...


_ATTACHED = "_packed_base"


def attach(param: torch.Tensor, buffer: torch.Tensor, layout: Layout) -> None:
    """Give a frozen parameter loaded packed (its data a zero-size placeholder) its buffer and
    layout, for the host state to keep as its compute copy."""
    setattr(param, _ATTACHED, (buffer, layout))


def attached(param: torch.Tensor) -> tuple[torch.Tensor, Layout] | None:
    """The packed buffer and layout ``attach`` gave a parameter, or None."""
    found: tuple[torch.Tensor, Layout] | None = getattr(param, _ATTACHED, None)
    return found


def detach_packed(param: torch.Tensor) -> None:
    """Forget a parameter's packed buffer (the host state owns it now)."""
    if hasattr(param, _ATTACHED):
        delattr(param, _ATTACHED)
