"""The mixture-of-experts router's auxiliary load-balancing loss, computed across stages.

The loss Hugging Face adds when a MoE model is asked for router logits (Switch Transformer's
eqs. 4-6, summed over every MoE block of the model) is, for one batch::

    aux = E * sum_e T[e] * P[e] / R**2

where E is the number of experts, ``T[e]`` counts the (token, block) pairs whose top-k choice
includes expert e, ``P[e]`` sums the router's softmax probability of e over the same pairs, and
R = (MoE blocks) x (tokens); padding tokens (attention mask 0) count for neither. T holds no
gradient, so the gradient reaching block l's router is that of ``E * sum_e T[e] * P_l[e] / R**2``
with T fixed: each block's part is a *surrogate* built from its own probabilities and the
model-wide counts. In the engine the forward stages send each micro-batch's per-block sums
(T_l, P_l) to the host; the fused stage, which has seen every block of the micro-batch by its
loss, adds them up, and every stage back-propagates its blocks' surrogates with its layers.

A micro-batch's term is weighted like its cross entropy (by its share of the batch's label
tokens), so one micro-batch reproduces the model's own ``loss`` exactly and several reproduce the
token-weighted mean of the model's per-micro-batch losses (what gradient accumulation over those
micro-batches computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.errors import ConfigError
from engine.kinds import LayerKind
from engine.model.families import model_kind


@dataclass(frozen=True)
class RouterLoss:
    """The auxiliary loss of one model: its coefficient and the routing it is computed for.

    Attributes:
        coef: the loss's weight (the model's ``router_aux_loss_coef`` unless the run names one).
        experts: routed experts per MoE block (E).
        top_k: experts each token is sent to.
        blocks: number of MoE blocks in the model (their routers' logits all count).
        router: the class name of the router modules (their forward returns the logits first).
    """

    coef: float
    experts: int
    top_k: int
    blocks: int
    router: str

    @classmethod
    def for_model(cls, adapted: Any, coef: float | None) -> RouterLoss:
        """The loss for an adapted model (``engine.model.adapter.AdaptedModel``).

        Raises:
            ConfigError: (``EngineConfig.router_aux_loss``) the model is not a mixture of
                experts, or its family has no auxiliary loss.
        """
        field = "EngineConfig.router_aux_loss"
        moe = adapted.family.moe
        if moe is None:
            raise ConfigError(
                field, f"{field}: {adapted.architecture} is not a mixture-of-experts model", value=True
            )
        if not moe.aux_loss:
            raise ConfigError(
                field,
                f"{field}: {adapted.architecture} has no auxiliary load-balancing loss "
                "(it balances its experts without one)",
                value=True,
            )
        kind = model_kind(adapted.config.to_dict() | {"architectures": [adapted.architecture]})
        blocks = sum(
            1
            for layer in adapted.layers
            if layer.kind == LayerKind.BLOCK
            and any(type(m).__name__ == moe.router for m in layer.module.modules())
        )
        if coef is None:
            coef = float(getattr(adapted.config, "router_aux_loss_coef", 0.0) or 0.0)
        if not kind.experts or not kind.active_experts or blocks == 0:
            raise ConfigError(field, f"{field}: {adapted.architecture} has no routed MoE block", value=True)
        return cls(
            coef=coef, experts=kind.experts, top_k=kind.active_experts, blocks=blocks, router=moe.router
        )

    def tap(self, module: nn.Module) -> RouterTap | None:
        """Catch the router logits of a (copy of a) decoder block; None when it has no router."""
        routers = [m for m in module.modules() if type(m).__name__ == self.router]
        return RouterTap(routers) if routers else None

    def statistics(
        self, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's sums for one micro-batch.

        Args:
            logits: the router logits ``[tokens, experts]`` (tokens in ``[batch, seq]`` order).
            mask: the micro-batch's attention mask ``[batch, seq]``, or None (every token counts).

        Returns:
            ``counts`` (fp32, no gradient): top-k assignments per expert, and ``probs`` (fp32,
            with the logits' gradient): summed routing probabilities per expert.
        """
        probs = torch.softmax(logits.float(), dim=-1)
        flat = None if mask is None else mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
        with torch.no_grad():
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
            if flat is None:
                weights = torch.ones(chosen.shape, dtype=torch.float32, device=probs.device)
            else:
                weights = flat.repeat_interleave(self.top_k)
            counts = torch.zeros(self.experts, dtype=torch.float32, device=probs.device)
            counts.scatter_add_(0, chosen, weights)
        summed = probs.sum(dim=0) if flat is None else (probs * flat.unsqueeze(-1)).sum(dim=0)
        return counts, summed

    @staticmethod
    def rows(input_ids: torch.Tensor, mask: torch.Tensor | None) -> int:
        """Tokens of a micro-batch that count (not padding), per MoE block."""
        return int(input_ids.numel()) if mask is None else int(mask.sum())

    def scale(self, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """``E * T / R**2``: the per-expert weight of the probability sums, given the
        micro-batch's model-wide counts T and its token rows per block."""
        total_rows = max(rows * self.blocks, 1)
        return counts * (self.experts / total_rows**2)


class RouterTap:
    """Forward hooks that keep the router logits of the latest call of a block."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.logits: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.logits.append(output[0] if isinstance(output, tuple) else output)

    def take(self) -> list[torch.Tensor]:
        """The logits caught since the last ``take``, oldest first."""
        caught, self.logits = self.logits, []
        return caught
