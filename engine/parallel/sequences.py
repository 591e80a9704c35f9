"""``RoundPipe``'s iterations that score whole sequences, mixed into the engine class.

They cut preference batches into micro-batches of whole pairs (``engine.parallel.pairs``) and
run them through the engine's own iterations under a method's objective:
``forward_backward_pairs`` trains on it, ``evaluate_pairs`` measures it, ``sequence_logps``
measures each row's log-probability (a reference's, before training; a LoRA model's with its
adapters off). Their per-token counterparts (``engine.parallel.tokens``) score every label token:
``forward_backward_tokens`` trains under a per-token objective (GRPO's), ``token_logps``
measures each token's log-probability (with ``initial``, on the frozen copy of the first weights
that ``keep_initial_weights`` keeps: a full fine-tune's reference model). The methods
(``engine.methods.dpo``, ``engine.methods.orpo``, ``engine.methods.grpo``) build on these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch

from engine.errors import ConfigError
from engine.parallel.board import split_batch
from engine.parallel.pairs import PairScores, SequenceScores, lora_layers, policy_logps, split_pairs
from engine.parallel.tokens import TokenLogps, TokenScores, reported_token_logps

T = TypeVar("T")

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.adapter import AdaptedModel
    from engine.parallel.board import Board, Iteration, MicroBatch
    from engine.parallel.host import HostState
    from engine.parallel.objective import Objective


class SequenceMethods:
    """The sequence-scoring methods of ``RoundPipe`` (which provides the attributes and
    iteration methods below)."""

    config: EngineConfig
    adapted: AdaptedModel
    host: HostState
    board: Board

    def _check_open(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def next_version(self) -> int:
        raise NotImplementedError

    def _train(
        self, mbs: list[MicroBatch], total: int, objective: Objective | None = None, *, first: int = 0
    ) -> Iteration:
        raise NotImplementedError

    def _launch(
        self,
        mbs: list[MicroBatch],
        total: int,
        *,
        train: bool,
        objective: Objective | None = None,
        first: int = 0,
    ) -> Iteration:
        raise NotImplementedError

    @property
    def cuts(self) -> int:
        raise NotImplementedError

    def share(self, mbs: list[T]) -> tuple[list[T], int]:
        raise NotImplementedError

    def _check_rows(self, rows: int, what: str) -> None:
        raise NotImplementedError

    def _refuse_router_loss(self, objective: PairScores | TokenScores) -> None:
        """The MoE router loss is not defined for the sequence and token objectives.

        Raises:
            ConfigError: ``router_aux_loss`` is on.
        """
        if self.config.router_aux_loss:
            raise ConfigError(
                "EngineConfig.router_aux_loss",
                f"router_aux_loss=True: not supported with {objective.name.upper()}",
                value=True,
            )

    def forward_backward_pairs(
        self,
        objective: PairScores,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> Iteration:
        """Forward and backward of a preference batch under ``objective``; gradients accumulate
        until ``step()``. Each pair stays in one micro-batch.

        Args:
            objective: the method's loss over pairs, with the batch's reference
                log-probabilities when the method has them.
            input_ids: ``[2P, seq]``: row ``2i`` the chosen, row ``2i + 1`` the rejected answer of
                pair ``i``, after the same prompt.
            labels: ``[2P, seq]``, -100 except on the answers' tokens.
            attention_mask: ``[2P, seq]`` 1 for real tokens, 0 for padding.

        Returns:
            The iteration, its loss handed over (``loss_sum() / total_tokens`` is the mean loss
            over its pairs; ``policy_logps`` its rows' log-probabilities).

        Raises:
            ValueError: bad shapes, an odd number of rows or fewer pairs than micro-batches (a
                pair is never split), a row without label tokens, or the MoE router loss on.
            EngineError: a worker failed.
            Cancelled: the cancel flag was set.
        """
        self._check_open()
        self._refuse_router_loss(objective)
        self._check_rows(int(input_ids.shape[0]) // 2 if input_ids.dim() == 2 else 0, "pairs")
        mbs, refs = split_pairs(
            input_ids, labels, attention_mask, objective.reference_logps, self.cuts, pin=self.host.pinned
        )
        objective.bind(mbs, refs, pin=self.host.pinned)  # the whole batch's: fused_loss indexes it
        mine, first = self.share(mbs)
        return self._train(mine, int(input_ids.shape[0]) // 2, objective, first=first)

    def evaluate_pairs(
        self,
        objective: PairScores,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> Iteration:
        """A preference batch under ``objective`` without training (arguments, result and
        errors as ``forward_backward_pairs``'s; fewer pairs than micro-batches is fine)."""
        self._check_open()
        pairs = int(input_ids.shape[0]) // 2 if input_ids.dim() == 2 else 0
        m = max(1, min(self.config.num_microbatches, pairs))
        mbs, refs = split_pairs(
            input_ids, labels, attention_mask, objective.reference_logps, m, pin=self.host.pinned
        )
        objective.bind(mbs, refs, pin=self.host.pinned)
        it = self._launch(mbs, pairs, train=False, objective=objective)
        self.board.wait_for(lambda: it.remaining == 0, it)
        return it

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
        return policy_logps(
            self._measure(
                "sequence_logps", SequenceScores(adapters=adapters), input_ids, labels, attention_mask
            )
        )

    def _measure(
        self,
        caller: str,
        objective: Objective,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> Iteration:
        """Run a batch forward under a scoring ``objective`` without training (as many
        micro-batches as rows allow) and wait for it; ``caller`` names the method in errors."""
        self._check_open()
        if not objective.adapters and not lora_layers(layer.module for layer in self.adapted.layers):
            raise ValueError(f"{caller}(adapters=False): the model has no LoRA adapter to turn off")
        if objective.initial and not self.host.initial:
            raise ValueError(f"{caller}(initial=True): no initial weights kept (keep_initial_weights)")
        m = min(self.config.num_microbatches, int(input_ids.shape[0])) if input_ids.dim() == 2 else 1
        mbs, total = split_batch(
            input_ids, labels, attention_mask, m or self.config.num_microbatches, pin=self.host.pinned
        )
        if isinstance(objective, TokenScores):
            objective.bind(mbs, pin=self.host.pinned)
        it = self._launch(mbs, total, train=False, objective=objective)
        self.board.wait_for(lambda: it.remaining == 0, it)
        return it

    def forward_backward_tokens(
        self,
        objective: TokenScores,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        divisor: int,
        whole: bool = True,
    ) -> Iteration:
        """Forward and backward of a batch under a per-token objective; gradients accumulate
        until ``step()``.

        Args:
            objective: the method's loss over each micro-batch's token log-probabilities.
            input_ids: ``[rows, seq]`` token ids.
            labels: ``[rows, seq]``, -100 except on the tokens the objective scores.
            attention_mask: ``[rows, seq]`` 1 for real tokens, 0 for padding.
            divisor: what the micro-batches' loss sums are divided by (the method's
                normalisation: rows, label tokens, ...); ``loss_sum() / total_tokens`` is then
                the batch's loss.
            whole: the rows are the whole batch (on several boxes each is given all of them and
                trains its share); False: on several boxes they are this box's share already
                (GRPO's rollouts, sampled on each box for its share of the prompts), cut into
                ``num_microbatches``, and ``divisor`` is the whole batch's.

        Raises:
            ValueError: bad shapes, fewer rows than micro-batches, no label token, a divisor < 1.
            ConfigError: the MoE router loss is on.
            EngineError: a worker failed.
            Cancelled: the cancel flag was set.
        """
        self._check_open()
        self._refuse_router_loss(objective)
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"divisor={divisor!r}: must be an integer >= 1")
        if whole:
            self._check_rows(int(input_ids.shape[0]) if input_ids.dim() == 2 else 0, "rows")
        cuts = self.cuts if whole else self.config.num_microbatches
        mbs, _ = split_batch(input_ids, labels, attention_mask, cuts, pin=self.host.pinned)
        objective.bind(mbs, pin=self.host.pinned)
        mine, first = self.share(mbs) if whole else (mbs, 0)
        return self._train(mine, divisor, objective, first=first)

    def keep_initial_weights(self) -> int:
        """Keep a frozen copy of the trained weights as they are now, in the compute dtype, in
        host memory (pinned for GPU workers): ``token_logps(initial=True)`` computes with it. A
        full fine-tune's reference model (GRPO's KL term); call it before the first step. The
        frozen weights of a LoRA base are not copied (they never change).

        Returns:
            The copy's bytes.
        """
        self._check_open()
        self.synchronize()  # no optimizer step is still writing the compute buffers
        return self.host.keep_initial(self.next_version())

    def token_logps(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        adapters: bool = True,
        initial: bool = False,
    ) -> torch.Tensor:
        """Every label token's log-probability, without training (the weights the next
        ``forward_backward`` would use, dropout off).

        Args: as ``sequence_logps``'s, and
            initial: compute with the weights ``keep_initial_weights`` kept (the stages upload
                that copy instead of the current weights).

        Returns:
            ``[rows, seq - 1]`` fp32 on the CPU: position ``t`` the log-probability of
            ``labels[:, t + 1]``, 0 where that label is -100.

        Raises:
            ValueError: as ``sequence_logps``'s, or ``initial`` without a kept copy.
        """
        objective = TokenLogps(adapters=adapters, initial=initial)
        it = self._measure("token_logps", objective, input_ids, labels, attention_mask)
        return reported_token_logps(it)
