"""NF4 packing in bounded chunks (``engine.model.quant.pack``): the same bytes as packing the
tensor whole, and scratch memory of one chunk whatever the tensor's size."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.model import quant


def _pack_whole(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, quant.Packed]:
    """The packing as it was before chunking (the reference): float copies and an int64 search
    of the whole tensor, torchao's own double quantization of its scales."""
    nf4_cls, _ = quant._nf4()
    shape = tensor.shape
    matrix = tensor.detach().to("cpu", dtype).reshape(-1, shape[-1]).contiguous()
    size = quant.scaler_block(matrix.numel())
    book = nf4_cls.from_tensor(torch.zeros(2 * quant.BLOCK, dtype=dtype), quant.BLOCK, 1).nf4
    scales, factors, mean = nf4_cls.double_quantize_scalers(matrix.reshape(-1), quant.BLOCK, size)
    flat = matrix.reshape(-1, quant.BLOCK).float()
    scaled = (flat / flat.abs().amax(dim=1, keepdim=True)).reshape(-1)
    wide = book.float()
    codes = torch.bucketize(scaled, (wide[1:] + wide[:-1]) / 2).to(torch.uint8)
    codes = codes[::2] << 4 | codes[1::2]
    buffer, parts = quant.lay_out([codes, scales, factors, mean.reshape(1), book])
    return buffer, quant.Packed(shape, dtype, size, parts)


# (shape, chunk): odd numbers of blocks and of scale groups, sizes that are not a whole number of
# chunks, a chunk of one pair of blocks, a scale step smaller than a group of 256 scales
CASES = [
    ((2, 64), 128),  # one pair of blocks: one chunk, a scale group of 2
    ((3, 128), 256),  # 6 blocks: a chunk and a half, groups of 2
    ((4, 96, 64), 384),  # 384 blocks (groups of 128), a chunk of 6 blocks
    ((7, 3, 384), 1024),  # 126 blocks: groups of 2
    ((5, 130, 192), 4096),  # 1950 blocks: groups of 2, 30.5 chunks
    ((8, 300, 128), 16384),  # 4800 blocks: groups of 64
    ((33, 4096), 65536),  # 2112 blocks: groups of 64, 2.06 chunks
    ((1100, 4096), quant.CHUNK),  # the default chunk: 70400 blocks, groups of 256, 1.07 chunks
]


@pytest.mark.parametrize(("shape", "chunk"), CASES)
def test_chunked_packing_is_bitwise_the_whole_tensors_packing(shape: tuple[int, ...], chunk: int) -> None:
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    w = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 0.1
    w.view(-1)[: 2 * quant.BLOCK] = 0  # a block of zeros (absmax 0), next to a non-zero one
    w.view(-1)[3 * quant.BLOCK :][:7] = 5.0  # a block whose absmax repeats
    sources = (torch.float32, torch.bfloat16, torch.float16)
    for source in sources if shape[0] * shape[-1] < 10**6 else (torch.bfloat16,):
        weight = w.to(source)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            theirs, their_layout = _pack_whole(weight, dtype)
            ours, layout = quant.pack(weight, dtype, chunk=chunk)
            assert layout == their_layout
            # every byte: the codes, the int8 scales, their factors and mean, the book, padding
            assert torch.equal(ours, theirs), (source, dtype)
            if dtype == source:  # a chunk of its own values, not a copy: the same result
                assert torch.equal(quant.pack(weight, dtype)[0], theirs)


def test_the_scales_are_torchaos_double_quantization_in_any_chunk() -> None:
    nf4_cls, _ = quant._nf4()
    g = torch.Generator().manual_seed(3)
    for blocks in (2, 6, 256 * 7, 256 * 9 + 128):
        w = torch.randn(blocks * quant.BLOCK, generator=g).to(torch.bfloat16)
        size = quant.scaler_block(w.numel())
        theirs = nf4_cls.double_quantize_scalers(w, quant.BLOCK, size)
        absmax = w.view(-1, quant.BLOCK).abs().max(dim=1).values
        for step in {size, 2 * size, 256 // size * size, blocks}:
            scales = torch.empty(blocks, dtype=torch.int8)
            factors = torch.empty(blocks // size, dtype=torch.bfloat16)
            mean = quant._double_quantize(absmax, size, step, scales=scales, factors=factors)
            assert torch.equal(scales, theirs[0]) and torch.equal(factors, theirs[1])
            assert torch.equal(mean, theirs[2])


def test_a_size_or_chunk_that_is_not_whole_pairs_of_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="192 values"):
        quant.pack(torch.randn(3, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="chunk=100"):
        quant.pack(torch.randn(2, 64), torch.bfloat16, chunk=100)


class _LiveBytes(TorchDispatchMode):
    """Tensor memory allocated under it, as tracemalloc counts Python's: each new storage's bytes
    from the op that makes it until it is freed, and the most of them alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if _is(a)}
        for o in tree_flatten(out)[0]:
            if not _is(o):
                continue
            storage = o.untyped_storage()  # one Python object per storage (torch keeps it)
            key, nbytes = id(storage), storage.nbytes()
            if key in self._seen or storage.data_ptr() in inputs or nbytes == 0:
                continue  # a view, an in-place result
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def _is(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _scratch(weight: torch.Tensor, dtype: torch.dtype, chunk: int) -> int:
    """The most bytes ``pack`` holds at once beyond its result."""
    with _LiveBytes() as counted:
        buffer, _ = quant.pack(weight, dtype, chunk=chunk)
    assert counted.live == buffer.nbytes  # everything else was freed
    return counted.peak - buffer.nbytes


def test_the_scratch_memory_is_one_chunks_whatever_the_tensor() -> None:
    chunk = 1 << 16
    for source, dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        scratch = {}
        for chunks in (2, 16):
            w = torch.randn(chunks * chunk // 4096, 4096).to(source)
            blocks = w.numel() // quant.BLOCK
            scratch[chunks] = _scratch(w, dtype, chunk)
            # a chunk's copies and codes, and the blocks' absmax (2 bytes a block in bfloat16)
            assert scratch[chunks] <= quant.CHUNK_SCRATCH_BYTES * chunk + 2 * blocks + 4096, chunks
        # 8x the tensor: only its absmax grows (a 32nd of the values' bytes)
        assert scratch[16] - scratch[2] <= 2 * 14 * chunk // quant.BLOCK + 4096
        # where the whole tensor is one chunk, as before: 8x as much
        whole = _scratch(w, dtype, w.numel())
        assert whole > 6 * scratch[16], (whole, scratch[16])
