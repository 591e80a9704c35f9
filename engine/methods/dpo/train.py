"""DPO: direct preference optimization (Rafailov et al., 2023; the sigmoid loss).

A preference batch interleaves its pairs: row ``2i`` is the chosen (preferred) completion of
pair ``i`` and row ``2i + 1`` the rejected one, both after the same prompt, their labels -100
except on the completion tokens. A sequence's log-probability is the sum, over its label
tokens, of the log-probability the model gives each token; the reference's log-probabilities
are those of the model before training (a LoRA base with its adapter off, or the initial
weights), computed once.

With ``pi`` the policy's and ``ref`` the reference's log-probabilities, the implicit reward of
a completion is ``beta * (pi - ref)`` and the loss of a pair is
``-logsigmoid(reward_chosen - reward_rejected)``. The loss of a batch is the mean over its
pairs, so a micro-batch contributes the sum of its pairs' losses divided by the pair count of
the whole batch, as the supervised loss divides the micro-batch's token sum by the batch's
label tokens.

The reference log-probabilities of every training and validation pair are computed once, before
the first step and before a resume loads its weights, through the engine with the LoRA adapters
off (the base model) for a LoRA run, or on the initial weights for a full fine-tune. They are
stored in the run folder (``dpo_reference.pt``, written atomically by
``engine.methods.reference_file``), so a resumed or redelivered run reads them instead of
computing them again; the file carries a fingerprint of the pairs' tokens, the base model and
the compute dtype, and is recomputed when any of them changed. A batch's pairs find their
reference values by their indices among the run's pairs (the ``rows`` the batcher serves),
whatever order it drew them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.methods.preference import PreferenceObjective, PreferenceRun, batch_statistics, check_beta
from engine.methods.reference_file import by_rows, fingerprint, stored_or_computed
from engine.metrics import Sink
from engine.parallel.objective import Upload
from engine.roundpipe import RoundPipe

REFERENCE_FILE = "dpo_reference.pt"


def pair_rewards(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit rewards ``beta * (pi - ref)`` of the chosen and the rejected rows.

    Args:
        policy: ``[2P]`` the policy's per-row log-probabilities, pairs interleaved.
        reference: ``[2P]`` the reference's, same order.
        beta: the DPO temperature.

    Returns:
        ``([P] chosen rewards, [P] rejected rewards)`` in fp32.

    Raises:
        ValueError: the two differ in shape, or hold an odd number of rows.
    """
    if policy.shape != reference.shape or policy.dim() != 1 or policy.shape[0] % 2:
        raise ValueError(
            f"policy log-probabilities {tuple(policy.shape)} and reference {tuple(reference.shape)} must "
            "both be [2 * pairs]"
        )
    logratio = policy.float() - reference.float().to(policy.device)
    return beta * logratio[0::2], beta * logratio[1::2]


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """The sigmoid DPO loss of each pair: ``-logsigmoid(reward_chosen - reward_rejected)``.

    Returns:
        ``[P]`` fp32 (differentiable in ``policy``).
    """
    chosen, rejected = pair_rewards(policy, reference, beta)
    return -nn.functional.logsigmoid(chosen - rejected)


