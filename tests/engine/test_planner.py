"""The planner's memory figures against a real (tiny) model and engine; its advice when it does not fit."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.config import TrainConfig, resolve_compute_dtype
from engine.planner import Hardware, Shape, Workload, calibrate, plan_job
from tests.engine.tiny import tiny_batch, tiny_model

QWEN3_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_match_the_model(family: str, tied: bool) -> None:
    model = tiny_model(family, tied=tied)
    shape = Shape.from_config(model.config.to_dict())
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))  # qwen2 q/k/v bias
    assert sum(shape.layer_params()) + biases == sum(p.numel() for p in model.parameters())


def test_lora_trainable_count_matches_peft() -> None:
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    shape = Shape.from_config(model.config.to_dict())
    targets = ("q_proj", "v_proj", "down_proj")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.layers * shape.lora_params(4, targets) == trainable


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_lora_count_of_fused_projections_matches_peft(family: str) -> None:
    from peft import LoraConfig, get_peft_model

    from engine.model.families import family_for

    model = tiny_model(family)
    shape = Shape.from_config(model.config.to_dict())
    targets = family_for(type(model).__name__).lora_targets
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.layers * shape.lora_params(4, tuple(targets)) == trainable


def test_host_optimizer_bytes_match_the_engine_after_a_step() -> None:
    model = tiny_model("llama")
    config = model.config.to_dict()
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=2)) as rp:
        rp.forward_backward(**tiny_batch(batch=4, seed=1))
        rp.step()
        rp.synchronize()
        measured = 0
        for t in rp.host.trainable:
            assert t.master is not None and t.master.grad is not None
            measured += t.master.numel() * t.master.element_size() + t.master.grad.numel() * 4
            for owner_opt in rp.optimizer.optimizers.values():
                state = owner_opt.state.get(t.master, {})
                measured += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
        weights = sum(t.compute.numel() * t.compute.element_size() for t in rp.host.tensors)
    hardware = Hardware(num_gpus=2, gpu_memory_gb=24.0)
    report = plan_job(
        config,
        hardware,
        Workload(method="full", compute_dtype="float32", batch_size=4, num_microbatches=2, seq_len=16),
    )
    assert report.host_ram["optimizer_gb"] * 1e9 == pytest.approx(measured, rel=1e-9)
    assert report.host_ram["weights_gb"] * 1e9 == pytest.approx(weights, rel=1e-9)


def test_a_plan_that_fits_and_one_that_does_not() -> None:
    box = Hardware(num_gpus=4, gpu_memory_gb=24.0, host_ram_gb=128.0)
    ok = plan_job(QWEN3_1_7B, box, Workload(steps=1000))
    assert ok.fits and ok.problems == [] and ok.tokens_per_s > 0
    assert ok.eta_s == pytest.approx(1000 * ok.iteration_s)
    assert all(s["gpu_memory_gb"] <= 24.0 for s in ok.stages)
    assert 0 <= ok.bubble < 1
    # async: iterations overlap without a flush, so the period is shorter than a sync iteration
    overlapped = plan_job(QWEN3_1_7B, box, Workload(steps=1000, async_optimizer=True))
    assert overlapped.iteration_s < ok.iteration_s
    # a full fine-tune of a 1.7B model needs ~28 GB of optimizer state: not on a 16 GB host
    small_host = plan_job(QWEN3_1_7B, Hardware(num_gpus=4, host_ram_gb=16.0), Workload(method="full"))
    assert not small_host.fits and "host RAM" in small_host.problems[0]
    assert any("LoRA" in s for s in small_host.suggestions)
    # one micro-batch of 64k tokens: the output layer's logits alone do not fit a 24 GB GPU
    long = plan_job(QWEN3_1_7B, box, Workload(seq_len=65536, batch_size=2, num_microbatches=1))
    assert not long.fits and "micro-batch" in long.problems[0] and long.suggestions


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_microbatches=9 exceeds batch_size=4"):
        plan_job(QWEN3_1_7B, Hardware(), Workload(batch_size=4, num_microbatches=9))
    with pytest.raises(ValueError, match="hidden_size"):
        plan_job({"num_hidden_layers": 2}, Hardware(), Workload())
    with pytest.raises(ValueError, match="efficiency"):
        plan_job(QWEN3_1_7B, Hardware(efficiency=0.0), Workload())


def test_calibration_scales_the_rate_to_the_measurement() -> None:
    box = Hardware(num_gpus=2)
    before = plan_job(QWEN3_1_7B, box, Workload())
    tuned = calibrate(
        box, predicted_tokens_per_s=before.tokens_per_s, measured_tokens_per_s=before.tokens_per_s / 2
    )
    after = plan_job(QWEN3_1_7B, tuned, Workload())
    assert tuned.efficiency == pytest.approx(box.efficiency / 2)
    # compute dominates: half the rate gives about half the throughput (uploads do not scale)
    assert after.tokens_per_s == pytest.approx(before.tokens_per_s / 2, rel=0.15)
    assert torch.isfinite(torch.tensor(after.iteration_s))


def test_workload_from_train_config_maps_every_field() -> None:
    config = TrainConfig.parse(
        {
            "data": {"train": "train.jsonl", "max_length": 512},
            "method": {"kind": "full", "lora_r": 4, "target_modules": ["q_proj", "v_proj"]},
            "hyper": {"max_steps": 300, "batch_size": 12},
            "engine": {"num_microbatches": 6, "async_optimizer": True, "compute_dtype": "float16"},
        }
    )
    assert Workload.from_train_config(config) == Workload(
        seq_len=512,
        batch_size=12,
        method="full",
        lora_r=4,
        target_modules=("q_proj", "v_proj"),
        num_microbatches=6,
        compute_dtype="float16",
        async_optimizer=True,
        steps=300,
    )
    # max_steps wins over a row count; "auto" is the engine's rule (resolve_compute_dtype)
    assert Workload.from_train_config(config, num_sequences=10**6).steps == 300
    auto = config.model_copy(update={"engine": config.engine.model_copy(update={"compute_dtype": "auto"})})
    for on_gpu in (True, False):
        dtype = Workload.from_train_config(auto, on_gpu=on_gpu).compute_dtype
        assert dtype == resolve_compute_dtype("auto", on_gpu=on_gpu)
    assert Workload.from_train_config(auto).compute_dtype == "bfloat16"  # the planner plans GPUs


def test_workload_steps_from_epochs_count_whole_batches_like_the_run() -> None:
    config = TrainConfig.parse({"data": {"train": "t.jsonl"}, "hyper": {"epochs": 1.5, "batch_size": 8}})
    assert Workload.from_train_config(config).steps is None  # rows unknown
    assert Workload.from_train_config(config, num_sequences=100).steps == 18  # ceil(1.5 * (100 // 8))
    assert Workload.from_train_config(config, num_sequences=5).steps == 1  # less than one batch


def test_numbers_out_of_range_raise_config_error_not_arithmetic_errors() -> None:
    from engine.errors import ConfigError
    from engine.planner import HARDWARE_RANGES

    for bad, field in (
        (Hardware(gpu_memory_gb=5e-324, gpu_tflops=5e-324, efficiency=5e-324), "gpu_memory_gb"),
        (Hardware(link_gb_s=1e-300), "link_gb_s"),
        (Hardware(efficiency=5e-324), "efficiency"),
        (Hardware(gpu_tflops=float("inf")), "gpu_tflops"),
        (Hardware(gpu_memory_gb=float("nan")), "gpu_memory_gb"),
        (Hardware(host_ram_gb=0.0), "host_ram_gb"),
        (Hardware(num_gpus=65), "num_gpus"),
    ):
        with pytest.raises(ConfigError) as info:
            plan_job(QWEN3_1_7B, bad, Workload())
        assert info.value.field == field
    for key, value in (
        ("hidden_size", 10**400),
        ("num_hidden_layers", 10**6),
        ("head_dim", "x"),
        ("num_key_value_heads", 2.5),
        ("vocab_size", True),
    ):
        with pytest.raises(ConfigError) as info:
            plan_job(QWEN3_1_7B | {key: value}, Hardware(), Workload())
        assert info.value.field == key
    with pytest.raises(ConfigError, match="text_config"):
        Shape.from_config({"text_config": [1]})
    with pytest.raises(ConfigError, match="seq_len"):
        plan_job(QWEN3_1_7B, Hardware(), Workload(seq_len=2**40))
    # a measurement far below the prediction: the efficiency stays at the bottom of its range
    tuned = calibrate(Hardware(), predicted_tokens_per_s=1e9, measured_tokens_per_s=1.0)
    assert tuned.efficiency == HARDWARE_RANGES["efficiency"][0]
    assert plan_job(QWEN3_1_7B, tuned, Workload()).tokens_per_s > 0
