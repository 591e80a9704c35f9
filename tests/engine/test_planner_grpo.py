"""The planner and GRPO's reference and reuse: a full fine-tune's frozen copy of its initial weights
counted in host RAM as the engine keeps it, a batch of completions sampled once every
``num_iterations`` steps, and the steps an epoch takes."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from engine import EngineConfig, RoundPipe
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.planner import Hardware, Workload, plan_job
from tests.engine.methods.test_grpo_run import GRADER
from tests.engine.test_planner import LLAMA_3_8B
from tests.engine.tiny import tiny_model

GRPO = Workload(
    method="grpo",
    dpo_tuning="full",
    seq_len=1024,
    batch_size=4,
    group_size=8,
    completion_tokens=256,
    num_microbatches=4,
    steps=10,
)
BOX = Hardware(num_gpus=2, gpu_memory_gb=80.0)


def test_host_ram_counts_the_reference_copy_the_engine_keeps() -> None:
    model = tiny_model("llama")
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=2)) as rp:
        kept = rp.keep_initial_weights()
    job = replace(GRPO, compute_dtype="float32", seq_len=16, completion_tokens=8, kl_reference=True)
    config = model.config.to_dict()
    with_kl = plan_job(config, Hardware(num_gpus=2, gpu_memory_gb=24.0), job)
    assert with_kl.host_ram["reference_weights_gb"] * 1e9 == pytest.approx(kept, rel=1e-9)
    without = plan_job(config, Hardware(num_gpus=2, gpu_memory_gb=24.0), replace(job, kl_reference=False))
    assert without.host_ram["reference_weights_gb"] == 0.0
    assert with_kl.host_ram["total_gb"] == pytest.approx(without.host_ram["total_gb"] + kept / 1e9)
    # a LoRA run's reference is its base with the adapters off: no copy
    lora = plan_job(config, Hardware(num_gpus=2, gpu_memory_gb=24.0), replace(job, dpo_tuning="lora"))
    assert lora.host_ram["reference_weights_gb"] == 0.0


def test_a_batch_of_completions_is_sampled_once_every_num_iterations_steps() -> None:
    once = plan_job(LLAMA_3_8B, BOX, replace(GRPO, kl_reference=True))
    twice = plan_job(LLAMA_3_8B, BOX, replace(GRPO, kl_reference=True, num_iterations=2))
    r1, r2 = once.rollout, twice.rollout
    assert r1 is not None and r2 is not None and once.rollout_s is not None
    assert (r1["iterations"], r1["old_s"]) == (1, 0.0)
    # mu 2: the policy's log-probabilities before the first step, a forward pass like the reference's
    assert r2["iterations"] == 2 and r2["old_s"] == pytest.approx(r2["reference_s"]) and r2["old_s"] > 0
    assert twice.rollout_s == pytest.approx((once.rollout_s + r2["old_s"]) / 2)
    assert twice.step_s == pytest.approx(twice.iteration_s + twice.rollout_s) and twice.step_s < once.step_s
    assert twice.eta_s == pytest.approx(10 * twice.step_s)
    assert "each batch trains 2 steps" in twice.describe()
    with pytest.raises(ConfigError, match="num_iterations=17 must be an integer from 1 to 16"):
        plan_job(LLAMA_3_8B, BOX, replace(GRPO, num_iterations=17))


def test_an_epoch_of_a_grpo_run_takes_num_iterations_steps_a_batch() -> None:
    method = {"objective": "grpo", "tuning": "full", "grader": GRADER, "beta": 0.04, "num_iterations": 3}
    config = TrainConfig.parse(
        {"data": {"train": "p.jsonl"}, "method": method, "hyper": {"epochs": 1.5, "batch_size": 8}}
    )
    workload = Workload.from_train_config(config, num_sequences=100)
    assert (workload.num_iterations, workload.kl_reference, workload.tuning) == (3, True, "full")
    assert workload.steps == 54  # ceil(1.5 * (100 // 8) * 3), as the run's batcher counts them