def dpo_loss_sum(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """The summed DPO loss of the pairs of a micro-batch (0-d fp32); divided by the whole
    batch's pair count it is that micro-batch's share of the batch's mean loss."""
    return dpo_losses(policy, reference, beta).sum()


@dataclass(frozen=True)
class PairStats:
    """The DPO numbers of a batch (means over its pairs).

    Attributes:
        loss: the mean DPO loss.
        reward_margin: the mean of ``reward_chosen - reward_rejected``.
        reward_accuracy: the share of pairs whose chosen reward exceeds the rejected one.
        chosen_reward: the mean implicit reward of the chosen completions.
        rejected_reward: the mean of the rejected ones.
        pairs: the number of pairs.
    """

    loss: float
    reward_margin: float
    reward_accuracy: float
    chosen_reward: float
    rejected_reward: float
    pairs: int

    @classmethod
    def of(cls, policy: torch.Tensor, reference: torch.Tensor, beta: float) -> PairStats:
        """The statistics of a batch from its per-row log-probabilities (``[2P]`` each)."""
        with torch.no_grad():
            return cls.from_rewards(*pair_rewards(policy.detach(), reference, beta))

    @classmethod
    def from_rewards(cls, chosen: torch.Tensor, rejected: torch.Tensor) -> PairStats:
        """The statistics of a batch from its pairs' rewards (``[P]`` each)."""
        with torch.no_grad():
            margin = chosen.float() - rejected.float()
            return cls(
                loss=float((-nn.functional.logsigmoid(margin)).mean()),
                reward_margin=float(margin.mean()),
                reward_accuracy=float((margin > 0).float().mean()),
                chosen_reward=float(chosen.float().mean()),
                rejected_reward=float(rejected.float().mean()),
                pairs=int(chosen.shape[0]),
            )

    def metrics(self, prefix: str = "dpo") -> dict[str, float]:
        """The reward statistics as sink metrics (``dpo/reward_margin`` ...), without the loss."""
        return {
            f"{prefix}/reward_margin": self.reward_margin,
            f"{prefix}/reward_accuracy": self.reward_accuracy,
            f"{prefix}/chosen_reward": self.chosen_reward,
            f"{prefix}/rejected_reward": self.rejected_reward,
        }


class DpoObjective(PreferenceObjective):
    """The fused stage's DPO loss: the summed sigmoid loss of a micro-batch's pairs.

    Args:
        beta: the DPO temperature (> 0).
        reference_logps: ``[2P]`` the reference's log-probability of each row of the batch.
    """

    name = "dpo"

    def __init__(self, beta: float, reference_logps: torch.Tensor) -> None:
        super().__init__(reference_logps=reference_logps)
        self.beta = beta

    def sequence_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> torch.Tensor:
        return dpo_loss_sum(logps, upload(self.reference[mb]), self.beta)

    def statistics(
        self, logps: torch.Tensor, reference: torch.Tensor | None, tokens: torch.Tensor
    ) -> PairStats:
        if reference is None:
            raise RuntimeError("a DPO iteration without reference log-probabilities")
        return PairStats.of(logps, reference, self.beta)


def forward_backward(
    engine: RoundPipe,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    reference_logps: torch.Tensor,
    beta: float,
) -> PairStats:
    """Forward and backward of a preference batch under the DPO loss; gradients accumulate
    until ``engine.step()``. Each pair stays in one micro-batch.

    Args:
        input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
            pair ``i``, after the same prompt.
        labels: ``[2P, seq]``, -100 except on the answers' tokens.
        attention_mask: ``[2P, seq]`` 1 for real tokens, 0 for padding.
        reference_logps: ``[2P]`` the reference model's summed log-probability of each row
            (``engine.sequence_logps`` before training; with ``adapters=False`` for a LoRA model).
        beta: the DPO temperature (> 0).

    Returns:
        The batch's statistics; ``loss`` is the mean DPO loss over its pairs, whose gradient
        this accumulates.

    Raises:
        ValueError: bad shapes, an odd number of rows or fewer pairs than micro-batches (a
            pair is never split), a row without label tokens, ``beta`` <= 0, or the MoE
            router loss on (not defined for DPO).
        EngineError: a worker failed.
        Cancelled: the cancel flag was set.
    """
    check_beta(beta)
    objective = DpoObjective(beta, reference_logps)
    it = engine.forward_backward_pairs(
        objective, input_ids=input_ids, labels=labels, attention_mask=attention_mask
    )
    stats: PairStats = batch_statistics(it)
    return stats


def evaluate(
    engine: RoundPipe,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    reference_logps: torch.Tensor,
    beta: float,
) -> PairStats:
    """The DPO statistics of a preference batch without training (arguments, result and
    errors as ``forward_backward``'s; fewer pairs than micro-batches is fine)."""
    check_beta(beta)
    objective = DpoObjective(beta, reference_logps)
    it = engine.evaluate_pairs(objective, input_ids=input_ids, labels=labels, attention_mask=attention_mask)
    stats: PairStats = batch_statistics(it)
    return stats


class DpoRun(PreferenceRun):
    """The pairs of a DPO run and their reference log-probabilities."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self.train_logps = torch.empty(0)
        self.validation_logps = torch.empty(0)

    def fingerprint(self, *, base: str, compute_dtype: str) -> str:
        """What the reference values depend on: every row's tokens, the base model, the dtype."""
        return fingerprint(self.train, self.validation, base=base, compute_dtype=compute_dtype)

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
        """Read the stored reference log-probabilities, or compute and store them.

        Call it before the engine resumes or takes a step: it computes on the initial weights.

        Raises:
            Cancelled: the run's cancel flag was set while computing.
        """
        self.train_logps, self.validation_logps = stored_or_computed(
            engine,
            folder / REFERENCE_FILE,
            self.fingerprint(base=base, compute_dtype=compute_dtype),
            self.train,
            self.validation,
            batch_size=batch_size,
            pad_id=pad_id,
            lora=self.lora,
            sink=sink,
        )

    def objective(self, batch: dict[str, torch.Tensor], *, validation: bool = False) -> DpoObjective:
        if "rows" not in batch:
            raise RuntimeError("a DPO batch without its pairs' indices (collate_pairs' rows)")
        logps = self.validation_logps if validation else self.train_logps
        if logps.shape[0] != 2 * len(self.validation if validation else self.train):
            raise RuntimeError("a DPO batch without reference log-probabilities (prepare() first)")
        return DpoObjective(self.beta, by_rows(logps, batch["rows"]))

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {
            "dpo/val_reward_accuracy": means["dpo/reward_accuracy"],
            "dpo/val_reward_margin": means["dpo/reward_margin"],
        }


RUN = DpoRun
OBJECTIVE = DpoObjective
