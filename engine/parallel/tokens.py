"""Iterations that score every label token: per-token log-probabilities into a method's loss.

A reinforcement method (GRPO, ``engine.methods.grpo``) weighs each completion token by its own
advantage, ratio and KL term, so the output layer of its iterations returns the
log-probability of every label token (``Objective.per_token``: ``[rows, seq - 1]``, 0 where the
label is -100) and the iteration's objective (a ``TokenScores``) turns a micro-batch's into its
loss sum. Rows are independent: a batch is cut anywhere, like a supervised one.

``TokenLogps`` only measures them (``RoundPipe.token_logps``): its report is the micro-batch's
log-probabilities, read back in batch order by ``reported_token_logps``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.parallel.objective import Objective, Upload

if TYPE_CHECKING:
    from engine.parallel.board import Iteration, MicroBatch


class TokenScores(Objective):
    """A per-token objective: the output layer returns each label token's log-probability.

    ``bind`` gives it the iteration's micro-batches once the batch is cut, so a subclass can cut
    its own per-row inputs (advantages, a reference's log-probabilities) the same way.

    Attributes:
        name: the method's name, for error messages.
        rows: per micro-batch, its first row's index in the batch.
    """

    per_token = True
    name = "tokens"
    stats_size = 0  # the statistics ``token_loss`` reports per micro-batch

    def __init__(self, *, adapters: bool = True, initial: bool = False) -> None:
        self.adapters = adapters
        self.initial = initial
        self.rows: list[int] = []

    def bind(self, microbatches: list[MicroBatch], *, pin: bool) -> None:
        """Note where each micro-batch starts in the batch (``pin``: GPU workers upload what a
        subclass keeps per micro-batch asynchronously, from pinned memory)."""
        starts, row = [], 0
        for mb in microbatches:
            starts.append(row)
            row += int(mb.input_ids.shape[0])
        self.rows = starts

    def token_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss sum of micro-batch ``mb`` from its ``[rows, seq - 1]`` log-probabilities, and
        the 1-D statistics the objective reads back for it (after the loss sum)."""
        raise NotImplementedError

    def report_size(self, batch: MicroBatch) -> int:
        """How many statistics a micro-batch reports after its loss sum."""
        return self.stats_size

    def fused_loss(
        self, mb: int, output: torch.Tensor, upload: Upload
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss, stats = self.token_loss(mb, output, upload)
        return loss, torch.cat([loss.detach().reshape(1).float(), stats.detach().reshape(-1).float()])


class TokenLogps(TokenScores):
    """Measure each label token's log-probability (no loss): the report is the micro-batch's
    ``[rows * (seq - 1)]`` values after a zero loss sum."""

    def report_size(self, batch: MicroBatch) -> int:
        return int(batch.input_ids.shape[0]) * (int(batch.input_ids.shape[1]) - 1)

    def token_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> tuple[torch.Tensor, torch.Tensor]:
        return logps.sum() * 0.0, logps


def reported(it: Iteration, mb: int) -> torch.Tensor:
    """What micro-batch ``mb`` of a finished per-token iteration reported after its loss sum
    (waiting for its copy), as fp32 on the CPU."""
    host, j, event = it.loss_sums[mb]
    if event is not None:
        event.synchronize()
    objective = it.objective
    if not isinstance(objective, TokenScores):
        raise RuntimeError(f"iteration {it.serial} does not score tokens")
    n = objective.report_size(it.microbatches[mb])
    return host[j + 1 : j + 1 + n].float().clone()


def reported_token_logps(it: Iteration) -> torch.Tensor:
    """``[rows, seq - 1]`` every label token's log-probability of a finished ``TokenLogps``
    iteration, in batch order."""
    parts = []
    for mb, batch in enumerate(it.microbatches):
        rows, width = int(batch.input_ids.shape[0]), int(batch.input_ids.shape[1])
        parts.append(reported(it, mb).view(rows, width - 1))
    return torch.cat(parts)
