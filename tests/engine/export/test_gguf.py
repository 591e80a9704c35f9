"""GGUF exports read back by transformers' own GGUF loader give the merged model's logits.

transformers loads GGUF files of llama, mistral (as llama), qwen2, qwen3, phi3 and gemma3; for
those the whole file goes through ``from_pretrained(gguf_file=...)``. Its config reader does not
read Gemma 3's query scaling, logit cap or layer types, so Gemma 3 loads with its own config
(the metadata is checked key by key). For SmolLM3, GLM-4, OLMo 2 and Granite, which its loader
refuses, the tensors go through the same pieces it uses (gguf's name maps reversed by
``get_gguf_hf_weights_map``, its reverse q/k permutation) into a model of the original config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.export.gguf_families import GGUF_FAMILIES
from engine.export.gguf_model import export_adapter_gguf, export_gguf, interleave_heads
from engine.export.kquants import quantize_q4_k, quantize_q6_k
from engine.model.families import FAMILIES
from tests.engine.tiny import VOCAB, tiny_model, tiny_tokenizer

LOADED_BY_TRANSFORMERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
OTHERS = ("smollm3", "glm4", "olmo2", "granite")
# sliding windows llama.cpp does not run for these architectures: turned off here (a config that
# keeps them has its context capped at the window, test_sliding_window_caps_the_context)
NO_WINDOW: dict[str, dict[str, object]] = {
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "smollm3": {"use_sliding_window": False},
    "phi3": {"sliding_window": None},
}
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def model_folder(
    root: Path, family: str, *, blocks: int = 2, **extra: object
) -> tuple[Path, torch.nn.Module]:
    tokenizer = tiny_tokenizer()
    model = tiny_model(
        family, blocks=blocks, vocab_size=len(tokenizer), **(NO_WINDOW.get(family, {}) | extra)
    )
    model.eval()
    folder = root / f"tiny-{family}-ft"  # not "mistral": transformers reads that name as its own arch
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    name_pre_tokenizer(folder)
    return folder, model


def name_pre_tokenizer(folder: Path) -> None:
    """The tiny tokenizer is in no llama.cpp table: its folder names its pre-tokenizer (GPT-2's
    byte-level split, which it uses) as a user would (test_gguf_pre_tokenizer.py)."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"gguf_pre_tokenizer": "gpt-2"}))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def rounded(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """A copy of ``model`` whose matrices went through ``quant`` and back (norms stay fp32)."""
    import copy

    copy_ = copy.deepcopy(model)
    q = {"f16": None, "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]
    with torch.no_grad():
        for name, p in copy_.named_parameters():
            if p.ndim < 2 or "norm" in name:
                continue
            a = p.numpy()
            back = (
                a.astype(np.float16).astype(np.float32)
                if q is None
                else gguf.quants.dequantize(gguf.quants.quantize(a, q), q)
            )
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return copy_


def load_with_transformers_pieces(path: Path, model: torch.nn.Module, *, permuted: bool) -> torch.nn.Module:
    """The GGUF's tensors into a fresh model of ``model``'s config, the way transformers' loader
    maps and un-permutes them."""
    import copy

    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = model.config
    heads = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
    }
    processor = LlamaTensorProcessor(config=heads) if permuted else TensorProcessor()
    names = get_gguf_hf_weights_map(model, processor)
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name)
        state[names[result.name]] = torch.from_numpy(np.copy(result.weights))
    fresh = copy.deepcopy(model)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        fresh.tie_weights()
    return fresh.eval()


def test_every_family_with_a_gguf_entry_is_read_back_here() -> None:
    exported = sorted(FAMILIES[architecture].short_name for architecture in GGUF_FAMILIES)
    assert sorted(LOADED_BY_TRANSFORMERS + OTHERS) == exported


@pytest.mark.parametrize("family", LOADED_BY_TRANSFORMERS)
@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0"])
def test_transformers_gguf_loader_gives_the_models_logits(tmp_path: Path, family: str, quant: str) -> None:
    from transformers import AutoModelForCausalLM

    folder, model = model_folder(tmp_path, family)
    export_gguf(folder, folder / "model.gguf", quant=quant)
    own_config = {"config": model.config} if family == "gemma3" else {}
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="model.gguf", dtype=torch.float32, **own_config
    )
    got, want, same_rounding = logits(loaded), logits(model), logits(rounded(model, quant))
    # the file holds exactly the rounded weights: equal to the model rounded the same way, so
    # its error is the rounding's own
    assert rel(got, same_rounding) < 1e-5
    assert rel(got, want) <= rel(same_rounding, want) + 1e-5
    if quant == "f16":
        # Gemma 3's logit cap (0.2) squeezes the logits, not their rounding errors
        assert rel(got, want) < (3e-3 if family == "gemma3" else 1e-3)


@pytest.mark.parametrize("family", OTHERS)
def test_other_families_through_transformers_gguf_pieces(tmp_path: Path, family: str) -> None:
    folder, model = model_folder(tmp_path, family)
    export_gguf(folder, folder / "model.gguf", quant="f16")
    loaded = load_with_transformers_pieces(
        folder / "model.gguf", model, permuted=family in ("smollm3", "granite")
    )
    assert rel(logits(loaded), logits(model)) < 1e-3


def fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def test_metadata_of_gemma3_granite_and_glm4(tmp_path: Path) -> None:
    folder, model = model_folder(tmp_path, "gemma3")
    export_gguf(folder, folder / "model.gguf")
    meta = fields(folder / "model.gguf")
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == 8
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, False]  # layer_types
    assert meta["gemma3.final_logit_softcapping"] == pytest.approx(0.2)
    assert meta["gemma3.rope.freq_base"] == pytest.approx(1e6)
    assert meta["gemma3.rope.freq_base_swa"] == pytest.approx(1e4)
    reader = gguf.GGUFReader(folder / "model.gguf")
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    want = model.model.layers[0].input_layernorm.weight.detach().numpy() + 1  # llama.cpp's 1 + w
    np.testing.assert_allclose(norm.data, want)

    folder, _ = model_folder(tmp_path / "g", "granite")
    export_gguf(folder, folder / "model.gguf")
    meta = fields(folder / "model.gguf")
    assert meta["granite.embedding_scale"] == pytest.approx(2.5)
    assert meta["granite.residual_scale"] == pytest.approx(0.5)
    assert meta["granite.attention.scale"] == pytest.approx(0.3)
    assert meta["granite.logit_scale"] == pytest.approx(4.0)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(folder / "model.gguf").tensors}  # tied

    folder, _ = model_folder(tmp_path / "z", "glm4")
    export_gguf(folder, folder / "model.gguf")
    meta = fields(folder / "model.gguf")
    assert meta["glm4.rope.dimension_count"] == 4  # half of head_dim 8 rotates


def test_tokenizer_metadata(tmp_path: Path) -> None:
    folder, _ = model_folder(tmp_path, "llama")
    info = export_gguf(folder, folder / "model.gguf")
    meta = fields(folder / "model.gguf")
    tokenizer = tiny_tokenizer()
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert info["pre_tokenizer_named_by"] == "tokenizer_config.json gguf_pre_tokenizer"
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and tokens[tokenizer.convert_tokens_to_ids("<|im_end|>")] == "<|im_end|>"
    types = meta["tokenizer.ggml.token_type"]
    assert isinstance(types, list) and types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    # llama.cpp's Mistral (its llama architecture) attends to the whole context
    folder, _ = model_folder(tmp_path, "mistral", sliding_window=8)
    info = export_gguf(folder, folder / "model.gguf")
    assert info["context_length"] == 8 == fields(folder / "model.gguf")["llama.context_length"]


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    folder, _ = model_folder(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM cannot be exported yet"):
        export_gguf(folder, folder / "model.gguf")
    assert not (folder / "model.gguf").exists()
    folder, _ = model_folder(tmp_path / "s", "smollm3", blocks=4, no_rope_layer_interval=3)
    with pytest.raises(ValueError, match="no_rope_layers"):
        export_gguf(folder, folder / "model.gguf")
    with pytest.raises(ValueError, match="quant: one of f16, bf16, q8_0, q4_k_m \\(got 'q2_k'\\)"):
        export_gguf(folder, folder / "model.gguf", quant="q2_k")


def test_interleave_heads_is_transformers_reverse() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    back = LlamaTensorProcessor()._reverse_permute_weights(interleave_heads(w, 4), 4, 4)
    np.testing.assert_array_equal(back, w)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_k_quant_blocks_decode_within_a_step(kind: str) -> None:
    x = np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.Q4_K if kind == "q4_k" else gguf.GGMLQuantizationType.Q6_K
    blocks = quantize_q4_k(x) if kind == "q4_k" else quantize_q6_k(x)
    back = gguf.quants.dequantize(blocks, qtype)
    levels = 15 if kind == "q4_k" else 63
    # each 32 (Q4_K) or 16 (Q6_K) values: at most about one step of their range
    width = 32 if kind == "q4_k" else 16
    ranges = np.ptp(x.reshape(8, -1, width), axis=-1, keepdims=True) * np.ones((1, 1, width))
    assert (np.abs(back - x) <= 1.2 * ranges.reshape(8, 512) / levels).all()


def test_q4_k_m_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # rows of 256: the matrices take K-quants (hidden 256, 4 heads of 64)
    folder, model = model_folder(tmp_path, "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    export_gguf(folder, folder / "model.gguf", quant="q4_k_m")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(folder / "model.gguf").tensors}
    assert kinds["output.weight"] == "Q6_K" and kinds["blk.0.attn_q.weight"] == "Q4_K"
    # llama.cpp's rule: the value and down projections of the first and last eighth of the
    # blocks, and of every third between, keep more bits
    assert kinds["blk.0.ffn_down.weight"] == "Q4_K" and kinds["blk.1.ffn_down.weight"] == "Q6_K"
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
    # 4-bit weights of a random tiny model: the logits move by up to a fifth of their largest
    # value (each block's decoding is checked in test_k_quant_blocks_decode_within_a_step)
    assert rel(logits(loaded), logits(model)) < 0.25


def halved_matrices(src: Path, dst: Path) -> Path:
    """A copy of the model folder ``src`` whose matrices are rounded to float16 (1-D tensors stay
    float32): what ``convert_hf_to_gguf.py --outtype f16`` puts in the f16 GGUF."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = {k: v.half() if v.ndim >= 2 else v for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def gguf_data(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in gguf.GGUFReader(path).tensors}


