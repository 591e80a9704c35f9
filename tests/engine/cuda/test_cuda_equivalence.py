"""The equivalence tests on CUDA workers: streams, pinned memory, events. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from tests.engine.tiny import (
    FAMILIES,
    SPLIT_PLAN,
    bitwise_equal,
    engine_loop,
    max_diff,
    plain_loop,
    tiny_batch,
    tiny_model,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# GPU kernels (TF32 off by default for fp32 matmul in PyTorch, but different reduction orders)
CUDA_SGD_TOL = 1e-4


def devices(n: int) -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" for i in range(n)]


@pytest.fixture
def batches() -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(batch=11, seed=s) for s in (1, 2, 3)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_cuda_sync_sgd_equals_plain_loop(family: str, workers: int, batches) -> None:
    model = tiny_model(family)
    ref_losses, ref_state = plain_loop(model, batches, lambda p: torch.optim.SGD(p, lr=0.1))
    config = EngineConfig(
        devices=devices(workers),
        num_microbatches=workers + 1,
        optimizer="sgd",
        lr=0.1,
        partition=SPLIT_PLAN,
        tf32=False,  # exact fp32, like the CPU reference
    )
    losses, state, _ = engine_loop(model, batches, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < CUDA_SGD_TOL
    assert max_diff(state, ref_state) < CUDA_SGD_TOL


def test_cuda_same_bits_for_any_worker_count(batches) -> None:
    model = tiny_model("llama")
    states = []
    for workers in (1, 2, 3):
        config = EngineConfig(
            devices=devices(workers),
            num_microbatches=5,
            optimizer="sgd",
            lr=0.1,
            partition=SPLIT_PLAN,
            tf32=False,
        )
        states.append(engine_loop(model, batches, config)[1])
    assert all(bitwise_equal(s, states[0]) for s in states[1:])


def test_cuda_async_and_bf16_run(batches) -> None:
    model = tiny_model("qwen3")
    config = EngineConfig(
        devices=devices(2), num_microbatches=4, async_optimizer=True, compute_dtype="bfloat16"
    )
    losses, state, _ = engine_loop(model, batches, config)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert losses[-1] < losses[0] + 1.0
