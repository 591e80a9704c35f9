"""ORPO: odds-ratio preference optimization (Hong et al., 2024), reference-free.

It trains on the same preference pairs as DPO (row ``2i`` the chosen, ``2i + 1`` the rejected
answer of pair ``i``) but needs no reference model and no reference pass: the supervised loss on
the chosen answer is joined by a penalty on the odds of the rejected one.

With ``logp(y)`` the mean log-probability of an answer's tokens (its summed log-probability over
its label token count) and ``odds(y) = p / (1 - p)`` for ``p = exp(logp(y))``, the loss of a pair
is ``-logp(chosen) + beta * -logsigmoid(log odds(chosen) - log odds(rejected))``, where
``log odds(y) = logp(y) - log(1 - exp(logp(y)))``; ``beta`` is the paper's lambda. The loss of a
batch is the mean over its pairs: a micro-batch contributes the sum of its pairs' losses divided
by the batch's pair count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.methods.preference import PreferenceObjective, PreferenceRun, batch_statistics, check_beta
from engine.parallel.objective import Upload
from engine.roundpipe import RoundPipe


def mean_logps(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[rows]`` each row's mean token log-probability from its sum and its label token count."""
    return logps.float() / tokens.float().to(logps.device)


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``p = exp(mean_logp)`` (``mean_logp`` < 0)."""
    return mean_logp - torch.log1p(-torch.exp(mean_logp))


def orpo_terms(
    logps: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-pair pieces of the ORPO loss.

    Args:
        logps: ``[2P]`` the policy's summed log-probability of each row, pairs interleaved.
        tokens: ``[2P]`` each row's label token count.

    Returns:
        ``([P] chosen NLL, [P] odds-ratio loss, [P] log odds ratio, [2P] mean log-probabilities)``
        in fp32, differentiable in ``logps``.

    Raises:
        ValueError: the two differ in shape, or hold an odd number of rows.
    """
    if logps.shape != tokens.shape or logps.dim() != 1 or logps.shape[0] % 2:
        raise ValueError(
            f"log-probabilities {tuple(logps.shape)} and token counts {tuple(tokens.shape)} must both be "
            "[2 * pairs]"
        )
    mean = mean_logps(logps, tokens)
    odds = log_odds(mean)
    ratio = odds[0::2] - odds[1::2]
    return -mean[0::2], -nn.functional.logsigmoid(ratio), ratio, mean


def orpo_losses(logps: torch.Tensor, tokens: torch.Tensor, beta: float) -> torch.Tensor:
    """The ORPO loss of each pair: the chosen answer's mean NLL plus ``beta`` times the
    odds-ratio loss (``[P]`` fp32, differentiable in ``logps``)."""
    nll, odds_ratio_loss, _, _ = orpo_terms(logps, tokens)
    return nll + beta * odds_ratio_loss


@dataclass(frozen=True)
class OrpoStats:
    """The ORPO numbers of a batch (means over its pairs).

    Attributes:
        loss: the mean ORPO loss.
        nll: the mean of the chosen answers' mean token negative log-likelihood.
        odds_ratio_loss: the mean of ``-logsigmoid(log odds ratio)``.
        log_odds_ratio: the mean log odds ratio of the chosen over the rejected answer.
        reward_accuracy: the share of pairs whose chosen answer has the higher odds.
        chosen_logp: the chosen answers' mean token log-probability.
        rejected_logp: the rejected answers'.
        pairs: the number of pairs.
    """

    loss: float
    nll: float
    odds_ratio_loss: float
    log_odds_ratio: float
    reward_accuracy: float
    chosen_logp: float
    rejected_logp: float
    pairs: int

    @classmethod
    def of(cls, logps: torch.Tensor, tokens: torch.Tensor, beta: float) -> OrpoStats:
        """The statistics of a batch from its rows' summed log-probabilities and token counts."""
        with torch.no_grad():
            nll, orl, ratio, mean = orpo_terms(logps.detach(), tokens)
            return cls(
                loss=float((nll + beta * orl).mean()),
                nll=float(nll.mean()),
                odds_ratio_loss=float(orl.mean()),
                log_odds_ratio=float(ratio.mean()),
                reward_accuracy=float((ratio > 0).float().mean()),
                chosen_logp=float(mean[0::2].mean()),
                rejected_logp=float(mean[1::2].mean()),
                pairs=int(nll.shape[0]),
            )

    def metrics(self, prefix: str = "orpo") -> dict[str, float]:
        """The statistics as sink metrics (``orpo/nll`` ...), without the loss."""
        return {
            f"{prefix}/nll": self.nll,
            f"{prefix}/odds_ratio_loss": self.odds_ratio_loss,
            f"{prefix}/log_odds_ratio": self.log_odds_ratio,
            f"{prefix}/reward_accuracy": self.reward_accuracy,
            f"{prefix}/chosen_logp": self.chosen_logp,
            f"{prefix}/rejected_logp": self.rejected_logp,
        }


