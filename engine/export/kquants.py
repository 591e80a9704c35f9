"""The Q4_K and Q6_K block formats of GGML, written with numpy (``gguf`` 0.19 only reads them).

The layouts are the ones ``gguf.quants`` decodes; the tests check that our blocks decode, with
``gguf.quants.dequantize``, to within each format's step of the input. The scales are chosen
from each sub-block's range (min/max), without llama.cpp's iterative search for the scale that
minimises the squared error: the files load and run the same, the error is a little larger.

Q4_K: super-blocks of 256 values = 8 sub-blocks of 32; ``x ≈ d·sc_j·q − dmin·m_j`` with
q in 0..15, 6-bit sc_j and m_j, f16 d and dmin. 144 bytes.
Q6_K: super-blocks of 256 values = 16 sub-blocks of 16; ``x ≈ d·s_j·(q − 32)`` with q in 0..63,
int8 s_j, f16 d. 210 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

QK_K = 256


def _blocks(array: np.ndarray) -> np.ndarray:
    if array.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows that are a multiple of {QK_K} (got {array.shape[-1]})")
    return array.astype(np.float32).reshape(-1, QK_K)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q4_K blocks: uint8, shape ``[..., cols // 256 * 144]``."""
    x = _blocks(array)
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # the offset is never positive, as in llama.cpp
    scale = (sub.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # [n, 8]
    offset = dmin[:, None] * mn
    q = np.rint(_safe_div(sub + offset[..., None], np.broadcast_to(step[..., None], sub.shape)))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed_scales = np.empty((n, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2g (low nibble) and 2g+1 (high nibble)
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)
    out = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(n, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(n, 2),
            packed_scales,
            qs,
        ],
        axis=1,
    )
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 144)


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """``array`` (rows a multiple of 256) as Q6_K blocks: uint8, shape ``[..., cols // 256 * 210]``."""
    x = _blocks(array)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31.0  # q - 32 in -32..31
    d = (scale.max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    s = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * s.astype(np.float32)
    q = np.rint(_safe_div(sub, np.broadcast_to(step[..., None], sub.shape))) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 256)
    # value p: half h = p // 128, r = p % 128; low 4 bits in ql[h*64 + r % 64] (nibble r // 64),
    # high 2 bits in qh[h*32 + r % 32] (bits 2 * (r // 32))
    halves = q.reshape(n, 2, 128)
    low = halves & 0x0F
    ql = (low[:, :, 0:64] | (low[:, :, 64:128] << 4)).reshape(n, 128)
    high = (halves >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate(
        [ql, qh, s.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1
    )
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 210)


def quantize_k(array: np.ndarray, qtype: Any) -> np.ndarray:
    """Q4_K or Q6_K blocks of ``array`` (``qtype``: a ``gguf.GGMLQuantizationType``)."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(array)
    raise ValueError(f"not a K-quant written here: {qtype!r}")
