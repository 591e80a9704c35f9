"""Our Q4_K, Q6_K, Q8_0 and Q5_0 blocks are llama.cpp's: a fixed input whose blocks llama.cpp
wrote, and properties of the blocks on random inputs (bench/kquant_parity.py compares whole
models)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.export.kquants import quantize, quantize_q4_k, quantize_q6_k

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K

# Blocks written by llama.cpp commit 0c1e57098 (as vendored by llama-cpp-python 0.3.36): its
# ggml_quantize_chunk, which runs quantize_row_q4_K_ref / quantize_row_q6_K_ref without an
# importance matrix, on golden_input() (Q4_K: its 768 values; Q6_K: its first 512), built with
# cmake's Release defaults on x86-64 and called from a small C program.
LLAMA_CPP_Q4_K = (
    "67181d24fdfbf9fffffbf8fd4869ec6687edec3b54ed5a7ed28f533c4c05bacc3c775a50ef44f7baf4e265dd2c54"
    "285a0ccde099731eb0af117a3fd0d5657859bf98146e22edcdd718ee8d998d93b81869792079a1dfbf667629ec0f"
    "735bd7eb3942dbfeb8df70570e36408b05cdf845adf3199833d779f80f9c25757e5ed8b87a8648ab18921460f2cb"
    "2a6f0b5beb555518fb23c0333feec02a3ac2cc000cfb6308528f7d4cfe5767a373dc09c57be12c12e31f757cc612"
    "405bb3ffc3b1613bcad984abf6f691e7ac6b7df0e9b6e3ba6e74868786b5aaf287a4a4d6b168fb7901060b08030e"
    "030d0e07020d060b0109000f0c0f02060204060908020d0a0d064f1f3f8f6f7f2fdfefdf1f0f0fcf1f5fcf1f3f5f"
    "bf7f5f7f2f4f0f9f7fcfff8fbd21f22cf09c688f4d0c0acbcfdbc5f30f60f23004115221322142340253412020334"
    "142520310334323335051113241805360a02694f0a32350425352826400a3114220901f7352a443834392a342931"
    "3321332144334330e02c434344233220413430343133222442013f334143212a0b8d6c7b1e0c0b5d1a0c2a1a1f40"
    "4e5d6d8e1e5c3a5c8e0d4d2e3a2d8efb581"
)
LLAMA_CPP_Q6_K = (
    "31580d730fdb17f579b1e32f5f7d476d1cf5c84f50af9315cf58bb8a8f20efd6044bfa80073b06de48f3c7a082b1"
    "1e62e392ca5c973fb040f205b799c678c6d8a869abf84951a1e502b8adb05f5001f087a51fd31b80fc1e75e3bdee"
    "f7c6ec79a5f17651f466eef41f76b10ed26878d3c11d19c2507861b7ea109dcc1b6da15b3afccca5963cc5b40f68"
    "37c4d452a96c0c5ae98bf00a0225d2034a504c7b1dd989f91f9937e050da068d20ac4a49e2916d9b60a025800b49"
    "ccee2b742e60e15a82827f8279847a8b848a8d80897e7574110cf18e3810b8bf54118124d41eabccd20a0db83200"
    "397e4657eec3d242949aeb527146f5b90b07e125a0322d06269b3d954f2213020d9cc91206b5bd61aa4f0f2a0e06"
    "010d0400050501030a05040d0e070e000c020804050d050a0f06070509041040d00080d09040a06040201020603"
    "01040c040d0e030e080f01060b000d0f02b2d1b341418002a3a7777002d120533486f636c6624123f5b292320335"
    "3075943020181434003c0c0c2030002c00341c3000040834243420201018340c1c0420000adae51ad8580b7ab000"
    "0e0e05656f20d"
)


# The same llama.cpp's Q8_0 and Q5_0 blocks (quantize_row_q8_0_ref, quantize_row_q5_0_ref) of
# golden_input()'s first 32 values followed by tie_block().
LLAMA_CPP_Q8_0 = (
    "0720fc604c35c455236b9c7cb64343cc224d4fee1f837fc4f62cc4a1d65643c105280034f8f8f9f9fafafbfbfcfcfdfd"
    "fefeffff0001010202030304040505060607077f"
)
LLAMA_CPP_Q5_0 = "feab11256a276124c6f908851ca38dc059588887fcb6f0bfffffff000101010101010101f1f0f0f0f0f0f000"


def tie_block() -> np.ndarray:
    """32 values whose Q8_0 scaled values are exact halves (d = 31.75 / 127 = 0.25): llama.cpp's
    roundf takes them away from zero."""
    x = np.arange(32, dtype=np.float32) * 0.125 - 2.0
    x[31] = 31.75
    return x


def golden_input() -> np.ndarray:
    """768 values, exact in float16, from an integer LCG (no library's random stream): a plain
    super-block; one with a sub-block 2^-12 as large as the rest (its 6-bit scale rounds to 0),
    an all-positive, an all-zero and a constant sub-block; one with spikes 8x the rest."""
    seed, values = 12345, []
    for _ in range(768):
        seed = (seed * 1103515245 + 12345) % 2**31
        values.append((seed >> 16) % 2048 - 1024)
    x = np.array(values, dtype=np.float32) / 1024
    x[256:288] *= 2.0**-12
    x[352:384] = np.abs(x[352:384]) + 0.5
    x[416:448] = 0
    x[448:480] = 0.375
    x[512::17] *= 8
    return x


def test_fixed_input_gives_llama_cpps_blocks() -> None:
    x = golden_input()
    assert (x.astype(np.float16).astype(np.float32) == x).all()
    assert quantize_q4_k(x).tobytes().hex() == LLAMA_CPP_Q4_K
    assert quantize_q6_k(x[:512]).tobytes().hex() == LLAMA_CPP_Q6_K
    # the second super-block's first sub-block has scale 0 in llama.cpp's bytes: the case where
    # llama.cpp keeps the levels of its search rather than re-quantizing
    assert bytes.fromhex(LLAMA_CPP_Q4_K)[144 + 4] & 63 == 0


def test_fixed_input_gives_llama_cpps_q8_0_and_q5_0_blocks() -> None:
    x = np.concatenate([golden_input()[:32], tie_block()])
    assert quantize(x, "Q8_0").tobytes().hex() == LLAMA_CPP_Q8_0
    assert quantize(x, "Q5_0").tobytes().hex() == LLAMA_CPP_Q5_0
    # gguf's own encoders write the same bytes
    for kind in ("Q8_0", "Q5_0"):
        assert (
            gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]).tobytes().hex()
            == quantize(x, kind).tobytes().hex()
        )


def test_all_zero_super_blocks_are_zero_bytes() -> None:
    # llama.cpp writes an all-zero super-block as 144 (Q4_K) or 210 (Q6_K) zero bytes
    zeros = np.zeros((2, 512), dtype=np.float32)
    assert not quantize_q4_k(zeros).any() and quantize_q4_k(zeros).shape == (2, 288)
    assert not quantize_q6_k(zeros).any() and quantize_q6_k(zeros).shape == (2, 420)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_blocks_do_not_depend_on_chunks_or_threads(kind: str) -> None:
    quantize = quantize_q4_k if kind == "q4_k" else quantize_q6_k
    x = np.random.default_rng(1).standard_t(3, size=(40, 2048)).astype(np.float32)
    whole = quantize(x, threads=1)
    np.testing.assert_array_equal(quantize(x, threads=2), whole)
    # each super-block on its own: the same bytes (no state crosses blocks)
    parts = np.concatenate([quantize(x[:, i : i + 256], threads=1) for i in range(0, 2048, 256)], axis=1)
    np.testing.assert_array_equal(parts, whole)


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_search_beats_the_range_scale(qtype: gguf.GGMLQuantizationType) -> None:
    """llama.cpp's search for the scales has a smaller squared error than taking each sub-block's
    range as its scale (what this module did before it followed llama.cpp)."""
    x = np.random.default_rng(2).normal(size=(64, 1024)).astype(np.float32)
    searched = gguf.quants.dequantize(quantize(x, qtype.name), qtype)
    if qtype == Q4_K:
        sub = x.reshape(-1, 32)
        low = np.minimum(sub.min(axis=1, keepdims=True), 0)
        step = (sub.max(axis=1, keepdims=True) - low) / 15
        ranged = np.rint((sub - low) / step) * step + low
    else:
        sub = x.reshape(-1, 16)
        step = np.abs(sub).max(axis=1, keepdims=True) / 31
        ranged = np.clip(np.rint(sub / step), -32, 31) * step
    assert ((searched - x) ** 2).mean() < ((ranged.reshape(x.shape) - x) ** 2).mean()


def test_rows_must_be_whole_super_blocks() -> None:
    with pytest.raises(
        ValueError, match="Q4_K needs rows that are a multiple of 256 \\(got shape \\(4, 576\\)\\)"
    ):
        quantize_q4_k(np.zeros((4, 576), dtype=np.float32))
    with pytest.raises(ValueError, match="Q5_0 needs rows that are a multiple of 32"):
        quantize(np.zeros((4, 48), dtype=np.float32), "Q5_0")
    with pytest.raises(ValueError, match="not a block type written here: 'Q5_1'"):
        quantize(np.zeros((1, 256), dtype=np.float32), "Q5_1")


@pytest.mark.parametrize("columns", [2, 8, 24, 4096])
def test_numpy_sums_a_leading_axis_left_to_right(columns: int) -> None:
    # the encoders' sums (kquants._seq_sum) rely on it: llama.cpp adds a sub-block's terms in order
    terms = np.random.default_rng(columns).normal(size=(32, columns)).astype(np.float32)
    terms *= np.float32(10.0) ** np.arange(-16, 16, dtype=np.float32)[:, None] / 4
    total = terms[0].copy()
    for row in terms[1:]:
        total += row
    assert np.array_equal(np.add.reduce(terms, axis=0).view(np.uint32), total.view(np.uint32))


def test_float16_input_gives_the_blocks_of_its_float32_values() -> None:
    x = np.random.default_rng(3).normal(size=(4, 512)).astype(np.float16)
    for kind in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        assert np.array_equal(quantize(x, kind), quantize(x.astype(np.float32), kind))
