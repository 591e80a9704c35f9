"""The GGML block formats of our GGUF exports, written with numpy as llama.cpp writes them:
Q4_K and Q6_K (q4_k_m's types), Q8_0 (q8_0's) and Q5_0 (q4_k_m's fallback for Q4_K).

``gguf`` 0.19 reads the K-quants but does not write them. The algorithm here is llama.cpp's
reference quantization (``quantize_row_q4_K_ref`` and ``quantize_row_q6_K_ref`` in
ggml/src/ggml-quants.c, with their searches ``make_qkx2_quants`` and ``make_qx_quants``; read at
llama.cpp commit 0c1e57098, the one llama-cpp-python 0.3.36 vendors), which is what
``llama-quantize`` runs without an importance matrix. Every step is float32, in llama.cpp's
order of operations; its sums are sequential (``_seq_sum``), and ``np.rint`` rounds half to
even as its ``nearest_int`` does, so the blocks equal llama.cpp's byte for byte
(bench/kquant_parity.py measures it on a model; tests/engine/export/test_kquants.py holds blocks
llama.cpp wrote). The work is vectorized across sub-blocks; only the loop over a sub-block's
positions (32 or 16) is Python, since a sum's order is part of its result.

Q4_K: super-blocks of 256 values = 8 sub-blocks of 32; ``x ≈ d·sc_j·q − dmin·m_j`` with
q in 0..15, 6-bit sc_j and m_j, f16 d and dmin. 144 bytes.
Q6_K: super-blocks of 256 values = 16 sub-blocks of 16; ``x ≈ d·s_j·(q − 32)`` with q in 0..63,
int8 s_j, f16 d. 210 bytes.
Q8_0 and Q5_0 (``quantize_row_q8_0_ref``, ``quantize_row_q5_0_ref``): blocks of 32 with one f16
scale; ``gguf`` writes the same bytes, several times slower (these take much of a q4_k_m export
of a model whose rows are not a multiple of 256).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)  # below it a group counts as all zero
CHUNK_BLOCKS = 512  # super-blocks per pass: numpy's per-call cost against the cache's size
F32 = np.float32


def _blocks(array: np.ndarray, kind: str, width: int) -> np.ndarray:
    """The blocks of ``array`` as rows of ``width``, in the array's own float type (float16 input
    stays float16 here: each chunk is widened to float32 by the thread that encodes it)."""
    if array.ndim == 0 or array.shape[-1] % width:
        raise ValueError(f"{kind} needs rows that are a multiple of {width} (got shape {array.shape})")
    if array.dtype not in (np.float16, np.float32):
        array = array.astype(np.float32)
    return np.ascontiguousarray(array).reshape(-1, width)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """``t[0] + t[1] + ...`` in float32, left to right, over axis 0: llama.cpp's loop order.
    numpy reduces an axis that is not the innermost row by row, in order, with this same
    ``total = t[0]; total += t[1]; ...``; along the innermost axis (here: a single column) it
    adds pairwise, which rounds differently, so one column takes the explicit loop. llama.cpp
    starts from 0, which only changes the sign of an all-zero sum; no written byte depends on
    that sign."""
    if terms.ndim == 2 and terms.shape[1] == 1:
        total = terms[0].copy()
        for row in terms[1:]:
            total += row
        return total
    return np.add.reduce(terms, axis=0)


def _rint(a: np.ndarray) -> np.ndarray:
    return np.rint(a, out=a)


def _grid(x: np.ndarray, lo: np.ndarray, iscale: np.ndarray, top: int, out: np.ndarray) -> np.ndarray:
    """``clip(nearest_int(iscale * (x - lo)), 0, top)`` into ``out`` (float32)."""
    np.subtract(x, lo, out=out)
    out *= iscale
    _rint(out)
    return np.clip(out, 0, top, out=out)


def _qkx2(x: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qkx2_quants(32, 15, ..., rmin=-1, rdelta=0.1, nstep=20, use_mad=false)``
    for the columns of ``x`` ([32, n]: one sub-block per column): the scale and minimum of the
    weighted least-squares fit over 21 candidate scales; returns (scale, -min, levels [32, n]).

    As in llama.cpp, each candidate's grid starts from the best minimum found so far; the
    levels of the best candidate are computed again at the end from its (iscale, minimum)."""
    nmax = F32(15)
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    flat = hi == lo
    cand, wl, tmp = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    sum_w = _seq_sum(weights)
    sum_x = _seq_sum(np.multiply(weights, x, out=tmp))
    iscale = nmax / (hi - lo)
    scale = F32(1) / iscale
    _grid(x, lo, iscale, 15, cand)
    np.multiply(cand, scale, out=tmp)
    tmp += lo
    tmp -= x
    tmp *= tmp
    tmp *= weights
    best = _seq_sum(tmp)
    best_iscale, best_lo = iscale, lo  # what the best levels were computed from
    for step in range(21):
        iscale = (F32(-1) + F32(0.1) * F32(step) + nmax) / (hi - lo)
        _grid(x, lo, iscale, 15, cand)
        np.multiply(weights, cand, out=wl)
        sum_l = _seq_sum(wl)
        sum_l2 = _seq_sum(np.multiply(wl, cand, out=tmp))
        sum_xl = _seq_sum(np.multiply(wl, x, out=tmp))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min[positive] = 0
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        np.multiply(cand, this_scale, out=tmp)
        tmp += this_min
        tmp -= x
        tmp *= tmp
        tmp *= weights
        error = _seq_sum(tmp)
        better = (det > 0) & (error < best)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        best_iscale = np.where(better, iscale, best_iscale)
        best_lo = np.where(better, lo, best_lo)
        lo = np.where(better, this_min, lo)
    levels = _grid(x, best_lo, best_iscale, 15, cand)
    scale[flat] = 0
    levels[:, flat] = 0
    return scale, -lo, levels


