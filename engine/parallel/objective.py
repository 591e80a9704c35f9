"""The objective hook: what the fused stage makes of the output layer's result.

Every iteration carries one ``Objective``. The executor asks it three things and nothing else
about the training method: whether the output layer scores whole sequences (``per_sequence``:
each row's summed log-probability), each label token (``per_token``: its log-probability) or
returns the micro-batch's token loss sum, whether the
LoRA layers run with their adapters on (``adapters``), whether the stages upload the frozen copy
of the initial weights instead of the current ones (``initial``), and, in the fused stage, which loss sum to
back-propagate and which report to send to the host (``fused_loss``). After a step, the
optimizer asks the objective of the step's iterations for its metrics (``step_metrics``).

The base class is the supervised objective (next-token cross entropy); the training methods
(``engine.methods``) subclass it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.parallel.board import Iteration

Upload = Callable[[torch.Tensor], torch.Tensor]


class Objective:
    """The supervised objective: the output layer returns the micro-batch's token loss sum.

    Attributes:
        per_sequence: the output layer returns ``[rows]`` per-row summed log-probabilities of
            the label tokens instead of the token loss sum.
        per_token: the output layer returns ``[rows, seq - 1]`` the log-probability of every
            label token (0 elsewhere) instead of the token loss sum.
        adapters: run the LoRA layers with their adapters on (False: the base model).
        initial: compute with the frozen copy of the trained weights as they were at the start
            (``RoundPipe.keep_initial_weights``: a full fine-tune's reference model).
    """

    per_sequence: bool = False
    per_token: bool = False
    adapters: bool = True
    initial: bool = False

    @property
    def scores(self) -> bool:
        """The output layer scores tokens or sequences for the objective to turn into its loss
        (nothing else is counted: no right predictions, no token loss sum)."""
        return self.per_sequence or self.per_token

    def fused_loss(
        self, mb: int, output: torch.Tensor, upload: Upload
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss sum of micro-batch ``mb`` and what goes to the host for it.

        Args:
            mb: the micro-batch's index in its iteration.
            output: the output layer's result (differentiable when training).
            upload: copies a host tensor to the stage's device.

        Returns:
            ``(loss_sum, report)``: the sum to back-propagate (scaled by the iteration's
            ``total_tokens``), and ``None`` when the loss sum alone goes down, or a 1-D tensor
            whose first element is the loss sum and whose rest the objective reads back later.
        """
        return output, None

    def step_metrics(self, iterations: Sequence[Iteration]) -> dict[str, float]:
        """Metrics of a step's iterations that share this objective's type (none here)."""
        return {}


TOKEN_LOSS = Objective()


def objective_metrics(iterations: Sequence[Iteration]) -> dict[str, float]:
    """The objectives' own metrics of a step's iterations, each type asked once for its group."""
    groups: dict[type, list[Iteration]] = {}
    for it in iterations:
        groups.setdefault(type(it.objective), []).append(it)
    metrics: dict[str, float] = {}
    for group in groups.values():
        metrics.update(group[0].objective.step_metrics(group))
    return metrics
