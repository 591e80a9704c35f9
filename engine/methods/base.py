"""What the run loop asks of a training method (``engine.training.run``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.data.batches import Pixels, split_validation
from engine.data.encode import Row, load_rows
from engine.metrics import Sink
from engine.roundpipe import RoundPipe

if TYPE_CHECKING:
    from engine.distributed.group import Group


def load_split(config: Any, tokenizer: Any, kind: type[Row]) -> tuple[list[Row], list[Row]]:
    """A run's training and validation rows, encoded as ``kind`` (``load_rows``); without a
    validation file, ``data.validation_fraction`` of the training rows are held out by
    ``hyper.seed``.

    Raises:
        ConfigError: for ``data.train`` or ``data.validation``: rows of another kind (the
            method's name in the message), invalid rows by line, an unsupported file.
    """
    data, method = config.data, config.method.objective
    store = data.image_store  # where sha256: image references are read (the service's store)
    train = load_rows(
        data.train,
        tokenizer,
        kind,
        fmt=data.format,
        max_length=data.max_length,
        method=method,
        image_store=store,
    )
    if data.validation:
        validation = load_rows(
            data.validation,
            tokenizer,
            kind,
            fmt=data.format,
            max_length=data.max_length,
            field="data.validation",
            method=method,
            image_store=store,
        )
        return train, validation
    held: tuple[list[Row], list[Row]] = split_validation(train, data.validation_fraction, config.hyper.seed)
    return held


class MethodRun:
    """The method's side of one run: its examples, its steps and its validation.

    Args:
        config: the run's ``TrainConfig``.
        tokenizer: the model's tokenizer (a vision-language model's processor).

    Attributes:
        train: what the batcher draws from (encoded examples or pairs).
        steps_per_batch: the optimizer steps each batch trains (GRPO's ``num_iterations``): the
            batcher serves every batch that many times in a row.
        pixels: a vision-language model's row images to tensors
            (``engine.vision.pixels.row_pixels``), set by the run; None for a text model.
        group: the boxes of a job on several (``engine.distributed``), set by the run; None on
            one box. The engine shares each batch out by itself; a method that makes its rows
            during the step (GRPO's rollouts) makes only its box's share.
    """

    train: list[Any]
    steps_per_batch: int = 1
    pixels: Pixels | None = None
    group: Group | None = None

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

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of the method besides the engine and the batcher (a batch
        reused by the next steps); tensors and plain values. Nothing here."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave (called after ``prepare``, when a run resumes)."""

    def close(self) -> None:
        """Stop what the method started (a grader's process); none here."""
