"""Checkpoints that arrive quantized, read by ``engine.model.prequantized``: bitsandbytes 4-bit
folders (written here by ``transformers`` with bitsandbytes' CPU backend, as the hub's
``-bnb-4bit`` ones are written) and GPT-OSS MXFP4 folders.

Decoded, their weights are bitsandbytes' (its portable torch reference) and ``transformers``'
MXFP4 values bit for bit; kept packed (a LoRA run with ``base_bits: 4``), no dense copy of them
is ever in host memory and the engine trains exactly like a plain loop on the decoded model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.errors import ConfigError
from engine.model import quant
from engine.model.loading import load_model, resolve_model_path
from engine.model.prequantized import BnbLayout, Mxfp4Layout, StackedLayout
from tests.engine.model.test_mxfp4 import HUB_QUANTIZATION, encode_mxfp4, is_expert_matrix
from tests.engine.model.test_quant import lora_of
from tests.engine.tiny import FAMILIES, SPLIT_PLAN, bitwise_equal, max_diff, plain_loop, tiny_model

TOL = 1e-5
# bitsandbytes' settings of the two folders: NF4 with double-quantized scales, codes in uint8;
# FP4 without, its codes stored in bfloat16 tensors (``bnb_4bit_quant_storage``)
BNB = {"nf4": True, "fp4": False}


def _bnb_folder(root: Path, quant_type: str) -> Path:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dense = root / "dense"
    if not dense.is_dir():
        model = tiny_model("llama", blocks=3, intermediate_size=96).to(torch.bfloat16)
        model.save_pretrained(dense)
    folder = root / f"bnb-{quant_type}"
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=BNB[quant_type],
        bnb_4bit_quant_storage=torch.uint8 if BNB[quant_type] else torch.bfloat16,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    AutoModelForCausalLM.from_pretrained(
        dense, quantization_config=config, dtype=torch.bfloat16
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bnb(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb")
    return {kind: _bnb_folder(root, kind) for kind in BNB}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-OSS folder as the hub ships one (MXFP4 experts, the rest bf16)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("gpt-oss")
    model = tiny_model("gpt_oss", blocks=3, intermediate_size=32)  # MXFP4: blocks of 32
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.to(torch.bfloat16)
        if is_expert_matrix(name):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = encode_mxfp4(value.float().transpose(1, 2))
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = HUB_QUANTIZATION
    config["architectures"] = ["GptOssForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _bnb_reference(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each quantized weight as bitsandbytes decodes it: its portable torch implementation (the
    arithmetic of its CUDA kernel). Its compiled CPU kernel of this version decodes these
    checkpoints differently (a 3x larger error against the original weights), so it is not the
    reference. The function is called as written, not through the ``torch.compile`` wrapper
    bitsandbytes puts around it (which falls back to it when compiling fails): the same arithmetic,
    without compiling a kernel for every shape and dtype first."""
    import bitsandbytes.functional as bf
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from safetensors import safe_open

    decode = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)

    out = {}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        for key in keys:
            state_keys = [k for k in keys if k.startswith(f"{key}.quant_state.")]
            if not state_keys:
                continue
            parts = {k[len(key) + 1 :]: f.get_tensor(k) for k in keys if k.startswith(f"{key}.")}
            state = bf.QuantState.from_dict(parts, device=torch.device("cpu"))
            if state.nested:
                absmax = bf.dequantize_blockwise(state.absmax, state.state2) + state.offset
            else:
                absmax = state.absmax.float()
            codes = f.get_tensor(key).reshape(-1).view(torch.uint8)
            out[key] = decode(codes, absmax, state.code, state.blocksize, state.shape, dtype)
    return out


