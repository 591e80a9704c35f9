"""A worker's share of the MoE routers' auxiliary loss (``engine.model.router``).

Forward stages sum their blocks' router statistics per micro-batch and send them to the host;
the fused stage adds its own, turns the model-wide counts into one weight per expert, adds the
loss's value to the micro-batch's loss and sends the weights to the backward stages; every
stage back-propagates ``sum_e weight[e] * P_l[e]`` with each MoE block l it trains.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.adapter import count_label_tokens
from engine.model.router import RouterLoss, RouterTap
from engine.parallel.board import Board, Iteration
from engine.parallel.transfer import DeviceLink


class RouterAccounting:
    """The router-loss bookkeeping of one worker (inactive when the run adds no such loss)."""

    def __init__(
        self, loss: RouterLoss | None, modules: list[torch.nn.Module], link: DeviceLink, board: Board
    ):
        self.loss = loss
        self.link = link
        self.board = board
        taps = {i: loss.tap(m) for i, m in enumerate(modules)} if loss is not None else {}
        self.taps: dict[int, RouterTap] = {i: tap for i, tap in taps.items() if tap is not None}

    @property
    def active(self) -> bool:
        return bool(self.taps)

    def statistics(self, it: Iteration, mb: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The router sums (counts, probabilities) of a block's latest call, in training.

        Called after every call of a layer: it also drops what an evaluation's call caught.
        """
        tap = self.taps.get(layer)
        if tap is None:
            return None
        logits = tap.take()
        if not it.train or self.loss is None or not logits:
            return None
        am = it.microbatches[mb].attention_mask
        mask = None if am is None else self.link.upload(am)
        counts, probs = self.loss.statistics(logits[0], mask)
        for g in logits[1:]:
            c, p = self.loss.statistics(g, mask)
            counts, probs = counts + c, probs + p
        return counts, probs

    def fused(
        self, it: Iteration, mb: int, routed: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused stage's part for micro-batch ``mb``.

        Adds the forward stages' sums to the fused blocks' own and sends each expert's weight
        ``coef x label tokens x scale x E T[e] / R^2`` to the stages below.

        Returns:
            The loss's value times the micro-batch's label tokens (added to its loss sum) and
            the weights (on this device).
        """
        loss = self.loss
        assert loss is not None
        starts = [s.start for s in it.plan.forward if any(i in self.taps for i in s.layers)]
        self.board.wait_for(lambda: all((mb, b) in it.router_sums for b in starts), it)
        device = self.link.device
        counts = torch.zeros(loss.experts, dtype=torch.float32, device=device)
        probs = torch.zeros_like(counts)
        for c, p in routed.values():
            counts, probs = counts + c, probs + p.detach()
        for b in starts:
            with self.board.cv:
                host, event = it.router_sums.pop((mb, b))
            summed = self._arrive(host, event)
            counts, probs = counts + summed[0], probs + summed[1]
        batch = it.microbatches[mb]
        per_expert = loss.scale(counts, loss.rows(batch.input_ids, batch.attention_mask))
        tokens = count_label_tokens(batch.labels)
        weights = per_expert * (loss.coef * tokens * scale)
        sent: Any = self.link.download(weights)
        with self.board.cv:
            it.router_weights[(mb, 0)] = sent
            self.board.cv.notify_all()
        return (per_expert * probs).sum() * (loss.coef * tokens), weights

    def weights(self, it: Iteration, mb: int) -> torch.Tensor:
        """The per-expert weights of micro-batch ``mb``, on this device (a backward stage)."""
        self.board.wait_for(lambda: (mb, 0) in it.router_weights, it)
        with self.board.cv:
            host, event = it.router_weights[(mb, 0)]
        return self._arrive(host, event)

    def _arrive(self, host: torch.Tensor, event: Any) -> torch.Tensor:
        self.link.wait(self.link.act_up, event)
        return self.link.upload(host)
