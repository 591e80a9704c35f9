"""An engine failure says where it happened: stage, stage kind, worker, iteration, and the run's step."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, EngineError, RoundPipe
from engine.kinds import StageKind
from engine.training.run import train
from tests.engine.methods.test_dpo_run import config, workspace  # noqa: F401  (a fixture)
from tests.engine.tiny import SPLIT_PLAN, tiny_batch, tiny_model


def failing_backward(monkeypatch: pytest.MonkeyPatch, block_type: type, layer_idx: int) -> None:
    """Make the decoder block ``layer_idx`` raise whenever it runs with gradients on (a backward
    stage's recompute, or the fused stage), on whichever worker's copy it runs."""
    forward = block_type.forward

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() and self.self_attn.layer_idx == layer_idx:
            raise RuntimeError("injected fault")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(block_type, "forward", broken)


def test_a_worker_failure_names_its_stage_worker_and_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    failing_backward(monkeypatch, type(model.model.layers[0]), 0)  # block 1: layer 1, in B3
    config_ = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", partition=SPLIT_PLAN)
    with RoundPipe(copy.deepcopy(model), config_) as rp, pytest.raises(EngineError) as err:
        rp.forward_backward(**tiny_batch())
    exc = err.value
    assert (exc.stage, exc.stage_kind, exc.worker, exc.iteration) == ("B3", StageKind.BACKWARD, "cpu", 0)
    assert exc.where() == "in backward stage B3 on cpu at iteration 0"
    assert "injected fault" in str(exc) and exc.fields()["stage"] == "B3"


def test_a_failed_run_says_at_which_step(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    calls = {"n": 0}
    forward = Qwen3DecoderLayer.forward

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() and self.self_attn.layer_idx == 0:
            calls["n"] += 1
            if calls["n"] > 2 * 2:  # the first two steps' two micro-batches pass
                raise RuntimeError("injected fault")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3DecoderLayer, "forward", broken)
    cfg = config(
        workspace,
        "failing",
        method={"kind": "lora"},
        data={"train": str(workspace / "chat.jsonl"), "validation_fraction": 0.0},
        eval={"every_steps": None},
        engine={"async_optimizer": False},
    )
    with pytest.raises(EngineError) as err:
        train(cfg)
    assert err.value.step == 3 and err.value.where().endswith("at step 3"), err.value.where()