@pytest.mark.parametrize("quant_type", list(BNB))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bnb_folder_decodes_as_bitsandbytes_dense_or_packed(
    bnb: dict[str, Path], quant_type: str, dtype: torch.dtype
) -> None:
    folder = bnb[quant_type]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["bnb_4bit_quant_type"] == quant_type
    reference = _bnb_reference(folder, dtype)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stored = f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype()
    assert stored == ("U8" if BNB[quant_type] else "BF16")
    # every linear weight of the blocks is quantized (7 a block, 3 blocks), nothing else
    assert len(reference) == 21 and all(".layers." in k for k in reference)
    name = str(dtype).removeprefix("torch.")
    dense = load_model(folder, name)
    packed = load_model(folder, name, keep_packed=True)
    d, p = dict(dense.named_parameters()), dict(packed.named_parameters())
    assert set(d) == set(p)
    original = tiny_model("llama", blocks=3, intermediate_size=96).to(torch.bfloat16).state_dict()
    for key, value in d.items():
        if key in reference:
            assert torch.equal(value.data, reference[key]), key
            buffer, layout = quant.attached(p[key]) or (None, None)
            assert isinstance(layout, BnbLayout) and buffer is not None and buffer.dtype == torch.uint8
            assert torch.equal(layout.unpack(buffer), reference[key]), key
            # packed: the parameter holds no values, the buffer about 4.5 bits a value
            assert p[key].shape == value.shape and p[key].untyped_storage().nbytes() <= 4
            assert buffer.numel() < 0.2 * value.numel() * 4 + 1200
            # and it is the weight: NF4/FP4 rounding of the bf16 original, no more
            assert (value.float() - original[key].float()).abs().max() < 0.4 * original[key].abs().max()
        else:
            assert quant.attached(p[key]) is None
            assert torch.equal(value.data, original[key].to(dtype)) and torch.equal(
                p[key].data, value.data
            ), key
    assert dense.training and not hasattr(dense.config, "quantization_config")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpt_oss_experts_kept_packed_decode_as_transformers_de_quantizes_them(
    gpt_oss: Path, dtype: torch.dtype
) -> None:
    name = str(dtype).removeprefix("torch.")
    dense = load_model(gpt_oss, name)  # transformers' own MXFP4 de-quantization
    packed = load_model(gpt_oss, name, keep_packed=True)
    d, p = dict(dense.named_parameters()), dict(packed.named_parameters())
    experts = 0
    for key, value in d.items():
        found = quant.attached(p[key])
        if is_expert_matrix(key):
            experts += 1
            assert found is not None and isinstance(found[1], Mxfp4Layout)
            buffer, layout = found
            assert torch.equal(layout.unpack(buffer), value.data), key
            # 17 bytes per 32 values (codes and one exponent), nothing dense
            assert buffer.numel() <= value.numel() * 17 // 32 + 2 * quant.ALIGN
            assert p[key].untyped_storage().nbytes() <= 4
        else:
            assert found is None and torch.equal(p[key].data, value.data), key
    assert experts == 6
    for key, value in dense.named_buffers():
        assert torch.equal(dict(packed.named_buffers())[key], value), key


def _engine_run(folder: Path, batches: list[dict[str, torch.Tensor]], workers: int) -> tuple[Any, ...]:
    """LoRA with a 4-bit base on the folder loaded packed: losses, masters, and the names of the
    weights kept packed as loaded and those the engine packed itself (NF4)."""
    lora = lora_of(load_model(folder, "float32", keep_packed=True), seed=3)
    config = EngineConfig(
        devices=["cpu"] * workers,
        num_microbatches=3,
        optimizer="sgd",
        lr=0.1,
        partition=None if workers == 1 else SPLIT_PLAN,
        base_bits=4,
    )
    rp = RoundPipe(lora, config)
    try:
        loaded = {
            n
            for t in rp.host.tensors
            if t.packed is not None and not isinstance(t.packed, quant.Packed)
            for n in t.names
        }
        ours = {n for t in rp.host.tensors if isinstance(t.packed, quant.Packed) for n in t.names}
        # the model's own copies of the loaded weights hold nothing
        assert all(p.untyped_storage().nbytes() == 0 for n, p in lora.named_parameters() if n in loaded)
        losses = []
        for batch in batches:
            losses.append(rp.forward_backward(**batch))
            rp.step()
        return losses, rp.master_state_dict(), loaded, ours
    finally:
        rp.close()


