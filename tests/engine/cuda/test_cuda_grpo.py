"""GRPO's full fine-tune reference on CUDA workers: the frozen copy of the initial weights pinned,
uploaded like the weights, and equal to the plain loop. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from tests.engine.cuda.test_cuda_equivalence import CUDA_SGD_TOL, devices
from tests.engine.methods.test_grpo import LR, engine_grpo_loop, plain_grpo_loop, rollout_batch
from tests.engine.tiny import SPLIT_PLAN, max_diff, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_full_fine_tune_kl_with_iterations_equals_the_plain_loop() -> None:
    model = tiny_model("llama")
    batches = [rollout_batch(seed=s) for s in (1, 2, 3)]
    kw = {"beta": 0.1, "loss_type": "grpo", "iterations": 2}
    ref_losses, ref_state = plain_grpo_loop(model, batches, [None] * 3, **kw)
    config = EngineConfig(
        devices=devices(2), num_microbatches=3, optimizer="sgd", lr=LR, partition=SPLIT_PLAN, tf32=False
    )
    losses, state, metrics = engine_grpo_loop(model, batches, [None] * 3, config, **kw)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < CUDA_SGD_TOL
    assert max_diff(state, ref_state) < CUDA_SGD_TOL
    assert max(x["grpo/clip_fraction"] for x in metrics) > 0 and max(x["grpo/kl"] for x in metrics) > 0


def test_cuda_bf16_initial_weights_are_pinned_and_stay_put() -> None:
    model = tiny_model("qwen3")
    batch = rollout_batch(seed=4)
    config = EngineConfig(devices=devices(2), num_microbatches=3, lr=0.05, compute_dtype="bfloat16")
    with RoundPipe(copy.deepcopy(model), config) as rp:
        size = rp.keep_initial_weights()
        assert size == sum(p.numel() * 2 for p in model.parameters())  # bf16
        assert all(t.is_pinned() for t in rp.host.initial.values())
        before = rp.token_logps(**batch, initial=True)
        for _ in range(3):
            rp.forward_backward(**batch)
            rp.step()
        assert torch.equal(rp.token_logps(**batch, initial=True), before)
        assert not torch.equal(rp.token_logps(**batch), before)
