"""ORPO (``method.objective: "orpo"``): reference-free preference tuning (Hong et al., 2024).

A pair's loss is the preferred answer's negative log-likelihood plus beta (the paper's lambda)
times the odds-ratio loss of the preferred over the rejected answer. The torch side is
``engine.methods.orpo.train``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.methods.contract import Chart, Method
from engine.methods.preference_options import PAIRS, PreferenceOptions


class OrpoOptions(PreferenceOptions):
    """ORPO: the preferred answer's likelihood plus a weighted odds-ratio loss; no reference."""

    objective: Literal["orpo"] = Field("orpo", description="odds-ratio preference optimization")
    beta: float = Field(
        0.1,
        gt=0,
        le=100,
        description=(
            "the weight of the odds-ratio loss against the preferred answer's likelihood (0.1 is usual)"
        ),
        title="Beta",
    )


METHOD = Method(
    name="orpo",
    title="ORPO (odds-ratio preference optimization)",
    description=(
        "reference-free preference tuning: the preferred answer's negative log-likelihood plus beta "
        "times the odds-ratio loss of the preferred over the rejected answer"
    ),
    options=OrpoOptions,
    data_format="preference",
    needs=PAIRS,
    metric_keys=(
        "orpo/nll",
        "orpo/odds_ratio_loss",
        "orpo/log_odds_ratio",
        "orpo/reward_accuracy",
        "orpo/chosen_logp",
        "orpo/rejected_logp",
        "orpo/pairs",
    ),
    charts=(
        Chart(
            id="reward-margin-chart",
            title="Odds ratio (ORPO)",
            hint=(
                "The log odds ratio of the preferred over the rejected answer, and each answer's mean "
                "token log-probability."
            ),
            ylabel="log odds",
            lines=(
                ("log odds ratio", "orpo/log_odds_ratio"),
                ("chosen", "orpo/chosen_logp"),
                ("rejected", "orpo/rejected_logp"),
            ),
        ),
        Chart(
            id="reward-accuracy-chart",
            title="Accuracy (ORPO)",
            hint="The share of pairs whose preferred answer has the higher odds.",
            ylabel="accuracy",
            lines=(("accuracy", "orpo/reward_accuracy"),),
            share=True,
        ),
    ),
    example="pair",
    example_sequences="2 sequences (preferred and rejected)",
    order=20,
)
