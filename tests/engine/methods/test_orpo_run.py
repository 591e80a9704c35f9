"""ORPO runs: metrics, no reference pass, resume identity, the CLI flag and its data check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.commands.cli import main
from engine.errors import ConfigError
from engine.methods.dpo.train import REFERENCE_FILE
from engine.metrics import ListSink
from engine.training.checkpoint import load_state
from engine.training.run import train
from tests.engine.methods.test_dpo_run import config, workspace  # noqa: F401  (a fixture)

ORPO_METRICS = ("orpo/nll", "orpo/odds_ratio_loss", "orpo/log_odds_ratio", "orpo/reward_accuracy")


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_an_orpo_run_logs_its_metrics_and_resumes_bitwise(workspace: Path, tuning: str) -> None:  # noqa: F811
    method = {"kind": "orpo", "objective": "orpo", "tuning": tuning}  # both forms, consistent
    sink = ListSink()
    straight = train(config(workspace, f"orpo-straight-{tuning}", method=method), sink)
    assert straight.status == "succeeded" and straight.step == 4
    for key in ("loss/train", *ORPO_METRICS, "orpo/pairs"):
        assert len(sink.series(key)) == 4, key
    assert sink.series("orpo/pairs") == [4.0] * 4
    assert len(sink.series("loss/val")) == 2 and len(sink.series("orpo/val_reward_accuracy")) == 2
    # the loss is the chosen NLL plus beta times the odds-ratio loss, as logged
    for loss, nll, orl in zip(
        sink.series("loss/train"), sink.series("orpo/nll"), sink.series("orpo/odds_ratio_loss"), strict=True
    ):
        assert loss == pytest.approx(nll + 0.5 * orl, rel=1e-5)
    assert not [e for e in sink.events if e[0] == "reference"]  # reference-free
    assert not (workspace / f"orpo-straight-{tuning}" / REFERENCE_FILE).exists()

    first = train(config(workspace, f"orpo-resumed-{tuning}", method=method, hyper={"max_steps": 2}))
    assert first.step == 2
    resumed = train(config(workspace, f"orpo-resumed-{tuning}", method=method))
    a, b = load_state(straight.checkpoint)[0]["masters"], load_state(resumed.checkpoint)[0]["masters"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all("lora_" in k for k in a) == (tuning == "lora")


def test_orpo_trains_only_on_preference_rows(workspace: Path) -> None:  # noqa: F811
    with pytest.raises(ConfigError) as err:
        train(
            config(
                workspace, "orpo-chat", method={"kind": "orpo"}, data={"train": str(workspace / "chat.jsonl")}
            )
        )
    assert err.value.field == "data.train" and "method.kind 'orpo' trains on preference rows" in str(
        err.value
    )


def test_cli_train_takes_method_orpo(workspace: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = config(workspace, str(tmp_path / "cli"), hyper={"max_steps": 1}, eval={"every_steps": None})
    path = tmp_path / "run.json"
    raw = cfg.model_dump()
    raw["method"] = {"kind": "lora", "lora_r": 4, "lora_alpha": 8}  # a supervised config, overridden
    path.write_text(__import__("json").dumps(raw))
    assert main(["train", str(path), "--method", "orpo", "--beta", "0.2"]) == 0
    state = load_state(tmp_path / "cli" / "checkpoints" / "step_000001")[1]
    assert state["config"]["method"]["objective"] == "orpo" and state["config"]["method"]["beta"] == 0.2
