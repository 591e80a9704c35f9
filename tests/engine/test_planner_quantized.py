"""A 4-bit base in the plan: packed bytes as the engine holds them, the decoded weights and the
decoding's scratch on the GPU, and both bases side by side for a LoRA job."""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine import EngineConfig, RoundPipe
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.model import quant
from engine.model.families import family_for
from engine.planner import SEQ_LEN_STEP, Hardware, Shape, Workload, memory_model, plan_job
from engine.planner.fit import trainable_per_layer
from engine.planner.quantized import PACK_MULTIPLE, decode_scratch_bytes, packed_bytes
from tests.engine.test_planner import LLAMA_3_8B, config_of
from tests.engine.tiny import tiny_model

# Qwen3-32B's config.json (the sizes): 64 blocks, 65.5 GB of bf16 weights
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def test_packed_bytes_are_the_buffers_the_engine_packs() -> None:
    # the planner's count against what packing really writes (the engine's layout imports the
    # planner's arithmetic: only a real buffer can check it)
    for numel in (128, 640, 1024, 3 * 2**14, 2**20 + 128):
        for dtype, d in ((torch.bfloat16, 2), (torch.float32, 4)):
            buffer, _ = quant.pack(torch.randn(numel // 64, 64), dtype)
            assert packed_bytes(numel, d) == buffer.numel(), (numel, d)
    assert PACK_MULTIPLE == 2 * quant.BLOCK


def _lora(family: str) -> tuple[torch.nn.Module, tuple[str, ...]]:
    from peft import LoraConfig, get_peft_model

    base = tiny_model(family)
    targets = tuple(family_for(type(base).__name__).lora_targets)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets))), targets


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("llama", "bfloat16"),
        ("llama", "float32"),
        ("phi3", "float32"),
        ("qwen3_moe", "float32"),
        ("gpt_oss", "float32"),
        ("deepseek_v3", "float32"),
        # the families that keep some weights in fp32 whatever the dtype (GPT-OSS's norms,
        # DeepSeek-V3's router): the plan counts those at 4 bytes
        ("gpt_oss", "bfloat16"),
        ("deepseek_v3", "bfloat16"),
        ("qwen3_moe", "bfloat16"),
    ],
)
def test_planned_upload_bytes_are_what_the_host_holds_with_a_4bit_base(family: str, dtype: str) -> None:
    lora, targets = _lora(family)
    shape = Shape.from_config(config_of(lora.get_base_model()))
    job = Workload(lora_r=4, target_modules=targets, compute_dtype=dtype, base_bits=4)
    memory = memory_model(shape, job, Hardware(), trainable_per_layer(shape, job))
    config = EngineConfig(base_bits=4, compute_dtype=dtype)
    buffers = {name for name, _ in lora.named_buffers()}

    def held_by(host: Any) -> list[float]:
        held = [float(host.param_bytes(i)) for i in range(host.num_layers)]
        for t in host.tensors:
            if t.names and set(t.names) <= buffers:  # not a weight (DeepSeek-V3's router bias)
                held[t.owner] -= t.compute.numel() * t.compute.element_size()
        return held

    with RoundPipe(copy.deepcopy(lora), config) as rp:
        host = rp.host
        held = held_by(host)
        d = torch.empty((), dtype=DTYPES[dtype]).element_size()
        decoded = [0.0] * host.num_layers
        largest = [0] * host.num_layers
        for t in host.tensors:
            if t.packed is not None:
                decoded[t.owner] += t.packed.numel * d
                largest[t.owner] = max(largest[t.owner], t.packed.numel)
    assert memory.weights == held  # packed blocks, the rest and the adapters in the compute dtype
    assert memory.decoded == decoded
    assert memory.scratch == [n * decode_scratch_bytes(d) for n in largest]
    # 16 bits: every layer's compute copy, nothing to decode
    plain = memory_model(shape, replace(job, base_bits=16), Hardware(), trainable_per_layer(shape, job))
    assert all(a < b for a, b in zip(memory.weights[1:-1], plain.weights[1:-1], strict=True))
    assert plain.decoded == [] and plain.scratch == []
    with RoundPipe(copy.deepcopy(lora), replace(config, base_bits=16)) as rp:
        assert plain.weights == held_by(rp.host)


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors the ops in its scope made."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def _drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.now -= self.sizes.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.refs:
                    self.refs[ptr], self.sizes[ptr] = 0, t.untyped_storage().nbytes()
                    self.now += self.sizes[ptr]
                    self.peak = max(self.peak, self.now)
                self.refs[ptr] += 1
                weakref.finalize(t, self._drop, ptr)
        return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decoding_takes_at_most_the_planned_scratch(dtype: str) -> None:
    weight = torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(0))
    buffer, layout = quant.pack(weight, DTYPES[dtype])
    layout.unpack(buffer)  # torchao's first call imports and caches
    live = _LiveBytes()
    with live:
        dense = layout.unpack(buffer)
    d = dense.element_size()
    scratch = live.peak - dense.numel() * d
    assert dense.numel() * d <= scratch <= dense.numel() * decode_scratch_bytes(d)


