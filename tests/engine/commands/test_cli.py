"""The engine's command line."""

from __future__ import annotations

import json
from dataclasses import replace

from engine.commands.cli import main
from engine.config import TrainConfig
from engine.planner import Hardware, Workload, plan_job
from tests.engine.tiny import tiny_model_folder


def test_plan_prints_partition_and_grid(capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--blocks",
                "4",
                "--hidden",
                "128",
                "--vocab",
                "1000",
                "--workers",
                "2",
                "--microbatches",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "LlamaForCausalLM: 6 layers (input, 4 blocks, output)" in out
    assert "plan: " in out and "B1[" in out
    assert "step  w0" in out and "F1.m0" in out
    assert "fits: yes" in out and "tokens/s" in out and "host RAM:" in out
    assert "longest sequence that fits: " in out and "(limited by " in out


def test_plan_rejects_an_impossible_budget(capsys) -> None:
    assert main(["plan", "--blocks", "2", "--hidden", "256", "--memory-budget-gb", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundhouse plan: ") and "memory_budget" in err


def test_synthetic_run_trains_and_the_loss_falls(capsys) -> None:
    assert main(["synthetic", "--workers", "2", "--steps", "12"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss/train=")[1].split()[0]) for line in lines]
    assert len(losses) == 12
    assert losses[-1] < losses[0]


def test_plan_reads_a_train_config_and_plans_it_like_the_service(tmp_path, capsys) -> None:
    folder = tiny_model_folder(tmp_path / "tiny")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(40)))
    raw = {
        "model": {"path": "tiny"},
        "data": {"train": "train.jsonl", "max_length": 64},
        "hyper": {"epochs": 2, "batch_size": 8},
        "engine": {"num_microbatches": 2, "compute_dtype": "auto"},
    }
    (tmp_path / "run.json").write_text(json.dumps(raw))
    argv = ["plan", "--config", str(tmp_path / "run.json"), "--host-ram-gb", "64", "--workers", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    config = TrainConfig.load(tmp_path / "run.json")
    workload = Workload.from_train_config(config, num_sequences=40)
    assert workload.steps == 10  # 2 epochs of 40 rows // 8
    model_config = json.loads((folder / "config.json").read_text())
    report = plan_job(model_config, Hardware(num_gpus=2, host_ram_gb=64.0), workload)
    assert report.describe() in out and "ETA:" in out
    assert "F1.m1" in out and "F1.m2" not in out  # the config's 2 micro-batches drive the grid
    # flags override the file
    assert main([*argv, "--seq-len", "32", "--steps", "5"]) == 0
    short = plan_job(
        model_config, Hardware(num_gpus=2, host_ram_gb=64.0), replace(workload, seq_len=32, steps=5)
    )
    assert short.describe() in capsys.readouterr().out


def test_the_progress_line_shows_no_nan_before_the_first_loss() -> None:
    import io

    from engine.commands.common import ProgressSink

    out = io.StringIO()
    sink = ProgressSink(out)
    sink.log({"progress/step": 1.0, "progress/total_steps": 2.0}, 1)
    sink.log({"loss/train": 0.5}, 1)
    sink.log({"progress/step": 2.0, "progress/total_steps": 2.0}, 2)
    first, second = out.getvalue().splitlines()
    assert "loss - " in first and "nan" not in first
    assert "loss 0.5000" in second
