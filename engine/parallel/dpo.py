"""``RoundPipe``'s preference-tuning (DPO) methods, mixed into the engine class.

They cut preference batches into micro-batches of whole pairs (``engine.parallel.pairs``) and
run them through the engine's own iterations: ``forward_backward_dpo`` trains on the DPO loss,
``evaluate_dpo`` measures it, ``sequence_logps`` measures each row's log-probability (the
reference's, before training; a LoRA model's with its adapters off).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.errors import ConfigError
from engine.model.preference import PairStats
from engine.parallel.board import split_batch
from engine.parallel.pairs import Preference, batch_stats, lora_layers, policy_logps, split_pairs

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.adapter import AdaptedModel
    from engine.parallel.board import Board, Iteration, MicroBatch
    from engine.parallel.host import HostState


class PreferenceMethods:
    """The DPO methods of ``RoundPipe`` (which provides the attributes and iteration methods below)."""

    config: EngineConfig
    adapted: AdaptedModel
    host: HostState
    board: Board

    def _check_open(self) -> None:
        raise NotImplementedError

    def _train(self, mbs: list[MicroBatch], total: int, preference: Preference | None = None) -> Iteration:
        raise NotImplementedError

    def _launch(
        self, mbs: list[MicroBatch], total: int, *, train: bool, preference: Preference | None = None
    ) -> Iteration:
        raise NotImplementedError

    def forward_backward_dpo(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        reference_logps: torch.Tensor,
        beta: float,
    ) -> PairStats:
        """Forward and backward of a preference batch under the DPO loss (``engine.model.preference``);
        gradients accumulate until ``step()``. Each pair stays in one micro-batch.

        Args:
            input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
                pair ``i``, after the same prompt.
            labels: ``[2P, seq]``, -100 except on the answers' tokens.
            attention_mask: ``[2P, seq]`` 1 for real tokens, 0 for padding.
            reference_logps: ``[2P]`` the reference model's summed log-probability of each row
                (``sequence_logps`` before training; with ``adapters=False`` for a LoRA model).
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
        self._check_open()
        _check_beta(beta)
        if self.config.router_aux_loss:
            raise ConfigError(
                "EngineConfig.router_aux_loss", "router_aux_loss=True: not supported with DPO", value=True
            )
        mbs, refs = split_pairs(
            input_ids,
            labels,
            attention_mask,
            reference_logps,
            self.config.num_microbatches,
            pin=self.host.pinned,
        )
        return batch_stats(self._train(mbs, int(input_ids.shape[0]) // 2, Preference(beta, refs)))

    def evaluate_dpo(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        reference_logps: torch.Tensor,
        beta: float,
    ) -> PairStats:
        """The DPO statistics of a preference batch without training (arguments, result and
        errors as ``forward_backward_dpo``'s; fewer pairs than micro-batches is fine)."""
        self._check_open()
        _check_beta(beta)
        pairs = int(input_ids.shape[0]) // 2 if input_ids.dim() == 2 else 0
        m = max(1, min(self.config.num_microbatches, pairs))
        mbs, refs = split_pairs(input_ids, labels, attention_mask, reference_logps, m, pin=self.host.pinned)
        it = self._launch(mbs, pairs, train=False, preference=Preference(beta, refs))
        self.board.wait_for(lambda: it.remaining == 0, it)
        return batch_stats(it)

    def sequence_logps(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        adapters: bool = True,
    ) -> torch.Tensor:
        """Each row's summed log-probability of its label tokens, without training.

        Runs the forward stages and the fused stage's forward on the weights the next
        ``forward_backward`` would use, with dropout off.

        Args:
            input_ids: ``[batch, seq]`` token ids.
            labels: ``[batch, seq]``, -100 where no token is scored (shifted inside).
            attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding.
            adapters: False runs a LoRA model with its adapters off, on every worker's copy of
                its layers (the base model: DPO's reference); they are back on afterwards.

        Returns:
            ``[batch]`` fp32 on the CPU (0 for a row without label tokens).

        Raises:
            ValueError: bad shapes, no label token at all, or ``adapters=False`` for a model
                without LoRA layers.
        """
        self._check_open()
        if not adapters and not lora_layers(layer.module for layer in self.adapted.layers):
            raise ValueError("sequence_logps(adapters=False): the model has no LoRA adapter to turn off")
        m = min(self.config.num_microbatches, int(input_ids.shape[0])) if input_ids.dim() == 2 else 1
        mbs, total = split_batch(
            input_ids, labels, attention_mask, m or self.config.num_microbatches, pin=self.host.pinned
        )
        it = self._launch(mbs, total, train=False, preference=Preference(adapters=adapters))
        self.board.wait_for(lambda: it.remaining == 0, it)
        return policy_logps(it)


def _check_beta(beta: float) -> None:
    if isinstance(beta, bool) or not (isinstance(beta, int | float) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta={beta!r}: must be a finite number > 0")
