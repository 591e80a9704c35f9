"""A 4-bit base in the plan: the bytes of each block's packed weights, their decoded copies and
the decoding's scratch memory.

With ``method.base_bits: 4`` (``engine.model.quant``) the frozen matrices of the decoder blocks
that ``engine.parallel.host.HostState`` packs (``Shape.packable``) are kept in NF4 in host RAM
and uploaded so; everything else of a block stays in the compute dtype. The planner counts:

- **upload bytes** (host RAM and PCIe): each packed tensor's buffer (``packed_bytes``, the same
  arithmetic as ``engine.model.quant.packed_bytes``, here without torch; ``mxfp4_bytes`` for
  the expert weights a GPT-OSS checkpoint stores in MXFP4, kept so), the rest of the block at
  ``d`` bytes a value (4 for what the family keeps in fp32: ``Shape.block_fp32``);
- **decoded bytes** (GPU, while the stage runs): the worker decodes every packed weight of a
  stage at its start (``engine.parallel.executor``) and computes with the dense copies, so a
  stage holds its packed buffers and the decoded weights (``d`` bytes a value);
- **scratch** (GPU, once per stage): decoding one tensor looks its codes up as int32 pairs
  (2 bytes a value) into values of the compute dtype before scaling them into the result
  (``DECODE_SCRATCH_BYTES``), for the largest packed tensor of the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.planner.shapes import Shape

BASE_BITS = (16, 4)
BLOCK = 64  # values per absmax scale (engine.model.quant.BLOCK)
SCALER_BLOCK = 256  # scales per second-level scale, fewer where a tensor has fewer blocks
ALIGN = 16  # each part of a packed buffer starts 16-byte aligned
PACK_MULTIPLE = 2 * BLOCK  # a tensor packs when its size is a whole number of these
FP32_BYTES = 4


def decode_scratch_bytes(dtype_bytes: int) -> int:
    """Scratch bytes a value of the tensor being decoded takes beyond its result: the int32
    code pairs (2) and the looked-up values (``dtype_bytes``). Measured on CPU: 2.5 bytes a
    value in bfloat16, 4.6 in float32 (``tests/engine/test_planner_quantized.py``)."""
    return 2 + dtype_bytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def scaler_block(numel: int) -> int:
    """The second-level block of a tensor's scales: 256, or the largest power of two dividing
    its number of blocks."""
    blocks, size = numel // BLOCK, SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


def packed_bytes(numel: int, dtype_bytes: int = 2) -> int:
    """Bytes of the packed buffer of a tensor of ``numel`` values (a multiple of
    ``PACK_MULTIPLE``) decoding to ``dtype_bytes`` a value: the codes (half a byte a value), one
    int8 scale a block, the scales' factors, their mean and the code book."""
    blocks = numel // BLOCK
    parts = (numel // 2, blocks, blocks // scaler_block(numel) * dtype_bytes, dtype_bytes, 16 * dtype_bytes)
    return sum(_align(p) for p in parts)


@dataclass(frozen=True)
class BlockBytes:
    """One decoder block's weights on the way to a worker, in bytes."""

    upload: int  # host RAM and PCIe: packed buffers plus the rest in the compute dtype
    decoded: int  # the dense copies of the packed weights a running stage holds
    scratch: int  # decoding the block's largest packed tensor


@lru_cache(maxsize=4096)
def block_bytes(shape: Shape, block: int, dtype_bytes: int, base_bits: int) -> BlockBytes:
    """The bytes of decoder block ``block`` (0-based) with a ``base_bits`` base."""
    params = shape.block_params(block)
    wide = shape.block_fp32(block) * (FP32_BYTES - dtype_bytes)  # what fp32 adds to those kept so
    if base_bits == 16:
        return BlockBytes(upload=params * dtype_bytes + wide, decoded=0, scratch=0)
    sizes = shape.packable(block, PACK_MULTIPLE)
    stored = shape.stored(block)
    packed = sum(packed_bytes(n, dtype_bytes) for n in sizes) + sum(mxfp4_bytes(n) for n in stored)
    every = sizes + stored
    return BlockBytes(
        upload=(params - sum(every)) * dtype_bytes + wide + packed,
        decoded=sum(every) * dtype_bytes,
        scratch=max(every, default=0) * decode_scratch_bytes(dtype_bytes),
    )


def mxfp4_bytes(numel: int) -> int:
    """Bytes of an MXFP4 weight kept as its checkpoint stores it (``engine.model.prequantized``):
    16 bytes of codes and one exponent byte per 32 values, each part aligned."""
    return _align(numel // 2) + _align(numel // 32)
