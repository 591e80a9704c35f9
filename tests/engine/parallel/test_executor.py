"""Workers see the engine only through their ``WorkerContext``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.adapter import AdaptedModel
from engine.parallel.board import Board
from engine.parallel.executor import Worker, WorkerContext
from engine.parallel.host import HostState
from tests.engine.tiny import tiny_model


def test_a_worker_needs_only_its_context() -> None:
    adapted = AdaptedModel(tiny_model("llama"))
    host = HostState(adapted, compute_dtype=torch.float32, pin=False, double_buffer=False)
    context = WorkerContext(
        model=adapted,
        host=host,
        board=Board(host.num_layers),
        cancel=None,
        dropout=False,
        fp32_accumulate=False,
    )
    worker = Worker(0, torch.device("cpu"), context)
    try:
        assert worker.host is host and worker.board is context.board
        assert len(worker.modules) == adapted.num_layers
        # the stage copies take no memory until a stage's weights arrive
        assert all(p.is_meta for m in worker.modules for p in m.parameters())
    finally:
        worker.stop()
    assert not worker.thread.is_alive()
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.cancel = None  # type: ignore[misc]
