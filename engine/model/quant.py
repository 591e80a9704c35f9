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
base weights were replaced by ``dequantized``. ``pack`` goes ``CHUNK`` values at a time (whole
blocks), writing into the result as it goes: its scratch memory is one chunk's, about 40 MB, and
the blocks' absmax (2 bytes a block in bfloat16), whatever the tensor; the bytes are those of
packing the tensor whole.
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
__all__ += ["CHUNK", "CHUNK_SCRATCH_BYTES", "offsets", "scaler_block", "view_part"]

CHUNK = 1 << 22  # values packed at a time (4 Mi: whole blocks, whole groups of their scales)
# the most scratch bytes a value of a chunk takes while it is packed (its float32 copy and the
# scaled one, the int32 codes, ...): 9 in bfloat16, 11 cast from float32, 13 from bfloat16 to
# float32 (measured: tests/engine/model/test_quant_chunks.py); 38-55 MB for a ``CHUNK``
CHUNK_SCRATCH_BYTES = 13


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


def _codes(values: torch.Tensor, absmax: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Each value's nearest NF4 code, two to a byte (the first in the high nibble), as torchao
    lays them out; ``values`` is ``[blocks, BLOCK]``, ``absmax`` each block's absolute maximum.
    Found by a search over the midpoints between the codes, not by torchao's distance to all 16
    codes, which takes about 50x longer on a CPU; the distances are exact (float32), where
    torchao's are rounded to the weight's dtype, so a bfloat16 value within a rounding of halfway
    between two codes may take the other one."""
    # the float32 absmax of a block is its absmax in the weight's dtype, widened: exact
    scaled = (values.float() / absmax.float().unsqueeze(1)).reshape(-1)
    book = book.float()
    codes = torch.bucketize(scaled, (book[1:] + book[:-1]) / 2, out_int32=True).to(torch.uint8)
    return codes[::2] << 4 | codes[1::2]


def _double_quantize(
    absmax: torch.Tensor, size: int, chunk: int, *, scales: torch.Tensor, factors: torch.Tensor
) -> torch.Tensor:
    """torchao's ``NF4Tensor.double_quantize_scalers`` given the blocks' absmax (``[blocks]``, in
    the weight's dtype), written into ``scales`` (int8, ``[blocks]``) and ``factors`` (one a
    group of ``size`` scales), ``chunk`` scales at a time (a multiple of ``size``): the same
    arithmetic on the same values (tests compare them), without temporaries the size of all the
    scales.

    Returns:
        The absmax's mean (a scalar in their dtype).
    """
    mean = absmax.mean()  # over the whole tensor, as torchao takes it: the same sum, bit for bit
    for start in range(0, absmax.numel(), chunk):
        groups = (absmax[start : start + chunk] - mean).view(-1, size)
        factor = 256 / (2 * groups.abs().max(dim=1).values)
        quantized = (groups * factor.unsqueeze(-1)).round().clamp(-128, 127)
        scales[start : start + groups.numel()] = quantized.flatten()
        factors[start // size : start // size + factor.numel()] = factor
    return mean


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


def pack(tensor: torch.Tensor, dtype: torch.dtype, *, chunk: int = CHUNK) -> tuple[torch.Tensor, Packed]:
    """Quantize ``tensor`` (cast to ``dtype``, the compute dtype) to NF4, ``chunk`` values at a
    time: the scratch memory is at most ``CHUNK_SCRATCH_BYTES`` a value of one chunk, and each
    block's absmax in ``dtype``, whatever the tensor's size; the result is the same, bit for bit,
    as packing it whole. A tensor that is not contiguous is first copied so, in its own dtype.

    Args:
        tensor: a floating tensor of a whole number of ``2 * BLOCK`` values (``quantizable``).
        dtype: the compute dtype it decodes to.
        chunk: values quantized at a time, a multiple of ``2 * BLOCK``.

    Returns:
        The packed ``uint8`` buffer (on the CPU) and its layout.

    Raises:
        ValueError: ``tensor``'s size or ``chunk`` is not a whole number of ``2 * BLOCK`` values.
    """
    numel = tensor.numel()
    if numel == 0 or numel % (2 * BLOCK):
        raise ValueError(f"pack: a tensor of {numel} values is not a whole number of {2 * BLOCK} values")
    if chunk <= 0 or chunk % (2 * BLOCK):
        raise ValueError(f"pack: chunk={chunk} is not a whole number of {2 * BLOCK} values")
    nf4_cls, _ = _nf4()
    flat = tensor.detach().reshape(-1)  # a view of a contiguous tensor
    blocks, size = numel // BLOCK, scaler_block(numel)
    # the code book as torchao builds it (from a block of zeros: nothing else to quantize)
    book = nf4_cls.from_tensor(torch.zeros(2 * BLOCK, dtype=dtype), BLOCK, 1).nf4
    item = book.element_size()
    parts, total = offsets([(numel // 2, 1), (blocks, 1), (blocks // size, item), (1, item), (16, item)])
    buffer = torch.zeros(total, dtype=torch.uint8)
    codes, scales = view_part(buffer, parts[0], torch.uint8), view_part(buffer, parts[1], torch.int8)
    factors, mean = view_part(buffer, parts[2], dtype), view_part(buffer, parts[3], dtype)
    absmax = torch.empty(blocks, dtype=dtype)  # [blocks]: torchao's ``get_block_absmax``, by chunks
    for start in range(0, numel, chunk):
        values = flat[start : start + chunk].to("cpu", dtype).view(-1, BLOCK)
        block_max = absmax[start // BLOCK : start // BLOCK + values.shape[0]]
        block_max.copy_(values.abs().max(dim=1).values)
        codes[start // 2 : (start + values.numel()) // 2] = _codes(values, block_max, book)
        del values  # before the next chunk's cast
    step = max(size, chunk // BLOCK // size * size)  # the second level takes whole groups of scales
    mean.copy_(_double_quantize(absmax, size, step, scales=scales, factors=factors))
    view_part(buffer, parts[4], dtype).copy_(book)
    return buffer, Packed(tensor.shape, dtype, size, parts)


def offsets(sizes: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], int]:
    """Where pieces of ``(number of elements, bytes an element)`` lie one after the other, each
    starting ``ALIGN``-byte aligned: each one's (byte offset, number of elements), and the bytes
    of them all."""
    parts, offset = [], 0
    for n, itemsize in sizes:
        parts.append((offset, n))
        offset += (n * itemsize + ALIGN - 1) // ALIGN * ALIGN
    return tuple(parts), offset


def lay_out(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """One ``uint8`` buffer holding ``pieces`` one after the other, each starting ``ALIGN``-byte
    aligned, and each part's (byte offset, number of elements)."""
    parts, total = offsets([(p.numel(), p.element_size()) for p in pieces])
    buffer = torch.zeros(total, dtype=torch.uint8)
    for (start, _), p in zip(parts, pieces, strict=True):
        flat = p.detach().reshape(-1)
        if flat.stride(0) != 1:  # a one-element tensor keeps any stride, even when contiguous
            flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
        raw = flat.view(torch.uint8)
        buffer[start : start + raw.numel()].copy_(raw)
    return buffer, parts


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
