"""The options every preference method shares (DPO, ORPO): a beta, and whole pairs.

No torch import: ``engine.methods.dpo`` and ``engine.methods.orpo`` derive their options from
``PreferenceOptions``; the torch side of pairs is ``engine.methods.preference``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.methods.contract import MethodOptions, refuse_packing_and_router_loss

if TYPE_CHECKING:
    from engine.config import TrainConfig

# what a preference dataset holds, for the message refusing another
PAIRS = "rows with a preferred and a rejected answer (prompt, chosen, rejected)"


class PreferenceOptions(MethodOptions):
    """A method trained on pairs of a preferred and a rejected answer (2 sequences a pair, in one
    micro-batch)."""

    beta: float

    def sequences_per_example(self) -> int:
        return 2

    def check(self, config: TrainConfig) -> None:
        refuse_packing_and_router_loss(config, "trains on whole pairs")