@pytest.mark.parametrize("kind", ["bnb", "gpt_oss"])
def test_lora_on_a_packed_checkpoint_equals_the_plain_loop_on_its_decoded_model(
    kind: str, bnb: dict[str, Path], gpt_oss: Path, batches: list[dict[str, torch.Tensor]]
) -> None:
    folder = bnb["nf4"] if kind == "bnb" else gpt_oss
    runs = [_engine_run(folder, batches, workers) for workers in (1, 3)]
    _, _, loaded, ours = runs[0]
    if kind == "bnb":  # every block linear arrived quantized: the engine packs nothing itself
        assert len(loaded) == 21 and not ours
    else:  # the experts arrived in MXFP4; the attention projections the engine packs in NF4
        assert {n.rsplit(".", 1)[-1] for n in loaded} == {"gate_up_proj", "down_proj"} and ours
        assert all(".self_attn." in n for n in ours), sorted(ours)
    # the reference: the decoded model, the engine's own NF4 weights replaced by their values
    reference = lora_of(load_model(folder, "float32"), seed=3)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in ours:
                p.copy_(quant.dequantized(p, torch.float32))
    ref_losses, ref_state = plain_loop(
        copy.deepcopy(reference), batches, lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    for losses, state, _, _ in runs:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
        assert max_diff(state, ref_state) < TOL
    assert runs[0][0] == runs[1][0] and bitwise_equal(runs[0][1], runs[1][1])


def test_a_weight_loaded_packed_needs_a_frozen_4bit_base(bnb: dict[str, Path]) -> None:
    lora = lora_of(load_model(bnb["nf4"], "float32", keep_packed=True), seed=3)
    with pytest.raises(ValueError, match="base_bits 4"):
        RoundPipe(lora, EngineConfig(devices=["cpu"]))


def test_8bit_and_mismatched_checkpoints_are_config_errors_naming_the_folder(
    bnb: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    eight = tmp_path / "eight"
    shutil.copytree(bnb["nf4"], eight)
    config = json.loads((eight / "config.json").read_text())
    q = config["quantization_config"]
    q.update(load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True)
    (eight / "config.json").write_text(json.dumps(config))
    for load in (load_model, lambda f: resolve_model_path(str(f), tmp_path)):
        with pytest.raises(ConfigError, match="not 4-bit") as exc:
            load(eight)
        assert exc.value.field == "model.path"
    # a config that does not describe the checkpoint (more layers than it holds)
    wrong = tmp_path / "wrong"
    shutil.copytree(bnb["nf4"], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="does not match the model") as exc:
        load_model(wrong, keep_packed=True)
    assert exc.value.field == "model.path" and "model.layers.3." in str(exc.value)


def test_a_lora_job_on_a_bnb_folder_trains_resumes_and_exports_merged(tmp_path: Path) -> None:
    """The whole run: a LoRA job with a 4-bit base on a bitsandbytes folder trains with its
    weights packed, checkpoints, resumes, and its merged export is the decoded base plus the
    adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from engine.commands.cli import main
    from engine.config import TrainConfig
    from engine.training.checkpoint import load_state
    from engine.training.run import train
    from tests.engine.tiny import tiny_model_folder, tiny_tokenizer

    dense = tiny_model_folder(tmp_path / "dense", "llama")
    folder = tmp_path / "bnb"
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)
    AutoModelForCausalLM.from_pretrained(
        dense, quantization_config=quantization, dtype=torch.bfloat16
    ).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{a} plus {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a in range(6)
        for b in range(4)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def job(out: str, steps: int, bits: int = 4) -> TrainConfig:
        return TrainConfig.parse(
            {
                "model": {"path": str(folder), "name": "tiny-bnb"},
                "data": {"train": str(tmp_path / "train.jsonl"), "max_length": 48},
                "method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8, "base_bits": bits},
                "hyper": {"max_steps": steps, "batch_size": 4, "learning_rate": 5e-3, "schedule": "constant"},
                "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2, "compute_dtype": "float32"},
                "checkpoint": {"every_steps": 2, "keep_last": 5},
                "output_dir": str(tmp_path / out),
            }
        )

    whole = train(job("whole", 4))
    assert whole.status == "succeeded" and whole.step == 4
    train(job("halves", 2))
    resumed = train(job("halves", 4))
    assert resumed.step == 4
    one, two = (load_state(r.checkpoint)[0]["masters"] for r in (whole, resumed))
    assert set(one) == set(two) and all(torch.equal(one[k], two[k]) for k in one)  # bitwise
    # a 16-bit base decodes the same folder to dense weights: the same run, to float rounding
    sixteen = load_state(train(job("sixteen", 4, bits=16)).checkpoint)[0]["masters"]
    assert max((sixteen[k] - one[k]).abs().max().item() for k in one) < 1e-5
    # merged: the folder decoded by the engine plus the adapter, a plain model
    out = tmp_path / "merged"
    assert main(["export", str(whole.checkpoint), "--out", str(out), "--merged", "--base", str(folder)]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(out)
    reference = PeftModel.from_pretrained(load_model(folder), whole.checkpoint)
    ids = torch.tensor([[3, 17, 42, 8, 9, 5]])
    with torch.no_grad():
        assert (
            merged.eval()(input_ids=ids).logits - reference.eval()(input_ids=ids).logits
        ).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_counts_mxfp4_experts_as_stored(gpt_oss: Path, dtype: str) -> None:
    """A 4-bit base of an MXFP4 checkpoint: the plan's bytes per layer are what the host holds
    (the experts at 17 bytes per 32 values, the attention in NF4, GPT-OSS's norms in fp32, the
    rest in the compute dtype)."""
    from dataclasses import replace

    from engine.model.families import family_for
    from engine.parallel.host import DTYPES
    from engine.planner import Hardware, Shape, Workload, memory_model
    from engine.planner.fit import trainable_per_layer
    from engine.planner.quantized import mxfp4_bytes, packed_bytes

    config = json.loads((gpt_oss / "config.json").read_text())
    shape = Shape.from_config(config)
    assert shape.stored_experts == "mxfp4"
    targets = tuple(family_for("GptOssForCausalLM").lora_targets)
    job = Workload(lora_r=4, target_modules=targets, compute_dtype=dtype, base_bits=4)
    memory = memory_model(shape, job, Hardware(), trainable_per_layer(shape, job))
    lora = lora_of(load_model(gpt_oss, dtype, keep_packed=True), seed=3)
    with RoundPipe(lora, EngineConfig(base_bits=4, compute_dtype=dtype)) as rp:
        host = rp.host
        held = [float(host.param_bytes(i)) for i in range(host.num_layers)]
        d = torch.empty((), dtype=DTYPES[dtype]).element_size()
        decoded = [0.0] * host.num_layers
        for t in host.tensors:
            if t.packed is not None:
                decoded[t.owner] += t.packed.shape.numel() * d
    assert memory.weights == held and memory.decoded == decoded
    # without the MXFP4 note (an unquantized GPT-OSS) the experts are counted in NF4
    plain = memory_model(
        replace(shape, stored_experts=None), job, Hardware(), trainable_per_layer(shape, job)
    )
    expert = 4 * 32 * 64
    nf4, mx = (
        packed_bytes(expert, d) + packed_bytes(expert // 2, d),
        mxfp4_bytes(expert) + mxfp4_bytes(expert // 2),
    )
    assert [b - a for a, b in zip(plain.weights, memory.weights, strict=True)] == [0, *[mx - nf4] * 3, 0]


def test_lora_on_the_mxfp4_experts_themselves_equals_the_plain_loop(
    gpt_oss: Path, batches: list[dict[str, torch.Tensor]]
) -> None:
    """peft's LoRA on the expert parameters (``target_parameters``) over experts kept in MXFP4:
    the adapter wraps a placeholder on the host and the decoded weight on the worker."""
    from peft import LoraConfig, get_peft_model

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        wrapped = get_peft_model(model, config)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        return wrapped

    packed = lora(load_model(gpt_oss, "float32", keep_packed=True))
    assert any("experts" in n and "lora_A" in n for n, _ in packed.named_parameters())
    config = EngineConfig(devices=["cpu"] * 2, num_microbatches=3, optimizer="sgd", lr=0.1, base_bits=4)
    with RoundPipe(packed, config) as rp:
        assert sum(isinstance(t.packed, Mxfp4Layout) for t in rp.host.tensors) == 6
        ours = {n for t in rp.host.tensors if isinstance(t.packed, quant.Packed) for n in t.names}
        losses = []
        for batch in batches:
            losses.append(rp.forward_backward(**batch))
            rp.step()
        state = rp.master_state_dict()
    reference = lora(load_model(gpt_oss, "float32"))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in ours:
                p.copy_(quant.dequantized(p, torch.float32))
    ref_losses, ref_state = plain_loop(reference, batches, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
    assert max_diff(state, ref_state) < TOL


@pytest.fixture(scope="module")
def bnb_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Two bitsandbytes 4-bit Qwen3-MoE folders with one entry per expert and projection, as the
    checkpoints store them (transformers fuses them into ``gate_up_proj``/``down_proj`` on load):
    one written by transformers with bitsandbytes (its experts stay bf16: they are not
    ``nn.Linear``s), one whose expert entries are bitsandbytes-quantized too, as the hub's older
    ``-bnb-4bit`` MoE checkpoints are (each quantized by bitsandbytes and written with its
    quantization state, as transformers writes a ``Linear4bit``). And the original weights."""
    import bitsandbytes.functional as bf
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("bnb-moe")
    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "dense")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    plain = root / "experts-bf16"
    AutoModelForCausalLM.from_pretrained(
        root / "dense", quantization_config=config, dtype=torch.bfloat16
    ).save_pretrained(plain)
    quantized = root / "experts-4bit"
    quantized.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(plain / "model.safetensors", framework="pt") as f:
        names = f.keys()
        for key in names:
            value = f.get_tensor(key)
            if ".experts." in key:
                codes, state = bf.quantize_4bit(
                    value, blocksize=64, quant_type="nf4", compress_statistics=True
                )
                tensors[key] = codes
                tensors |= {f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()}
            else:
                tensors[key] = value
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    (quantized / "config.json").write_text((plain / "config.json").read_text())
    return plain, quantized, original


def test_per_expert_entries_fill_the_fused_experts_of_a_mixture(
    bnb_moe: tuple[Path, Path, dict[str, torch.Tensor]], batches: list[dict[str, torch.Tensor]]
) -> None:
    plain, quantized, original = bnb_moe
    reference = _bnb_reference(quantized, torch.float32)
    assert any(".experts.0.gate_proj." in k for k in reference)  # the experts are quantized there
    # bf16 experts: the fused parameters are the original experts, kept plain (the engine packs
    # them itself under a 4-bit base)
    for keep in (False, True):
        model = load_model(plain, "float32", keep_packed=keep)
        state = dict(model.named_parameters())
        gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
        assert quant.attached(gate_up) is None
        assert torch.equal(gate_up.data, original["model.layers.1.mlp.experts.gate_up_proj"].float())
        assert torch.equal(
            state["model.layers.1.mlp.experts.down_proj"].data,
            original["model.layers.1.mlp.experts.down_proj"].float(),
        )
    # quantized experts: kept packed as stored, one piece per expert and projection, decoding to
    # bitsandbytes' values stacked as transformers fuses them (gate rows, then up rows)
    dense = dict(load_model(quantized, "float32").named_parameters())
    packed = dict(load_model(quantized, "float32", keep_packed=True).named_parameters())
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = original[f"{prefix}.down_proj"].shape[0]
        gate_up = torch.stack(
            [
                torch.cat(
                    [reference[f"{prefix}.{e}.gate_proj.weight"], reference[f"{prefix}.{e}.up_proj.weight"]]
                )
                for e in range(experts)
            ]
        )
        down = torch.stack([reference[f"{prefix}.{e}.down_proj.weight"] for e in range(experts)])
        for name, want in ((f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)):
            assert torch.equal(dense[name].data, want), name
            buffer, layout = quant.attached(packed[name]) or (None, None)
            assert isinstance(layout, StackedLayout) and buffer is not None
            assert len(layout.pieces) == experts * (2 if "gate_up" in name else 1)
            assert torch.equal(layout.unpack(buffer), want) and packed[name].untyped_storage().nbytes() <= 4
    # and the engine trains on it exactly like the plain loop on the decoded model
    runs = [_engine_run(quantized, batches, workers) for workers in (1, 3)]
    loaded = runs[0][2]
    assert {n.rsplit(".", 1)[-1] for n in loaded if ".experts." in n} == {"gate_up_proj", "down_proj"}
    reference_model = lora_of(load_model(quantized, "float32"), seed=3)
    ref_losses, ref_state = plain_loop(reference_model, batches, lambda ps: torch.optim.SGD(ps, lr=0.1))
    for losses, state, _, ours in runs:
        assert not ours  # every block matrix arrived quantized
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
        assert max_diff(state, ref_state) < TOL
    assert runs[0][0] == runs[1][0] and bitwise_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reader_knows_every_key_conversion_transformers_applies_to_a_family(family: str) -> None:
    """Our reader fills a model from a quantized folder without transformers' loading, so it must
    do what transformers does to a family's checkpoint keys on load. For the families the engine
    trains that is only the fusion of a mixture's per-expert entries (stacked along the experts,
    gate rows then up rows): this fails when a transformers release adds another conversion."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    from engine.model.prequantized import _PER_EXPERT, _fused_name

    for transform in get_model_conversion_mapping(tiny_model(family), add_legacy=False):
        (target,) = transform.target_patterns
        sources = list(transform.source_patterns)
        operations = [(type(o).__name__, getattr(o, "dim", None)) for o in transform.operations]
        if len(sources) == 1:  # down_proj: the experts stacked
            assert operations == [("MergeModulelist", 0)], (family, transform)
        else:  # gate_up_proj: the experts stacked, then gate and up joined row-wise in that order
            assert [s.rsplit(".", 2)[-2] for s in sources] == ["gate_proj", "up_proj"], (family, transform)
            assert operations == [("MergeModulelist", 0), ("Concatenate", 1)], (family, transform)
        for source in sources:
            key = "model.layers.1." + source.replace("*", "7")
            match = _PER_EXPERT.match(key)
            assert match is not None, (family, key)
            assert _fused_name(match) == "model.layers.1." + target, (family, key)
