"""Supervised fine-tuning: next-token cross entropy on the answers' tokens.

Its objective is the engine's default (``engine.parallel.objective.TOKEN_LOSS``): the output
layer returns each micro-batch's token loss sum and the step's loss is the mean over every label
token of the batch. Its examples are chat, instruction, prompt/completion or text rows, packed
when ``data.packing`` is set.
"""

from __future__ import annotations

from typing import Any

from engine.data.batches import Pixels, collate, pack
from engine.data.encode import Encoded
from engine.methods.base import MethodRun, load_split
from engine.parallel.objective import Objective
from engine.roundpipe import RoundPipe


def load_examples(config: Any, tokenizer: Any) -> tuple[list[Encoded], list[Encoded]]:
    """The training and validation examples of a supervised run (packed when asked)."""
    data = config.data
    train, val = load_split(config, tokenizer, Encoded)
    if data.packing:
        train = pack(train, data.max_length)
    return train, val


def evaluate(
    engine: RoundPipe, examples: list[Encoded], batch_size: int, pad_id: int, pixels: Pixels | None = None
) -> dict[str, float]:
    """``loss/val``, the token-weighted mean validation loss, and ``accuracy/val``, the share of
    label tokens whose logits' argmax is the label (rows with images: ``pixels`` makes their
    tensors)."""
    total, tokens, correct = 0.0, 0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i : i + batch_size], pad_id, pixels)
        n = int((batch["labels"][:, 1:] != -100).sum())
        if n:
            mean, right, _ = engine.evaluate_counts(**batch)
            total += mean * n
            tokens += n
            correct += right
    return {"loss/val": total / max(tokens, 1), "accuracy/val": correct / max(tokens, 1)}


class SupervisedRun(MethodRun):
    """A supervised run's examples (training and held-out), its steps and its validation loss."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self.train, self.validation = load_examples(config, tokenizer)

    def forward_backward(self, engine: RoundPipe, batch: dict[str, Any]) -> tuple[float, dict[str, float]]:
        return engine.forward_backward(**batch), {}

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        if not self.validation:
            return None
        return evaluate(engine, self.validation, batch_size, pad_id, self.pixels)


RUN = SupervisedRun
OBJECTIVE = Objective  # the engine's default: the output layer's token loss sum