def test_a_lora_plan_shows_a_16_bit_and_a_4_bit_base() -> None:
    box = Hardware(num_gpus=8, gpu_memory_gb=24.0, host_ram_gb=64.0)
    job = Workload(seq_len=2048, batch_size=16, num_microbatches=16, steps=10)
    report = plan_job(QWEN3_32B, box, job)
    sixteen, four = report.base_variants
    assert (sixteen["base_bits"], four["base_bits"]) == (16, 4) and report.base_bits == 16
    # 66 GB of bf16 weights do not fit 0.9 x 64 GB; packed blocks (4.1 bits) and the 16-bit
    # embeddings and head do
    assert not report.fits and sixteen["limit"] == "host_ram" and sixteen["max_seq_len"] == 0
    assert sixteen["host_ram_gb"] == pytest.approx(report.host_ram["total_gb"])
    assert four["fits"] and four["limit"] is None and 0.25 < four["weights_gb"] / sixteen["weights_gb"] < 0.35
    assert any("4-bit base" in s for s in report.suggestions)
    quantized = plan_job(QWEN3_32B, box, replace(job, base_bits=4))
    assert quantized.fits and quantized.base_bits == 4
    assert quantized.base_variants == report.base_variants  # the same two, whichever the job has
    assert quantized.host_ram["total_gb"] == pytest.approx(four["host_ram_gb"])
    # the weights cross PCIe packed: the plan's upload term shrinks with the host copy
    assert quantized.pcie is not None and four["pcie_gb_per_iteration"] == quantized.pcie["total_gb"]
    assert quantized.pcie["weights_gb"] / plan_job(QWEN3_32B, replace(box, host_ram_gb=None), job).pcie[
        "weights_gb"
    ] == pytest.approx(four["weights_gb"] / sixteen["weights_gb"], rel=0.05)
    # the longest sequence with a 4-bit base is the edge of its fit
    longest = four["max_seq_len"]
    assert (longest, four["max_seq_len_limit"]) == (quantized.max_seq_len, quantized.max_seq_len_limit)
    assert plan_job(QWEN3_32B, box, replace(job, base_bits=4, seq_len=longest)).fits
    assert not plan_job(QWEN3_32B, box, replace(job, base_bits=4, seq_len=longest + SEQ_LEN_STEP)).fits
    # a full fine-tune has no 4-bit base
    assert plan_job(QWEN3_32B, box, replace(job, method="full")).base_variants == []


def test_the_gpu_holds_packed_and_decoded_weights_so_a_4bit_base_fits_shorter_sequences() -> None:
    box = Hardware(num_gpus=1, gpu_memory_gb=24.0)
    job = Workload(seq_len=2048, batch_size=1, num_microbatches=1, base_bits=4)
    report = plan_job(LLAMA_3_8B, box, job)
    sixteen, four = report.base_variants
    assert four["max_seq_len_limit"] == sixteen["max_seq_len_limit"] == "gpu_memory"
    assert 0 < four["max_seq_len"] < sixteen["max_seq_len"]
    assert plan_job(LLAMA_3_8B, box, replace(job, seq_len=four["max_seq_len"])).fits
    assert not plan_job(LLAMA_3_8B, box, replace(job, seq_len=four["max_seq_len"] + SEQ_LEN_STEP)).fits
    stage = report.stages[0]
    shape = Shape.from_config(LLAMA_3_8B)
    blocks = range(max(stage["layers"][0], 1), min(stage["layers"][1], shape.layers + 1))
    dense = sum(sum(shape.packable(b - 1, PACK_MULTIPLE)) * 2 for b in blocks)
    largest = max(max(shape.packable(b - 1, PACK_MULTIPLE)) for b in blocks)
    assert stage["memory_gb"]["dequantized"] * 1e9 == pytest.approx(dense + largest * decode_scratch_bytes(2))


def test_base_bits_come_from_the_run_and_are_for_lora_only() -> None:
    config = TrainConfig.model_validate(
        {
            "data": {"train": "x.jsonl"},
            "model": {"path": "m"},
            "method": {"kind": "lora", "base_bits": 4},
            "output_dir": "out",
        }
    )
    assert Workload.from_train_config(config).base_bits == 4
    with pytest.raises(ConfigError) as info:
        plan_job(LLAMA_3_8B, Hardware(), Workload(method="full", base_bits=4))
    assert info.value.field == "base_bits"
    with pytest.raises(ConfigError, match="base_bits=8 must be 16 or 4"):
        plan_job(LLAMA_3_8B, Hardware(), Workload(base_bits=8))
