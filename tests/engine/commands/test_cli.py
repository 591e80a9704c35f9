"""The engine's command line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from engine.commands.cli import layer_bytes, main
from engine.config import TrainConfig
from engine.model.adapter import AdaptedModel
from engine.planner import Hardware, Shape, Workload, plan_job
from tests.engine.tiny import FAMILIES, tiny_model, tiny_model_folder
from tests.utils import ROOT, child_env

QWEN3_32B = {  # its config.json's sizes
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


def test_plan_of_a_model_folder_reads_its_shapes_without_torch(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    argv = ["plan", "--model", str(tmp_path), "--method", "full", "--workers", "8", "--host-ram-gb", "512"]
    code = (
        "import sys\n"
        "from engine.commands.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Qwen3ForCausalLM: 66 layers (input, 64 blocks, output)" in out.stdout
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_bytes_a_plan_partitions_are_the_engine_s(family: str, tied: bool) -> None:
    model = tiny_model(family, tied=tied)
    layers = AdaptedModel(model).layers
    engine = [float(sum(p.numel() * 2 for p in layer.module.parameters())) for layer in layers]
    config = model.config.to_dict() | {"architectures": [type(model).__name__]}
    assert layer_bytes(Shape.from_config(config)) == engine
    # what the engine's layers hold besides: a buffer of a few elements (left out)
    buffers = [sum(b.numel() for b in layer.module.buffers()) for layer in layers]
    assert max(buffers) <= 4


def test_plan_refuses_a_folder_without_a_config_or_of_an_unsupported_model(tmp_path, capsys) -> None:
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundhouse plan: model.path: ") and "(no config.json)" in err
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B | {"architectures": ["FooForCausalLM"]}))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundhouse plan: model.path: unsupported architecture FooForCausalLM")
