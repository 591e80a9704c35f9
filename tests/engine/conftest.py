"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny import tiny_batch


@pytest.fixture
def batches() -> list[dict[str, torch.Tensor]]:
    # 11 sequences: no micro-batch count used in the tests divides it evenly
    return [tiny_batch(batch=11, seed=s) for s in (1, 2, 3)]
