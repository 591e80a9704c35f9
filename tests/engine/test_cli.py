"""The engine's command line."""

from __future__ import annotations

from engine.cli import main


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