def _q4_k_chunk(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 8, 32).T)  # [32, n*8]: a sub-block per column
    av = np.sqrt(_seq_sum(sub * sub) / F32(32))
    scales, mins, levels = _qkx2(sub, av + np.abs(sub))
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # llama.cpp stores nearest_int(...) into a uint8, then caps it at 63
    sc = np.minimum(_rint(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    mn = np.minimum(_rint(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    d16 = (max_scale / F32(63)).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(np.float16)
    step = (d16.astype(np.float32)[:, None] * sc).reshape(1, n * 8)
    offset = (dmin16.astype(np.float32)[:, None] * mn).reshape(1, n * 8)
    requant = np.clip(_rint((sub + offset) / step), 0, 15)
    # a sub-block whose scale rounds to 0 keeps the levels of the search
    levels = np.where(step != 0, requant, levels).astype(np.uint8).T.reshape(n, 256)
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    pairs = levels.reshape(n, 4, 2, 32)  # sub-blocks 2g (low nibble) and 2g+1 (high nibble)
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)
    heads = np.stack([d16, dmin16], axis=1).view(np.uint8)
    return np.concatenate([heads, packed, qs], axis=1)


def _qx(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qx_quants(16, 32, ..., rmse_type=1, NULL)`` for the columns of ``x``
    ([16, n]): the scale of the x²-weighted fit over 19 candidates; returns (scale, levels 0..63)."""
    nmax = F32(32)
    first = np.abs(x).argmax(axis=0)  # the first largest magnitude, signed
    peak = np.take_along_axis(x, first[None, :], axis=0)[0]
    zero = np.abs(peak) < GROUP_MAX_EPS
    weights = x * x
    wx = weights * x
    cand, tmp = np.empty_like(x), np.empty_like(x)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(x, iscale, out=cand)
        np.clip(_rint(cand), -32, 31, out=cand)
        sum_lx = _seq_sum(np.multiply(wx, cand, out=tmp))
        np.multiply(weights, cand, out=tmp)
        return sum_lx, _seq_sum(np.multiply(tmp, cand, out=tmp))

    iscale = best_iscale = -nmax / peak
    sum_lx, sum_l2 = sums(iscale)
    scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(nmax + F32(0.1) * F32(step)) / peak
        sum_lx, sum_l2 = sums(iscale)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sum_lx / sum_l2, scale)
        best = np.where(better, scale * sum_lx, best)
    np.multiply(x, best_iscale, out=cand)
    levels = np.clip(_rint(cand), -32, 31, out=cand) + F32(32)
    levels[:, zero] = 0
    return np.where(zero, F32(0), scale), levels


def _q6_k_chunk(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # [16, n*16]: a sub-block per column
    scales, levels = _qx(sub)
    scales = scales.reshape(n, 16)
    first = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, first[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(zero, F32(0), F32(-128) / max_scale)
    d16 = np.where(zero, F32(0), F32(1) / iscale).astype(np.float16)
    s = np.minimum(_rint(iscale[:, None] * scales), 127).astype(np.int8)
    step = (d16.astype(np.float32)[:, None] * s).reshape(1, n * 16)
    requant = np.clip(_rint(sub / step), -32, 31) + F32(32)
    # a sub-block whose scale rounds to 0 keeps the levels of the search
    q = np.where(step != 0, requant, levels).astype(np.uint8).T.reshape(n, 256)
    # value p: half h = p // 128, r = p % 128; low 4 bits in ql[h*64 + r % 64] (nibble r // 64),
    # high 2 bits in qh[h*32 + r % 32] (bits 2 * (r // 32))
    halves = q.reshape(n, 2, 128)
    low = halves & 0x0F
    ql = (low[:, :, 0:64] | (low[:, :, 64:128] << 4)).reshape(n, 128)
    high = (halves >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, s.view(np.uint8), d16.reshape(n, 1).view(np.uint8)], axis=1)
    out[zero] = 0  # llama.cpp: an all-zero super-block is written as zero bytes
    return out


def _q8_0_chunk(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q8_0_ref``: d = amax / 127, q = roundf(x / d)."""
    d = np.abs(x).max(axis=1) / F32(127)
    scaled = x * np.where(d != 0, F32(1) / d, F32(0))[:, None]
    q = np.rint(scaled)
    # roundf takes halves away from zero where rint takes them to even
    ties = np.nonzero(np.abs(scaled - q) == F32(0.5))
    q[ties] = np.trunc(scaled[ties]) + np.sign(scaled[ties])
    return np.concatenate(
        [d.astype(np.float16).view(np.uint8).reshape(-1, 2), q.astype(np.int8).view(np.uint8)], axis=1
    )


def _q5_0_chunk(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q5_0_ref``: d = -max / 16 (max: the value of largest magnitude),
    q = min(31, trunc(x / d + 16.5)); low nibbles of (j, j + 16) paired, the fifth bits in qh."""
    n = x.shape[0]
    rows = np.arange(n)
    first = np.abs(x).argmax(axis=1)
    peak = x[rows, first]
    peak[peak == 0] = 0  # an all-zero block keeps llama.cpp's +0 (so d = -0), not a -0 it read
    d = peak / F32(-16)
    scaled = x * np.where(d != 0, F32(1) / d, F32(0))[:, None]
    scaled += F32(16.5)
    q = scaled.astype(np.uint8)  # in 0.5..32.5: truncation, as llama.cpp's (int8_t) cast
    np.minimum(q, 31, out=q)
    qs = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)  # uint8: the fifth bit shifts out
    qh = np.packbits(q >> 4, axis=1, bitorder="little")
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2), qh, qs], axis=1)


# type name -> (values per block, bytes per block, the encoder of a run of blocks, whether it is
# worth threads: the 32-value formats are a few numpy passes, cheaper than a thread hand-off)
FORMATS: dict[str, tuple[int, int, Any, bool]] = {
    "Q4_K": (QK_K, 144, _q4_k_chunk, True),
    "Q6_K": (QK_K, 210, _q6_k_chunk, True),
    "Q5_0": (32, 22, _q5_0_chunk, False),
    "Q8_0": (32, 34, _q8_0_chunk, False),
}


def _by_chunks(array: np.ndarray, kind: str, threads: int | None) -> np.ndarray:
    """``kind``'s encoder over runs of blocks, on ``threads`` threads (default: one per CPU, as
    llama-quantize): numpy releases the GIL inside its loops."""
    width, size, chunk, threaded = FORMATS[kind]
    x = _blocks(array, kind, width)
    n = x.shape[0]
    workers = max(1, min(threads or os.cpu_count() or 1, n * width // (64 * QK_K))) if threaded else 1
    per = max(1, min(CHUNK_BLOCKS * QK_K // width, -(-n // workers)))
    out = np.empty((n, size), dtype=np.uint8)

    def work(start: int) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out[start : start + per] = chunk(x[start : start + per].astype(np.float32, copy=False))

    if workers == 1:
        for start in range(0, n, per):
            work(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(0, n, per)))
    return out.reshape(*array.shape[:-1], array.shape[-1] // width * size)


def quantize_q4_k(array: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q4_K blocks: uint8, shape ``[..., cols // 256 * 144]``.

    Args:
        array: float values (float32 arithmetic throughout, as llama.cpp).
        threads: threads to use (default: one per CPU).

    Raises:
        ValueError: rows that are not a multiple of 256.
    """
    return _by_chunks(array, "Q4_K", threads)


def quantize_q6_k(array: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q6_K blocks: uint8, shape ``[..., cols // 256 * 210]``.

    Args:
        array: float values (float32 arithmetic throughout, as llama.cpp).
        threads: threads to use (default: one per CPU).

    Raises:
        ValueError: rows that are not a multiple of 256.
    """
    return _by_chunks(array, "Q6_K", threads)


def quantize(array: np.ndarray, kind: str, *, threads: int | None = None) -> np.ndarray:
    """``array`` (float) in the block type ``kind`` (a ``FORMATS`` name: Q4_K, Q6_K, Q5_0, Q8_0):
    uint8, shape ``[..., cols // block * bytes per block]``.

    Raises:
        ValueError: a type not written here, or rows that are not a multiple of its block.
    """
    if kind not in FORMATS:
        raise ValueError(f"not a block type written here: {kind!r} (one of {', '.join(FORMATS)})")
    return _by_chunks(array, kind, threads)
