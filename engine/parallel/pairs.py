"""Preference (DPO) iterations: whole pairs per micro-batch, the fused stage's loss, the rewards.

A preference batch interleaves its pairs (row ``2i`` chosen, ``2i + 1`` rejected;
``engine.model.preference``). The engine cuts it only at even rows, so both answers of a pair
reach the fused stage in one micro-batch with their reference log-probabilities. The output
layer then returns each row's summed log-probability instead of a token loss sum; the fused
stage turns them into the micro-batch's summed DPO loss, back-propagates it divided by the
batch's pair count, and reports one host vector per micro-batch: the loss sum followed by the
rows' log-probabilities, from which the rewards are computed once the iteration finished.

The same path without reference log-probabilities measures the log-probabilities only
(``RoundPipe.sequence_logps``), with the LoRA adapters on or off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model.adapter import count_label_tokens
from engine.model.preference import PairStats, dpo_loss_sum, pair_rewards
from engine.parallel.board import Iteration, MicroBatch, check_batch, cut_batch


@dataclass
class Preference:
    """What the fused stage of a preference iteration needs besides the labels.

    Attributes:
        beta: the DPO temperature.
        reference: per micro-batch, the reference's log-probabilities of its rows (``[rows]``
            fp32, host); None: the iteration only measures the policy's log-probabilities.
        adapters: run the LoRA layers with their adapters on (False: the base model).
    """

    beta: float = 0.0
    reference: list[torch.Tensor] | None = None
    adapters: bool = True


def split_pairs(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    reference_logps: torch.Tensor,
    num_microbatches: int,
    *,
    pin: bool = False,
) -> tuple[list[MicroBatch], list[torch.Tensor]]:
    """Check a preference batch and cut it into micro-batches of whole pairs.

    Args:
        input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
            pair ``i`` (``labels`` and ``attention_mask`` alike).
        reference_logps: ``[2P]`` the reference's log-probability of each row.
        num_microbatches: micro-batches to cut (each gets ``P // M`` or ``P // M + 1`` pairs).
        pin: pin the host copies (GPU workers upload them asynchronously).

    Returns:
        The micro-batches and, per micro-batch, its rows' reference log-probabilities.

    Raises:
        ValueError: bad shapes, an odd number of rows, fewer pairs than micro-batches, a row
            without label tokens, or reference log-probabilities of another shape or not finite.
    """
    check_batch(input_ids, labels, attention_mask)
    rows = int(input_ids.shape[0])
    if rows % 2:
        raise ValueError(
            f"input_ids has {rows} rows: a preference batch needs an even number "
            "(row 2i the chosen and row 2i + 1 the rejected answer of pair i)"
        )
    pairs, m = rows // 2, num_microbatches
    if pairs < m:
        raise ValueError(
            f"batch of {pairs} pairs ({rows} rows) cannot fill num_microbatches={m}: "
            "a pair is never split between micro-batches"
        )
    if tuple(reference_logps.shape) != (rows,):
        raise ValueError(
            f"reference_logps has shape {tuple(reference_logps.shape)}: expected ({rows},), one per row"
        )
    reference = reference_logps.detach().float().cpu()
    if not bool(torch.isfinite(reference).all()):
        raise ValueError("reference_logps: every value must be finite")
    counts = (labels[:, 1:] != -100).sum(dim=1)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        r = int(empty[0])
        which = "chosen" if r % 2 == 0 else "rejected"
        raise ValueError(f"labels: row {r} (the {which} answer of pair {r // 2}) has no label token")
    sizes = [2 * len(part) for part in torch.arange(pairs).tensor_split(m)]
    cuts = list(itertools.accumulate(sizes[:-1]))
    mbs = cut_batch(input_ids, labels, attention_mask, cuts, pin=pin)
    refs = [r.contiguous().pin_memory() if pin else r.contiguous() for r in reference.split(sizes)]
    return mbs, refs


def fused_output(
    it: Iteration, mb: int, logps: torch.Tensor, upload: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch of a preference iteration, in its fused stage.

    Args:
        logps: ``[rows]`` the policy's per-row log-probabilities (the output layer's result,
            differentiable when training).
        upload: copies a host tensor to the stage's device.

    Returns:
        The loss sum to back-propagate (the summed DPO loss of the pairs; without reference,
        the rows' negative log-likelihood) and the report ``[1 + rows]``: that sum, then the
        log-probabilities, detached.
    """
    pref = it.preference
    if pref is None:
        raise RuntimeError(f"iteration {it.serial} is not a preference iteration")
    if pref.reference is None:
        loss = -logps.sum()
    else:
        loss = dpo_loss_sum(logps, upload(pref.reference[mb]), pref.beta)
    return loss, torch.cat([loss.detach().reshape(1), logps.detach()])


def policy_logps(it: Iteration) -> torch.Tensor:
    """``[rows]`` the policy's log-probability of every row of a finished preference iteration,
    in batch order (waiting for their copies)."""
    parts = []
    for mb, batch in enumerate(it.microbatches):
        host, j, event = it.loss_sums[mb]
        if event is not None:
            event.synchronize()
        parts.append(host[j + 1 : j + 1 + int(batch.input_ids.shape[0])])
    return torch.cat(parts).float().clone()


def step_metrics(its: Iterable[Iteration]) -> dict[str, float]:
    """The DPO metrics of a step's preference iterations (none when it has none):
    ``dpo/reward_margin``, ``dpo/reward_accuracy``, ``dpo/chosen_reward``,
    ``dpo/rejected_reward``, ``dpo/pairs``, and ``tokens/label`` (the answers' tokens)."""
    chosen, rejected, tokens = [], [], 0
    for it in its:
        pref = it.preference
        if pref is None or pref.reference is None:
            continue
        c, r = pair_rewards(policy_logps(it), torch.cat(pref.reference), pref.beta)
        chosen.append(c)
        rejected.append(r)
        tokens += sum(count_label_tokens(mb.labels) for mb in it.microbatches)
    if not chosen:
        return {}
    stats = PairStats.from_rewards(torch.cat(chosen), torch.cat(rejected))
    return {**stats.metrics(), "dpo/pairs": float(stats.pairs), "tokens/label": float(tokens)}


def batch_stats(it: Iteration) -> PairStats:
    """The statistics of one finished preference iteration; ``loss`` is the fused stages' mean."""
    pref = it.preference
    if pref is None or pref.reference is None:
        raise RuntimeError(f"iteration {it.serial} has no reference log-probabilities")
    stats = PairStats.of(policy_logps(it), torch.cat(pref.reference), pref.beta)
    return dataclasses.replace(stats, loss=it.loss_sum() / it.total_tokens)


def lora_layers(modules: Iterable[nn.Module]) -> list[Any]:
    """The peft tuner layers (LoRA's ``BaseTunerLayer``) inside ``modules``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for module in modules for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the LoRA layers of ``modules`` with their adapters off (peft's ``enable_adapters``);
    each layer's switch and its parameters' ``requires_grad`` flags are restored after."""
    saved = []
    for layer in lora_layers(modules):
        flags = [(p, p.requires_grad) for p in layer.parameters()]
        saved.append((layer, bool(layer.disable_adapters), flags))
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, was_disabled, flags in saved:
            layer.enable_adapters(not was_disabled)
            for p, flag in flags:
                p.requires_grad_(flag)
