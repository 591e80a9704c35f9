"""What the run loop asks of a training method (``engine.training.run``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.metrics import Sink
from engine.roundpipe import RoundPipe


class MethodRun:
    """The method's side of one run: its examples, its steps and its validation.

    Args:
        config: the run's ``TrainConfig``.
        tokenizer: the model's tokenizer.

    Attributes:
        train: what the batcher draws from (encoded examples or pairs).
    """

    train: list[Any]

    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def prepare(
        self,
        engine: RoundPipe,
        folder: Path,
        *,
        base: str,
        compute_dtype: str,
        batch_size: int,
        pad_id: int,
        sink: Sink,
    ) -> None:
        """Work before the first step, on the initial weights (a reference pass); none here."""

    def forward_backward(
        self, engine: RoundPipe, batch: dict[str, torch.Tensor]
    ) -> tuple[float, dict[str, float]]:
        """Forward and backward of one training batch: its loss and the method's own metrics."""
        raise NotImplementedError

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        """``loss/val`` and the method's validation metrics (None: nothing to validate on)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what the method started (a grader's process); none here."""
