"""DPO (``method.objective: "dpo"``): preference tuning against a frozen reference (Rafailov et
al., 2023; the sigmoid loss).

The reference is the base with the adapter off (LoRA) or the initial weights (full); its
log-probabilities of every pair are computed once before the first step. The torch side is
``engine.methods.dpo.train``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.methods.contract import Chart, Method
from engine.methods.preference_options import PAIRS, PreferenceOptions


class DpoOptions(PreferenceOptions):
    """DPO: the sigmoid loss of the implicit rewards' margin, against a frozen reference."""

    objective: Literal["dpo"] = Field("dpo", description="direct preference optimization")
    beta: float = Field(
        0.1,
        gt=0,
        le=100,
        description=(
            "how far the policy may move from the reference: smaller lets it move further (0.1 is usual)"
        ),
        title="Beta",
    )

    def needs_reference(self) -> bool:
        return True


METHOD = Method(
    name="dpo",
    title="DPO (direct preference optimization)",
    description=(
        "preference tuning against a frozen reference: the sigmoid DPO loss on pairs of a preferred "
        "and a rejected answer"
    ),
    options=DpoOptions,
    data_format="preference",
    needs=PAIRS,
    metric_keys=(
        "dpo/reward_margin",
        "dpo/reward_accuracy",
        "dpo/chosen_reward",
        "dpo/rejected_reward",
        "dpo/pairs",
    ),
    charts=(
        Chart(
            id="reward-margin-chart",
            title="Rewards (DPO)",
            hint=(
                "Implicit rewards of the preferred (chosen) and rejected answers; the margin is their "
                "difference."
            ),
            ylabel="reward",
            lines=(
                ("margin", "dpo/reward_margin"),
                ("chosen", "dpo/chosen_reward"),
                ("rejected", "dpo/rejected_reward"),
            ),
        ),
        Chart(
            id="reward-accuracy-chart",
            title="Reward accuracy (DPO)",
            hint="The share of pairs whose preferred answer gets the higher reward.",
            ylabel="accuracy",
            lines=(("accuracy", "dpo/reward_accuracy"),),
            share=True,
        ),
    ),
    example="pair",
    example_sequences="2 sequences (preferred and rejected)",
    order=10,
)
