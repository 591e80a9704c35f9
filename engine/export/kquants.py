"""The Q4_K and Q6_K block formats of GGML, written with numpy as llama.cpp writes them.

``gguf`` 0.19 reads these formats but does not write them. The algorithm here is llama.cpp's
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


def _blocks(array: np.ndarray) -> np.ndarray:
    if array.ndim == 0 or array.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows that are a multiple of {QK_K} (got shape {array.shape})")
    return np.ascontiguousarray(array, dtype=np.float32).reshape(-1, QK_K)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """``t[0] + t[1] + ...`` in float32, left to right, over axis 0: llama.cpp's loop order
    (numpy's own sum adds pairwise, which rounds differently). llama.cpp starts from 0, which
    only changes the sign of an all-zero sum; no written byte depends on that sign."""
    total = terms[0].copy()
    for row in terms[1:]:
        total += row
    return total


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


def _by_chunks(array: np.ndarray, chunk: Any, size: int, threads: int | None) -> np.ndarray:
    """``chunk`` over runs of super-blocks, on ``threads`` threads (default: one per CPU, as
    llama-quantize): numpy releases the GIL inside its loops."""
    x = _blocks(array)
    n = x.shape[0]
    workers = max(1, min(threads or os.cpu_count() or 1, n // 64))
    per = max(1, min(CHUNK_BLOCKS, -(-n // workers)))
    out = np.empty((n, size), dtype=np.uint8)

    def work(start: int) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out[start : start + per] = chunk(x[start : start + per])

    if workers == 1:
        for start in range(0, n, per):
            work(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(0, n, per)))
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * size)


def quantize_q4_k(array: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q4_K blocks: uint8, shape ``[..., cols // 256 * 144]``.

    Args:
        array: float values (float32 arithmetic throughout, as llama.cpp).
        threads: threads to use (default: one per CPU).

    Raises:
        ValueError: rows that are not a multiple of 256.
    """
    return _by_chunks(array, _q4_k_chunk, 144, threads)


def quantize_q6_k(array: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q6_K blocks: uint8, shape ``[..., cols // 256 * 210]``.

    Args:
        array: float values (float32 arithmetic throughout, as llama.cpp).
        threads: threads to use (default: one per CPU).

    Raises:
        ValueError: rows that are not a multiple of 256.
    """
    return _by_chunks(array, _q6_k_chunk, 210, threads)


def quantize_k(array: np.ndarray, qtype: Any) -> np.ndarray:
    """Q4_K or Q6_K blocks of ``array`` (``qtype``: a ``gguf.GGMLQuantizationType``)."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(array)
    raise ValueError(f"not a K-quant written here: {qtype!r}")
