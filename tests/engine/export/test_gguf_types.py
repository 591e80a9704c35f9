"""Each tensor's GGML type in our exports is the one llama-quantize gives the same f16 GGUF, and
the export says which tensors fell back to another type, and to which."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest

from engine.export.gguf_model import export_gguf
from engine.export.gguf_types import tensor_type, use_more_bits
from tests.engine.tiny import tiny_model_folder

# The blocks whose attn_v and ffn_down keep more bits in llama-quantize's Q4_K_M of a 30-block
# model (SmolLM2-135M, llama.cpp commit 0c1e57098: its ffn_down tensors of type Q6_K), and of a
# 24-block one (SmolLM2-1.7B's sizes: its Q6_K attn_v and ffn_down).
MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
MORE_BITS_24 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}


def types(quant: str, shapes: dict[str, tuple[int, ...]], *, layers: int, tied: bool) -> dict[str, str]:
    out = {}
    for name, shape in shapes.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        out[name] = tensor_type(quant, name, shape, layer=layer, layers=layers, tied=tied).name
    return out


def smollm2_shapes(layers: int, hidden: int, ffn: int, kv: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF names and numpy shapes (rows last) of a tied SmolLM2 model."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"blk.{i}."
        shapes |= {p + "attn_q.weight": (hidden, hidden), p + "attn_k.weight": (kv, hidden)}
        shapes |= {p + "attn_v.weight": (kv, hidden), p + "attn_output.weight": (hidden, hidden)}
        shapes |= {p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden)}
        shapes |= {p + "ffn_down.weight": (hidden, ffn), p + "attn_norm.weight": (hidden,)}
        shapes |= {p + "ffn_norm.weight": (hidden,)}
    return shapes


def test_use_more_bits_matches_llama_quantize() -> None:
    assert {i for i in range(30) if use_more_bits(i, 30)} == MORE_BITS_30
    assert {i for i in range(24) if use_more_bits(i, 24)} == MORE_BITS_24


def test_q4_k_m_types_of_smollm2_135m_as_llama_quantize_wrote_them() -> None:
    # rows of 576: not a multiple of 256; ffn_down's rows of 1536 are
    got = types("q4_k_m", smollm2_shapes(30, 576, 1536, 192, 49152), layers=30, tied=True)
    assert got["token_embd.weight"] == "Q8_0"  # tied: the output's rule, Q8_0 for rows of 576
    for i in range(30):
        more = i in MORE_BITS_30
        assert got[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if more else "Q4_K")
        assert got[f"blk.{i}.attn_v.weight"] == ("Q8_0" if more else "Q5_0")  # Q6_K / Q4_K fell back
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert got[f"blk.{i}.{name}.weight"] == "Q5_0"
        assert got[f"blk.{i}.attn_norm.weight"] == got[f"blk.{i}.ffn_norm.weight"] == "F32"


def test_q4_k_m_types_of_smollm2_1_7b_sizes_as_llama_quantize_wrote_them() -> None:
    got = types("q4_k_m", smollm2_shapes(24, 2048, 8192, 2048, 49152), layers=24, tied=True)
    assert got["token_embd.weight"] == "Q6_K"  # tied: the output's type
    for i in range(24):
        more = "Q6_K" if i in MORE_BITS_24 else "Q4_K"
        assert got[f"blk.{i}.attn_v.weight"] == got[f"blk.{i}.ffn_down.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert got[f"blk.{i}.{name}.weight"] == "Q4_K"


def test_untied_output_fused_qkv_and_other_quants() -> None:
    def one(quant: str, name: str, shape: tuple[int, ...], layer: int | None = 3, tied: bool = False) -> str:
        return tensor_type(quant, name, shape, layer=layer, layers=8, tied=tied).name

    assert one("q4_k_m", "output.weight", (1000, 512), None) == "Q6_K"
    assert one("q4_k_m", "token_embd.weight", (1000, 512), None) == "Q4_K"  # untied: the default type
    assert one("q4_k_m", "token_embd.weight", (1000, 512), None, tied=True) == "Q6_K"
    # a fused qkv counts as attn_v in llama.cpp (its own Q5_K rule is never reached); of 8
    # blocks, 0, 3, 6 and 7 keep more bits
    assert one("q4_k_m", "blk.2.attn_qkv.weight", (1536, 512), 2) == "Q4_K"
    assert one("q4_k_m", "blk.3.attn_qkv.weight", (1536, 512)) == "Q6_K"
    # rows that are not a multiple of 32 either: F16
    assert one("q4_k_m", "blk.3.attn_q.weight", (48, 48)) == "F16"
    assert one("q4_k_m", "output.weight", (1000, 48), None) == "F16"
    assert one("q8_0", "blk.3.attn_q.weight", (48, 48)) == "F16"
    assert one("q8_0", "output.weight", (1000, 512), None) == "Q8_0"
    assert one("f16", "blk.3.attn_q.weight", (48, 48)) == "F16"
    assert one("bf16", "blk.3.attn_q.weight", (512, 512)) == "BF16"
    assert one("q4_k_m", "blk.3.attn_norm.weight", (512,)) == "F32"
    with pytest.raises(ValueError, match="quant: one of f16, bf16, q8_0, q4_k_m \\(got 'q2_k'\\)"):
        one("q2_k", "blk.3.attn_q.weight", (512, 512))


def test_q4_k_m_export_says_which_tensors_fell_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the tiny llama: 3 blocks of width 32 (rows of 32, or 64 for ffn_down), no tied output
    folder = tiny_model_folder(tmp_path / "tiny-llama")
    # a tokenizer trained here is in no llama.cpp pre-tokenizer table: named, as a user would
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"gguf_pre_tokenizer": "gpt-2"}))
    with caplog.at_level(logging.WARNING, logger="engine.export.gguf_model"):
        info = export_gguf(folder, tmp_path / "model.gguf", quant="q4_k_m")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    # 3 blocks: only block 2 keeps more bits (7 * 3 // 8 = 2)
    assert kinds["blk.0.attn_v.weight"] == kinds["blk.1.ffn_down.weight"] == "Q5_0"
    assert kinds["blk.2.attn_v.weight"] == kinds["blk.2.ffn_down.weight"] == "Q8_0"
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "Q5_0"
    assert kinds["output.weight"] == "Q8_0"
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    said = {line.split(":")[0]: line for line in info["fallbacks"]}
    assert said["blk.2.ffn_down.weight"] == (
        "blk.2.ffn_down.weight: rows of 64 are not a multiple of 256: Q8_0 instead of Q6_K, "
        "as llama-quantize writes it"
    )
    assert "Q5_0 instead of Q4_K" in said["blk.0.attn_q.weight"]
    assert "Q8_0 instead of Q6_K" in said["output.weight"]
    # every matrix fell back here, and each is said once, in the log too
    matrices = [name for name, kind in kinds.items() if kind != "F32"]
    assert sorted(said) == sorted(matrices)
    assert sum("instead of" in r.getMessage() for r in caplog.records) == len(matrices)
