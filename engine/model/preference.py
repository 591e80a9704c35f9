"""The DPO preference loss and the per-sequence log-probabilities it is computed from.

A preference batch interleaves its pairs: row ``2i`` is the chosen (preferred) completion of
pair ``i`` and row ``2i + 1`` the rejected one, both after the same prompt, their labels -100
except on the completion tokens. A sequence's log-probability is the sum, over its label
tokens, of the log-probability the model gives each token; the reference's log-probabilities
are those of the model before training (a LoRA base with its adapter off, or the initial
weights), computed once.

With ``pi`` the policy's and ``ref`` the reference's log-probabilities, the implicit reward of
a completion is ``beta * (pi - ref)`` and the loss of a pair is
``-logsigmoid(reward_chosen - reward_rejected)`` (Rafailov et al., 2023; the sigmoid loss).
The loss of a batch is the mean over its pairs, so a micro-batch contributes the sum of its
pairs' losses divided by the pair count of the whole batch, as the supervised loss divides the
micro-batch's token sum by the batch's label tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.model.loss import DEFAULT_LOSS_CHUNK_TOKENS, IGNORE_INDEX, check_chunk_tokens


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sum of the log-probabilities of the label tokens (fp32), from full logits.

    ``logits [b, s, vocab]`` predict ``labels [b, s]`` shifted by one, as the model's own loss
    does. The unchunked reference of ``chunked_sequence_logps``.

    Returns:
        ``[b]`` fp32; 0 for a row without label tokens.
    """
    b, s = labels.shape
    shift = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(shift.device)
    nll = nn.functional.cross_entropy(shift, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(b, s - 1).sum(dim=1)


def _chunk_token_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    # hidden [n, d] -> logits [n, vocab] -> [n] log-probability of each target (0 where -100)
    logits = head(hidden).float()
    return -nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def chunked_sequence_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    preserve_rng_state: bool = False,
) -> torch.Tensor:
    """Per-row sum of the label tokens' log-probabilities, the logits computed chunk by chunk.

    Equals ``sequence_logps(head(hidden), labels)`` but the logits alive at any time (forward
    and backward) are at most ``chunk_tokens x vocab``; what is kept per position is one float.

    Args:
        hidden: ``[b, s, d]``, the final norm's output.
        labels: ``[b, s]``; position ``t`` of ``hidden`` predicts ``labels[:, t + 1]``.
        head: the LM head, ``[n, d] -> [n, vocab]`` (called again per chunk in backward).
        chunk_tokens: positions (over the flattened ``b x (s - 1)``) per chunk.
        preserve_rng_state: the head draws random numbers (dropout): replay them in backward.

    Returns:
        ``[b]`` fp32.

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    check_chunk_tokens(chunk_tokens)
    b, s = labels.shape
    flat = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(flat.device)
    parts = []
    for start in range(0, max(flat.shape[0], 1), chunk_tokens):
        h, y = flat[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            part = checkpoint(
                _chunk_token_logps, head, h, y, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            part = _chunk_token_logps(head, h, y)
        parts.append(part)
    # [b * (s - 1)] -> [b, s - 1] -> [b]: a fixed summation order, whatever the chunking
    return torch.cat(parts).view(b, s - 1).sum(dim=1)


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