class OrpoObjective(PreferenceObjective):
    """The fused stage's ORPO loss: the summed ORPO loss of a micro-batch's pairs.

    Args:
        beta: the weight of the odds-ratio loss (the paper's lambda, > 0).
    """

    name = "orpo"

    def __init__(self, beta: float) -> None:
        super().__init__()
        self.beta = beta

    def sequence_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> torch.Tensor:
        return orpo_losses(logps, upload(self.tokens[mb]), self.beta).sum()

    def statistics(
        self, logps: torch.Tensor, reference: torch.Tensor | None, tokens: torch.Tensor
    ) -> OrpoStats:
        return OrpoStats.of(logps, tokens, self.beta)


def forward_backward(
    engine: RoundPipe,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    beta: float,
) -> OrpoStats:
    """Forward and backward of a preference batch under the ORPO loss; gradients accumulate
    until ``engine.step()``. Each pair stays in one micro-batch.

    Args:
        input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
            pair ``i``, after the same prompt.
        labels: ``[2P, seq]``, -100 except on the answers' tokens.
        attention_mask: ``[2P, seq]`` 1 for real tokens, 0 for padding.
        beta: the weight of the odds-ratio loss (> 0).

    Returns:
        The batch's statistics; ``loss`` is the mean ORPO loss over its pairs, whose gradient
        this accumulates.

    Raises:
        ValueError: bad shapes, an odd number of rows or fewer pairs than micro-batches, a row
            without label tokens, ``beta`` <= 0, or the MoE router loss on.
        EngineError: a worker failed.
        Cancelled: the cancel flag was set.
    """
    check_beta(beta)
    it = engine.forward_backward_pairs(
        OrpoObjective(beta), input_ids=input_ids, labels=labels, attention_mask=attention_mask
    )
    stats: OrpoStats = batch_statistics(it)
    return stats


def evaluate(
    engine: RoundPipe,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    beta: float,
) -> OrpoStats:
    """The ORPO statistics of a preference batch without training (arguments, result and
    errors as ``forward_backward``'s; fewer pairs than micro-batches is fine)."""
    check_beta(beta)
    it = engine.evaluate_pairs(
        OrpoObjective(beta), input_ids=input_ids, labels=labels, attention_mask=attention_mask
    )
    stats: OrpoStats = batch_statistics(it)
    return stats


class OrpoRun(PreferenceRun):
    """The pairs of an ORPO run: no reference pass, nothing to prepare."""

    def objective(self, batch: dict[str, torch.Tensor], *, validation: bool = False) -> OrpoObjective:
        return OrpoObjective(self.beta)

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {
            "orpo/val_reward_accuracy": means["orpo/reward_accuracy"],
            "orpo/val_log_odds_ratio": means["orpo/log_odds_ratio"],
            "orpo/val_nll": means["orpo/nll"],
        }


RUN = OrpoRun
OBJECTIVE = OrpoObjective
