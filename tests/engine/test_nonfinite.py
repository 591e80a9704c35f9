"""The engine never applies a non-finite update: a step whose loss or gradient norm is not finite
is skipped with no weight, optimizer moment or optimizer step count changed (bitwise), an event
names the step and what was not finite, and the run fails with a clear error after
``max_nonfinite_steps`` such steps in a row. Skipping a step is the same as never having seen its
batch."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, TrainConfig
from engine.errors import EngineError
from engine.kinds import EngineEvent
from engine.metrics import ListSink
from engine.roundpipe import RoundPipe
from engine.training.checkpoint import load_state
from engine.training.checkpoint_layout import list_checkpoints
from engine.training.run import train
from tests.engine.tiny import VOCAB, tiny_batch, tiny_model, tiny_model_folder

POISON = 5  # the token whose embedding is NaN: a batch with it has a NaN loss and gradients


def clean(seed: int) -> dict[str, torch.Tensor]:
    batch = tiny_batch(seed=seed)
    ids = batch["input_ids"]
    ids[ids == POISON] = POISON + 1
    return batch


def poisoned(seed: int) -> dict[str, torch.Tensor]:
    batch = clean(seed)
    batch["input_ids"][1, 5] = POISON
    return batch


def model_with_a_nan_token() -> Any:
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[POISON] = float("nan")
    return model


def bits(state: Any) -> Any:
    """A state's tensors as raw bits (NaN equals NaN), everything else as it is."""
    if isinstance(state, torch.Tensor):
        t = state.detach().reshape(-1).contiguous()
        return t.view(torch.uint8).clone() if t.numel() else t.clone()
    if isinstance(state, dict):
        return {k: bits(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [bits(v) for v in state]
    return state


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(b, torch.Tensor | dict | list | tuple):
        return False
    return bool(a == b)


def snapshot(rp: RoundPipe) -> tuple[Any, Any]:
    rp.synchronize()
    return bits(rp.master_state_dict()), bits(rp.optimizer.state_dict())


def config(dtype: str, **extra: Any) -> EngineConfig:
    return EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=2, optimizer="adamw", lr=1e-2, compute_dtype=dtype, **extra
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_nonfinite_step_changes_nothing_and_equals_never_seeing_it(dtype: str) -> None:
    model = model_with_a_nan_token()
    sink = ListSink()
    with RoundPipe(copy.deepcopy(model), config(dtype, initial_loss_scale=1.0), sink=sink) as rp:
        rp.forward_backward(**clean(1))
        rp.step()
        before = snapshot(rp)
        loss = rp.forward_backward(**poisoned(2))
        rp.step()
        after = snapshot(rp)
        rp.forward_backward(**clean(3))
        rp.step()
        ended = snapshot(rp)
    assert loss != loss  # the poisoned batch's loss is NaN ...
    assert same_bits(before, after)  # ... and its step changed no weight, moment or step count
    assert sink.series("optim/skipped") == [0.0, 1.0, 0.0]
    skipped = [(message, data) for kind, message, data in sink.events if kind == EngineEvent.SKIPPED]
    assert len(skipped) == 1
    message, data = skipped[0]
    assert data["step"] == 2 and "loss" in data["what"] and data["in_a_row"] == 1
    assert message.startswith("step 2 skipped: its loss") and "not finite" in message
    # the same as a run that never saw the poisoned batch
    with RoundPipe(copy.deepcopy(model), config(dtype, initial_loss_scale=1.0)) as plain:
        plain.forward_backward(**clean(1))
        plain.step()
        plain.forward_backward(**clean(3))
        plain.step()
        assert same_bits(ended[0], snapshot(plain)[0])
        assert same_bits(ended[1], snapshot(plain)[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nonfinite_steps_in_a_row_fail_the_run_with_a_clear_error(dtype: str) -> None:
    sink = ListSink()
    rp = RoundPipe(model_with_a_nan_token(), config(dtype, max_nonfinite_steps=3), sink=sink)
    try:
        rp.forward_backward(**clean(1))
        rp.step()
        with pytest.raises(EngineError, match=r"3 steps in a row \(the last: step 4\) had a non-finite loss"):
            for seed in range(2, 8):
                rp.forward_backward(**poisoned(seed))
                rp.step()
            rp.synchronize()
    finally:
        with contextlib.suppress(EngineError):
            rp.close()
    assert [d["in_a_row"] for k, _, d in sink.events if k == EngineEvent.SKIPPED] == [1, 2, 3]
    assert sink.series("optim/skipped") == [0.0, 1.0, 1.0, 1.0]


def test_a_good_step_resets_the_count() -> None:
    sink = ListSink()
    with RoundPipe(model_with_a_nan_token(), config("float32", max_nonfinite_steps=2), sink=sink) as rp:
        for batch in (poisoned(1), clean(2), poisoned(3), clean(4), poisoned(5)):
            rp.forward_backward(**batch)
            rp.step()
        rp.synchronize()
    assert [d["in_a_row"] for k, _, d in sink.events if k == EngineEvent.SKIPPED] == [1, 1, 1]
    assert sink.series("optim/skipped") == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_the_setting_is_checked() -> None:
    with pytest.raises(Exception, match="max_nonfinite_steps"):
        EngineConfig(max_nonfinite_steps=0)
    assert VOCAB > POISON + 1


def test_a_run_on_a_broken_model_fails_clearly_and_keeps_finite_checkpoints(tmp_path: Path) -> None:
    """A whole run (LoRA on a base whose final norm is NaN): every step is skipped, each with an
    event; the run fails at the third in a row naming the steps; what it saved is finite."""
    folder = tiny_model_folder(tmp_path / "model", "qwen3")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    rows = [{"text": f"line {i} of a small corpus"} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = TrainConfig.parse(
        {
            "model": {"path": str(folder), "name": "broken"},
            "data": {"train": str(tmp_path / "train.jsonl"), "max_length": 32},
            "method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8},
            "hyper": {"max_steps": 8, "batch_size": 4, "max_nonfinite_steps": 3},
            "engine": {"devices": ["cpu"], "num_microbatches": 2},
            "checkpoint": {"every_steps": 2},
            "output_dir": str(tmp_path / "run"),
        }
    )
    sink = ListSink()
    with pytest.raises(EngineError, match="3 steps in a row") as caught:
        train(config, sink=sink, models_dir=tmp_path)
    assert caught.value.step is not None and caught.value.step <= 4
    assert [d["step"] for k, _, d in sink.events if k == EngineEvent.SKIPPED] == [1, 2, 3]
    for _, checkpoint in list_checkpoints(tmp_path / "run" / "checkpoints"):
        masters = load_state(checkpoint)[0]["masters"]
        assert all(torch.isfinite(t).all() for t in masters.values())
