"""MXFP4 checkpoints (GPT-OSS): the expert weights are de-quantized on load to dense fp32 tensors.

The test writes a tiny GPT-OSS folder the way the hub ships one: the MoE expert matrices as
``*_blocks`` (uint8, two FP4 e2m1 codes a byte, 16 bytes a block of 32 values) and ``*_scales``
(one E8M0 byte a block, exponent bias 127), stored ``[experts, out, in / 32, 16]``; every other
tensor plain bf16; ``quantization_config`` in ``config.json``. The packing and the decoding used
to check the load are the test's own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import ConfigError
from engine.model.loading import load_model, resolve_model_path

EXPERT_MATRICES = ("gate_up_proj", "down_proj")
# the magnitudes of the e2m1 codes 0..7; codes 8..15 are the same, negative
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
HUB_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
# a checkpoint folder and the original weights of the model written to it
Hub = tuple[Path, dict[str, torch.Tensor]]


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of ``w`` (``[..., n]``, n a multiple of 32), blocked along the last axis.

    Each block of 32 gets the smallest power of two 2^e with ``max|w| / 2^e <= 6``; each value is
    rounded to the nearest e2m1 magnitude of ``|w| / 2^e`` with its sign (a small negative value
    becomes -0); value 2i goes to the low nibble of byte i, value 2i+1 to the high nibble.
    """
    *lead, n = w.shape
    blocks = w.double().reshape(*lead, n // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1.double()).abs().argmin(-1)
    codes = (magnitude + 8 * torch.signbit(scaled).long()).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp64 values of packed blocks ``[..., g, 16]`` and scales ``[..., g]``: ``[..., g * 32]``.

    Decoded from the bits rather than a table: sign bit 3, exponent bits 2-1, mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5), else (1 + m / 2) * 2^(e - 1).
    """
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    sign = torch.where(codes & 0b1000 > 0, -1.0, 1.0).double()
    exp = (codes >> 1) & 0b11
    mantissa = (codes & 1).double()
    normal = (1 + mantissa / 2) * torch.pow(2.0, exp.double() - 1)
    values = sign * torch.where(exp == 0, mantissa / 2, normal)
    values = values * torch.pow(2.0, scales.double() - 127)[..., None]
    return values.flatten(-2)


def tiny_gpt_oss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
            p.copy_(p.to(torch.bfloat16))  # the hub's dense tensors are bf16
    return model


def is_expert_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_MATRICES and ".experts." in name


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    """A tiny MXFP4 GPT-OSS folder as the hub ships one, and the original weights (bf16 values in fp32)."""
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = tiny_gpt_oss()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in original.items():
        if is_expert_matrix(name):
            # the parameter is [experts, in, out]; the checkpoint blocks [experts, out, in]
            blocks, scales = encode_mxfp4(value.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = HUB_QUANTIZATION
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, original


def packed(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = f.keys()
        return {k: f.get_tensor(k) for k in names if k.endswith(("_blocks", "_scales"))}


@pytest.fixture(scope="module")
def loaded(hub_folder: Hub) -> Any:
    return load_model(hub_folder[0])


def test_the_folder_looks_like_a_hub_mxfp4_checkpoint(hub_folder: Hub) -> None:
    folder, _ = hub_folder
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        blocks = f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks")
        scales = f.get_slice("model.layers.0.mlp.experts.gate_up_proj_scales")
        down = f.get_slice("model.layers.0.mlp.experts.down_proj_blocks")
        assert blocks.get_dtype() == scales.get_dtype() == "U8"
        # [experts, 2 * intermediate, hidden / 32, 16] and [experts, hidden, intermediate / 32, 16]
        assert blocks.get_shape() == [4, 128, 2, 16] and scales.get_shape() == [4, 128, 2]
        assert down.get_shape() == [4, 64, 2, 16]
    assert not any(is_expert_matrix(n) for n in names)
    assert "model.layers.1.mlp.experts.down_proj_bias" in names


def test_the_test_codec_on_a_known_block() -> None:
    # codes 0..15 twice, at scale 2^-3: byte i holds code 2i low and code 2i+1 high
    values = torch.cat([E2M1, -E2M1]).repeat(2) / 8
    blocks, scales = encode_mxfp4(values[None])
    assert blocks.tolist() == [[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2]]
    assert scales.tolist() == [[127 - 3]]
    decoded = decode_mxfp4(blocks, scales)
    assert torch.equal(decoded, values[None].double())
    assert torch.signbit(decoded[0, 8])  # code 8 is -0


def test_expert_weights_are_exactly_the_decoded_blocks(hub_folder: Hub, loaded: Any) -> None:
    folder, original = hub_folder
    stored = packed(folder)
    state = loaded.state_dict()
    worst, top = 0.0, 0.0
    for name in (n for n in original if is_expert_matrix(n)):
        blocks, scales = stored[f"{name}_blocks"], stored[f"{name}_scales"]
        expected = decode_mxfp4(blocks, scales).transpose(1, 2)
        got = state[name]
        assert got.dtype == torch.float32 and got.shape == original[name].shape
        assert torch.equal(got.double(), expected), name
        # within the MXFP4 rounding: at most half the widest e2m1 step (2) times the block's scale
        error = (got - original[name]).abs()
        bound = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)
        assert bool((error.double() <= bound).all()), name
        worst, top = max(worst, float(error.max())), max(top, float(original[name].abs().max()))
    # the bound is 2^e < max|block| / 3 (e is the smallest with max|block| / 2^e <= 6)
    assert 0 < worst < top / 3


def test_expert_weights_match_the_transformers_decoder(hub_folder: Hub, loaded: Any) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = packed(hub_folder[0])
    for name, value in loaded.state_dict().items():
        if is_expert_matrix(name):
            theirs = convert_moe_packed_tensors(
                stored[f"{name}_blocks"], stored[f"{name}_scales"], dtype=torch.float32
            )
            assert torch.equal(value, theirs), name


def test_every_other_weight_is_bit_identical(hub_folder: Hub, loaded: Any) -> None:
    _, original = hub_folder
    state = loaded.state_dict()
    assert set(state) == set(original)
    others = [n for n in original if not is_expert_matrix(n)]
    assert any(n.endswith("experts.gate_up_proj_bias") for n in others)
    for name in others:
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], original[name]), name


def test_the_loaded_model_is_plain_dense_and_trains(loaded: Any) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    assert loaded.training
    assert getattr(loaded, "hf_quantizer", None) is None
    assert not hasattr(loaded.config, "quantization_config")
    assert all(type(layer.mlp.experts) is GptOssExperts for layer in loaded.model.layers)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    out = loaded(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in loaded.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values())
    expert = grads["model.layers.0.mlp.experts.gate_up_proj"]
    assert expert is not None and float(expert.abs().sum()) > 0
    loaded.zero_grad(set_to_none=True)


def test_saving_the_loaded_model_writes_plain_weights(loaded: Any, tmp_path: Path) -> None:
    loaded.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.down_proj").get_dtype() == "F32"
    assert not any(n.endswith(("_blocks", "_scales")) for n in names)
    again = load_model(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


@pytest.mark.parametrize(
    ("quantization", "method"),
    [({"quant_method": "awq", "bits": 4}, "awq"), ({"bits": 4}, "unknown")],
)
def test_an_unsupported_quantization_is_a_config_error_naming_it(
    hub_folder: Hub,
    tmp_path: Path,
    quantization: dict[str, Any],
    method: str,
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(hub_folder[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    for load in (load_model, lambda f: resolve_model_path(str(f), tmp_path)):
        with pytest.raises(ConfigError) as exc:
            load(folder)
        assert exc.value.field == "model.path" and exc.value.value == method
        assert f"quantized with {method!r}" in str(exc.value) and "mxfp4" in str(exc.value)


def test_a_supported_folder_resolves(hub_folder: Hub, tmp_path: Path) -> None:
    assert resolve_model_path(str(hub_folder[0]), tmp_path) == hub_folder[0]
