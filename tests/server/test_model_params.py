"""Parameter counts of the model listing, read from safetensors headers: an MXFP4 checkpoint
(GPT-OSS) counts two parameters per byte of its packed ``*_blocks`` and none for its ``*_scales``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from server.services.models import _safetensors_parameters, discover


def write_shards(folder: Path, *shards: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, tensors in enumerate(shards, start=1):
        save_file(tensors, folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors")
    return folder


def test_plain_tensors_count_their_elements(tmp_path: Path) -> None:
    folder = write_shards(
        tmp_path / "plain",
        {"embed.weight": torch.zeros(96, 64), "norm.weight": torch.zeros(64, dtype=torch.bfloat16)},
        {"lm_head.weight": torch.zeros(96, 64)},
    )
    assert _safetensors_parameters(folder) == 2 * 96 * 64 + 64
    assert _safetensors_parameters(tmp_path) is None  # no safetensors file


def test_mxfp4_blocks_count_two_per_byte_and_scales_none(tmp_path: Path) -> None:
    experts, out, inp = 4, 128, 64
    folder = write_shards(
        tmp_path / "mxfp4",
        {
            "experts.gate_up_proj_blocks": torch.zeros(experts, out, inp // 32, 16, dtype=torch.uint8),
            "experts.gate_up_proj_scales": torch.zeros(experts, out, inp // 32, dtype=torch.uint8),
            "experts.gate_up_proj_bias": torch.zeros(experts, out, dtype=torch.bfloat16),
        },
        {"router.weight": torch.zeros(experts, inp, dtype=torch.bfloat16)},
    )
    assert _safetensors_parameters(folder) == experts * out * inp + experts * out + experts * inp


def test_only_uint8_blocks_and_scales_are_packed(tmp_path: Path) -> None:
    folder = write_shards(
        tmp_path / "other",
        {
            "codes": torch.zeros(10, dtype=torch.uint8),  # uint8, but not MXFP4 blocks
            "layer.weight_scales": torch.zeros(3, dtype=torch.float32),  # a float tensor so named
            "res_blocks": torch.zeros(5, dtype=torch.float32),
        },
    )
    assert _safetensors_parameters(folder) == 10 + 3 + 5


def test_a_gpt_oss_mxfp4_folder_lists_its_dense_parameter_count(tmp_path: Path) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

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
        max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = GptOssForCausalLM(config)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, i, o = value.shape  # stored [experts, out, in / 32, 16], one scale per 32
            tensors[f"{name}_blocks"] = torch.zeros(e, o, i // 32, 16, dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.zeros(e, o, i // 32, dtype=torch.uint8)
        else:
            tensors[name] = value.to(torch.bfloat16).contiguous()
    folder = write_shards(tmp_path / "models" / "gpt-oss-tiny", tensors)
    model.config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(saved))

    dense = sum(p.numel() for p in model.parameters())
    assert _safetensors_parameters(folder) == dense
    listed = {m.name: m for m in discover(tmp_path / "models", None)}
    assert listed["gpt-oss-tiny"].parameters == dense


@pytest.mark.parametrize("storage", ["uint8", "bfloat16"])
def test_a_bitsandbytes_4bit_folder_lists_its_dense_parameter_count(tmp_path: Path, storage: str) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "dense")
    # written as the hub's -bnb-4bit folders are: transformers with bitsandbytes (its CPU backend)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dense",
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=getattr(torch, storage)
        ),
        dtype=torch.bfloat16,
    )
    folder = tmp_path / "models" / "llama-bnb-4bit"
    quantized.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    dense = sum(p.numel() for p in model.parameters())
    assert _safetensors_parameters(folder) == dense
    listed = {m.name: m for m in discover(tmp_path / "models", None)}
    assert listed["llama-bnb-4bit"].parameters == dense and listed["llama-bnb-4bit"].supported
    assert listed["llama-bnb-4bit"].quantization == "bitsandbytes 4-bit (fp4)"  # bitsandbytes' default


@pytest.mark.parametrize(
    ("quantization", "label", "reason"),
    [
        ({"quant_method": "mxfp4"}, "mxfp4", None),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
            "bitsandbytes 4-bit (nf4)",
            None,
        ),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes 8-bit", "8-bit"),
        ({"quant_method": "awq", "bits": 4}, "awq", "quantized with 'awq'"),
        ({"bits": 4}, "unknown", "names no quant_method"),
        (None, None, None),
    ],
)
def test_the_listing_names_a_checkpoint_s_quantization_and_refuses_what_cannot_be_read(
    tmp_path: Path, quantization: dict[str, object] | None, label: str | None, reason: str | None
) -> None:
    folder = write_shards(tmp_path / "models" / "m", {"embed.weight": torch.zeros(96, 64)})
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    (info,) = [m for m in discover(tmp_path / "models", None) if m.name == "m"]
    assert info.quantization == label
    if reason is None:
        assert info.supported and info.unsupported_reason is None
    else:
        assert not info.supported and reason in (info.unsupported_reason or "")
