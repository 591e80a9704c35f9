"""The planner on a host without GPUs (one CPU worker at a measured rate per core), and times from
the training data's real token counts instead of ``max_length``."""

from __future__ import annotations

import pytest

from engine.config import TrainConfig
from engine.model.loading import demo_config
from engine.planner import CPU_GFLOPS_PER_CORE, Hardware, Workload, batch_length, calibrate, plan_job

DEMO_RUN = Workload(seq_len=128, batch_size=8, num_microbatches=4, compute_dtype="float32", steps=30)


def test_a_cpu_host_is_one_worker_in_host_ram_at_the_cores_rate() -> None:
    box = Hardware.cpu_host(cores=2, ram_gb=24.0, detected=("no GPU",))
    assert box.device == "cpu" and box.num_gpus == 1 and box.efficiency == 1.0
    assert box.gpu_memory_gb == box.host_ram_gb == 24.0
    assert box.gpu_tflops == pytest.approx(2 * CPU_GFLOPS_PER_CORE / 1000)
    report = plan_job(demo_config(), box, DEMO_RUN)
    assert report.fits and len(report.stages) == 1
    # measured here: SmolLM2-135M LoRA at ~190 tokens/s on 2 cores
    assert 120 < report.tokens_per_s < 300, report.tokens_per_s
    assert report.assumptions["device"] == "cpu"
    assert report.assumptions["hardware"] == "CPU host (no GPU reported)"
    assert "CPU host (no GPU reported)" in report.describe()
    four = plan_job(demo_config(), Hardware.cpu_host(cores=4, ram_gb=24.0), DEMO_RUN)
    assert four.tokens_per_s == pytest.approx(2 * report.tokens_per_s, rel=0.05)
    gpus = plan_job(demo_config(), Hardware(), DEMO_RUN)
    assert gpus.assumptions["hardware"] == "2 GPUs of 24 GB"
    assert Hardware.cpu_host(cores=8, ram_gb=None).gpu_memory_gb == 16.0  # no RAM figure: a default


def test_batch_length_is_each_batchs_longest_row_cut_at_max_length() -> None:
    lengths = [10, 20, 30, 40, 50, 60]
    assert batch_length(lengths, batch_size=1, max_length=1000, packing=False) == 35.0
    assert batch_length(lengths, batch_size=6, max_length=1000, packing=False) == 60.0
    assert batch_length(lengths, batch_size=6, max_length=25, packing=False) == 25.0
    two = batch_length(lengths, batch_size=2, max_length=1000, packing=False)
    assert 35.0 < two < 60.0
    assert batch_length(lengths, batch_size=2, max_length=1000, packing=False) == two  # one fixed shuffle
    assert batch_length(lengths, batch_size=2, max_length=64, packing=True) == 64.0


def test_a_workload_times_the_datas_lengths_and_plans_memory_at_max_length() -> None:
    config = TrainConfig.parse(
        {"data": {"train": "t.jsonl", "max_length": 1024}, "hyper": {"batch_size": 4, "epochs": 1}}
    )
    lengths = [100] * 40
    w = Workload.from_train_config(config, num_sequences=40, token_lengths=lengths, on_gpu=False)
    assert w.seq_len == 1024 and w.mean_seq_len == 100.0 and w.timed_seq_len == 100.0
    assert w.compute_dtype == "float32" and w.steps == 10
    blind = Workload.from_train_config(config, num_sequences=40, on_gpu=False)
    assert blind.mean_seq_len is None and blind.timed_seq_len == 1024
    box = Hardware.cpu_host(cores=2, ram_gb=24.0)
    short, long = plan_job(demo_config(), box, w), plan_job(demo_config(), box, blind)
    assert short.eta_s is not None and long.eta_s is not None and short.eta_s < long.eta_s / 8
    assert short.host_ram == long.host_ram  # memory: the worst case either way
    assert short.assumptions["tokens_per_sequence"] == 100.0 and short.assumptions["tokens_from_data"]
    # packing: sequences of max_length, as many as the tokens fill
    packed_config = config.model_copy(
        update={"data": config.data.model_copy(update={"packing": True, "max_length": 400})}
    )
    packed = Workload.from_train_config(packed_config, num_sequences=40, token_lengths=lengths)
    assert packed.timed_seq_len == 400 and packed.steps == 2  # 4,000 tokens: 10 sequences, 4 a step


def test_calibration_past_the_top_efficiency_raises_the_rate() -> None:
    box = Hardware.cpu_host(cores=2, ram_gb=24.0)
    faster = calibrate(box, predicted_tokens_per_s=100.0, measured_tokens_per_s=150.0)
    assert faster.efficiency == 1.0 and faster.gpu_tflops == pytest.approx(1.5 * box.gpu_tflops)
    slower = calibrate(box, predicted_tokens_per_s=100.0, measured_tokens_per_s=50.0)
    assert slower.efficiency == 0.5 and slower.gpu_tflops == box.gpu_tflops


def test_batch_length_of_pairs_pads_each_batch_to_its_longest_sequence() -> None:
    # three pairs: (chosen, rejected) one after the other
    lengths = [10, 50, 20, 20, 30, 5]
    assert batch_length(lengths, batch_size=3, max_length=1000, packing=False, per_example=2) == 50.0
    assert batch_length(lengths, batch_size=3, max_length=40, packing=False, per_example=2) == 40.0
    one = batch_length(lengths, batch_size=1, max_length=1000, packing=False, per_example=2)
    assert one == (50 + 50 + 20 + 20 + 30 + 30) / 6  # each pair padded to its longer sequence