def test_q4_k_m_of_a_float32_model_starts_from_its_float16_rounding(tmp_path: Path) -> None:
    # llama.cpp makes q4_k_m from the f16 GGUF: a float32 folder gives the bytes of its copy with
    # float16 matrices, not the blocks of the float32 values
    folder, model = model_folder(tmp_path, "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    halved = halved_matrices(folder, tmp_path / "halved")
    export_gguf(folder, tmp_path / "f32.gguf", quant="q4_k_m")
    export_gguf(halved, tmp_path / "f16.gguf", quant="q4_k_m")
    ours, reference = gguf_data(tmp_path / "f32.gguf"), gguf_data(tmp_path / "f16.gguf")
    assert ours == reference
    assert ours["blk.0.ffn_up.weight"][0] == "Q4_K" and ours["output_norm.weight"][0] == "F32"
    up = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    assert quantize_q4_k(up.astype(np.float16)).tobytes() == ours["blk.0.ffn_up.weight"][1]
    assert quantize_q4_k(up).tobytes() != ours["blk.0.ffn_up.weight"][1]


def test_q4_k_m_keeps_float32_for_a_matrix_beyond_float16(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # float16 would make the large value an infinity: that matrix is quantized from float32
    _, model = model_folder(tmp_path, "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 7] = 1e5
    folder = tmp_path / "large"
    model.save_pretrained(folder)
    for path in (tmp_path / "tiny-llama-ft").iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            (folder / path.name).write_bytes(path.read_bytes())
    with caplog.at_level(logging.WARNING, logger="engine.export.gguf_model"):
        export_gguf(folder, tmp_path / "large.gguf", quant="q4_k_m")
    data = gguf_data(tmp_path / "large.gguf")
    up = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    assert data["blk.0.ffn_up.weight"][1] == quantize_q4_k(up).tobytes()
    gate = model.model.layers[0].mlp.gate_proj.weight.detach().numpy()
    assert data["blk.0.ffn_gate.weight"][1] == quantize_q4_k(gate.astype(np.float16)).tobytes()
    assert any(
        "blk.0.ffn_up.weight" in r.getMessage() and "float16" in r.getMessage() for r in caplog.records
    )


def test_lora_adapter_gguf_applied_to_the_base_gives_the_merged_model(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_folder, base = model_folder(tmp_path, "llama")
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    merged = peft_model.merge_and_unload().eval()
    export_gguf(base_folder, base_folder / "base.gguf", quant="f16")
    info = export_adapter_gguf(adapter, base_folder, tmp_path / "adapter.gguf")
    assert info["alpha"] == 8 and info["rank"] == 4
    reader = gguf.GGUFReader(tmp_path / "adapter.gguf")
    assert fields(tmp_path / "adapter.gguf")["general.type"] == "adapter"
    # apply it as llama.cpp does (W + alpha / r * B A), in the GGUF's layout, then load back
    loaded = AutoModelForCausalLM.from_pretrained(base_folder, gguf_file="base.gguf", dtype=torch.float32)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    names = get_gguf_hf_weights_map(loaded, processor)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        target, _, part = tensor.name.rpartition(".")
        pairs.setdefault(target, {})[part] = np.array(tensor.data)
    state = loaded.state_dict()
    with torch.no_grad():
        for target, ab in pairs.items():
            delta = (info["alpha"] / info["rank"]) * ab["lora_b"] @ ab["lora_a"]
            delta = processor.process(weights=delta, name=target).weights
            state[names[target]] += torch.from_numpy(np.ascontiguousarray(delta))
    loaded.load_state_dict(state)
    assert rel(logits(loaded), logits(merged)) < 1e-3
