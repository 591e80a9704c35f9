"""Iterations that score whole sequences: pairs kept in one micro-batch, per-row log-probabilities.

A preference batch interleaves its pairs (row ``2i`` chosen, ``2i + 1`` rejected). The engine
cuts it only at even rows, so both answers of a pair reach the fused stage in one micro-batch.
The output layer of such an iteration returns each row's summed log-probability instead of a
token loss sum (``Objective.per_sequence``); the iteration's objective (a preference method's,
``engine.methods``) turns them into the micro-batch's loss sum and reports one host vector per
micro-batch: the loss sum followed by the rows' log-probabilities (``policy_logps`` reads them).

``SequenceScores`` measures the log-probabilities only (``RoundPipe.sequence_logps``), with the
LoRA adapters on or off.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.parallel.board import Iteration, MicroBatch, check_batch, cut_batch
from engine.parallel.objective import Objective, Upload


class SequenceScores(Objective):
    """Score each row: the output layer returns its summed log-probability; the loss sum is the
    rows' negative log-likelihood (what a preference method's objective replaces).

    Args:
        adapters: run the LoRA layers with their adapters on (False: the base model).
    """

    per_sequence = True

    def __init__(self, *, adapters: bool = True) -> None:
        self.adapters = adapters

    def sequence_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> torch.Tensor:
        """The loss sum of micro-batch ``mb`` from its rows' log-probabilities ``[rows]``."""
        return -logps.sum()

    def fused_loss(
        self, mb: int, output: torch.Tensor, upload: Upload
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss sum, and the report ``[1 + rows]``: that sum, then the log-probabilities."""
        loss = self.sequence_loss(mb, output, upload)
        return loss, torch.cat([loss.detach().reshape(1), output.detach()])


class PairScores(SequenceScores):
    """A preference method's objective over whole pairs (``engine.methods``).

    Per micro-batch it holds its rows' reference log-probabilities (a method with a reference
    pass) and label token counts, set by ``bind`` once the batch is cut; ``sequence_loss`` is
    the method's summed loss of the micro-batch's pairs, which the engine divides by the whole
    batch's pair count.

    Attributes:
        name: the method's name, for error messages.
        reference_logps: ``[2P]`` the batch's reference log-probabilities, or None.
    """

    name = "preference"

    def __init__(self, *, reference_logps: torch.Tensor | None = None) -> None:
        super().__init__()
        self.reference_logps = reference_logps
        self.reference: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def bind(self, microbatches: list[MicroBatch], reference: list[torch.Tensor], *, pin: bool) -> None:
        """Keep, per micro-batch, its rows' reference log-probabilities and label token counts
        (``[rows]`` fp32 host tensors, pinned with ``pin``)."""
        self.reference = reference
        counts = [(mb.labels[:, 1:] != -100).sum(dim=1).float() for mb in microbatches]
        self.tokens = [c.pin_memory() if pin else c for c in counts]


def split_pairs(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    reference_logps: torch.Tensor | None,
    num_microbatches: int,
    *,
    pin: bool = False,
) -> tuple[list[MicroBatch], list[torch.Tensor]]:
    """Check a preference batch and cut it into micro-batches of whole pairs.

    Args:
        input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
            pair ``i`` (``labels`` and ``attention_mask`` alike).
        reference_logps: ``[2P]`` the reference's log-probability of each row (DPO), or None.
        num_microbatches: micro-batches to cut (each gets ``P // M`` or ``P // M + 1`` pairs).
        pin: pin the host copies (GPU workers upload them asynchronously).

    Returns:
        The micro-batches and, per micro-batch, its rows' reference log-probabilities (an
        empty list without ``reference_logps``).

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
    if reference_logps is not None and tuple(reference_logps.shape) != (rows,):
        raise ValueError(
            f"reference_logps has shape {tuple(reference_logps.shape)}: expected ({rows},), one per row"
        )
    reference = None if reference_logps is None else reference_logps.detach().float().cpu()
    if reference is not None and not bool(torch.isfinite(reference).all()):
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
    if reference is None:
        return mbs, []
    refs = [r.contiguous().pin_memory() if pin else r.contiguous() for r in reference.split(sizes)]
    return mbs, refs


def policy_logps(it: Iteration) -> torch.Tensor:
    """``[rows]`` the policy's log-probability of every row of a finished iteration whose
    objective scores sequences, in batch order (waiting for their copies)."""
    parts = []
    for mb, batch in enumerate(it.microbatches):
        host, j, event = it.loss_sums[mb]
        if event is not None:
            event.synchronize()
        parts.append(host[j + 1 : j + 1 + int(batch.input_ids.shape[0])])
    return torch.cat(parts).float().clone()


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
