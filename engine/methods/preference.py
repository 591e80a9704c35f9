"""What the preference methods (DPO, ORPO) share: their pairs, their steps and their validation.

A preference batch interleaves its pairs (row ``2i`` the chosen, ``2i + 1`` the rejected answer
of pair ``i``, after the same prompt). The engine keeps each pair in one micro-batch and scores
each row by its summed log-probability (``engine.parallel.pairs``); a method's objective (a
``PairScores``) turns a micro-batch's rows into its summed loss, and its statistics class turns a
batch's rows into the metrics it logs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.data.batches import collate_pairs
from engine.data.encode import EncodedPair
from engine.methods.base import MethodRun, load_split
from engine.parallel.pairs import PairScores, policy_logps
from engine.roundpipe import RoundPipe

if TYPE_CHECKING:
    from engine.parallel.board import Iteration


class PairStatistics(Protocol):
    """A preference method's numbers of a batch (means over its pairs): a frozen dataclass."""

    @property
    def loss(self) -> float: ...

    @property
    def pairs(self) -> int: ...

    def metrics(self) -> dict[str, float]: ...


class PreferenceObjective(PairScores):
    """A preference method's objective: its loss over pairs and the statistics of a batch."""

    def statistics(
        self, logps: torch.Tensor, reference: torch.Tensor | None, tokens: torch.Tensor
    ) -> PairStatistics:
        """The batch statistics from its rows' log-probabilities, reference log-probabilities
        (None without a reference) and label token counts (``[2P]`` each, pairs interleaved)."""
        raise NotImplementedError

    def iteration_statistics(self, iterations: Sequence[Iteration]) -> tuple[PairStatistics, float]:
        """The statistics of finished iterations under this objective, and their label tokens
        (on several boxes, of this box's share: its micro-batches of the objective's)."""
        logps = torch.cat([policy_logps(it) for it in iterations])
        tokens_of, refs = [], []
        for it in iterations:
            o, mine = it.objective, slice(it.first, it.first + len(it.microbatches))
            if isinstance(o, PairScores):
                tokens_of.extend(o.tokens[mine])
                refs.extend(o.reference[mine])
        tokens = torch.cat(tokens_of)
        stats = self.statistics(logps, torch.cat(refs) if refs else None, tokens)
        return stats, float(tokens.sum())

    def step_metrics(self, iterations: Sequence[Iteration]) -> dict[str, float]:
        """The method's metrics of a step, its pair count and the answers' tokens (``tokens/label``)."""
        stats, tokens = self.iteration_statistics(iterations)
        return {**stats.metrics(), f"{self.name}/pairs": float(stats.pairs), "tokens/label": tokens}


def batch_statistics(it: Iteration) -> Any:
    """The statistics of one finished preference iteration; ``loss`` is the fused stages' mean."""
    objective = it.objective
    if not isinstance(objective, PreferenceObjective):
        raise RuntimeError(f"iteration {it.serial} is not a preference method's iteration")
    stats, _ = objective.iteration_statistics([it])
    return dataclasses.replace(stats, loss=it.loss_sum() / it.total_tokens)  # type: ignore[type-var]


def check_beta(beta: float, *, name: str = "beta") -> None:
    """Raise ``ValueError`` unless ``beta`` is a finite number > 0."""
    if isinstance(beta, bool) or not (isinstance(beta, int | float) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"{name}={beta!r}: must be a finite number > 0")


class PreferenceRun(MethodRun):
    """A preference run's pairs, its steps and its validation, under its method's objective.

    Subclasses say how a batch's objective is built (``objective``) and may compute something
    before the first step (``prepare``: DPO's reference log-probabilities).
    """

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        # data.packing and hyper.router_aux_loss were refused with the config (PreferenceOptions.check)
        self.train: list[EncodedPair]
        self.validation: list[EncodedPair]
        self.train, self.validation = load_split(config, tokenizer, EncodedPair)
        self.beta = float(config.method.beta)
        self.lora = bool(config.method.lora)

    def objective(self, batch: dict[str, torch.Tensor], *, validation: bool = False) -> PreferenceObjective:
        """The objective of a collated batch of training pairs, or of validation pairs; its
        ``rows`` are the pairs' indices among them."""
        raise NotImplementedError

    def forward_backward(
        self, engine: RoundPipe, batch: dict[str, torch.Tensor]
    ) -> tuple[float, dict[str, float]]:
        it = engine.forward_backward_pairs(self.objective(batch), **sequences(batch))
        stats = batch_statistics(it)
        return stats.loss, stats.metrics()

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        """``loss/val`` and the validation pairs' accuracy and margin (None: no pairs)."""
        if not self.validation:
            return None
        sums: dict[str, float] = {}
        for i in range(0, len(self.validation), batch_size):
            chunk = self.validation[i : i + batch_size]
            batch = collate_pairs(chunk, pad_id, range(i, i + len(chunk)))
            it = engine.evaluate_pairs(self.objective(batch, validation=True), **sequences(batch))
            stats = batch_statistics(it)
            for key, value in {"loss": stats.loss, **stats.metrics()}.items():
                sums[key] = sums.get(key, 0.0) + value * stats.pairs
        n = len(self.validation)
        return {
            "loss/val": sums.pop("loss") / n,
            **self.validation_metrics({k: v / n for k, v in sums.items()}),
        }

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """The validation metrics it logs from the means of its step metrics over the pairs."""
        raise NotImplementedError


def sequences(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated batch's token tensors (``input_ids``, ``labels``, ``attention_mask``), without
    its ``rows``: the engine's pair calls take these."""
    return {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
