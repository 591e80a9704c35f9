"""KTO (``method.objective: "kto"``): Kahneman-Tversky optimization on unpaired rows
(Ethayarajh et al., 2024; the definitions of TRL's ``KTOTrainer``, whose loss LLaMA-Factory's
``kto`` stage uses too).

Each row is a prompt, one completion and whether the completion is desirable (the ``kto`` data
format). With ``r = logp_policy - logp_reference`` the completion's log-ratio and ``z`` the
batch's KL estimate, the loss of a desirable row is ``desirable_weight * (1 - sigmoid(beta *
(r - z)))``, of an undesirable one ``undesirable_weight * (1 - sigmoid(beta * (z - r)))``; a
batch's loss is their mean. ``z`` is ``max(0, mean(logp_policy - logp_reference))`` over the
batch's mismatched rows (each prompt with another row's completion), detached. The torch side is
``engine.methods.kto.train``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from engine.methods.contract import Chart, Method, MethodOptions, refuse_packing_and_router_loss

if TYPE_CHECKING:
    from engine.config import TrainConfig


class KtoOptions(MethodOptions):
    """KTO: a prospect-theory loss on completions labelled desirable or not, against a frozen
    reference (the base with the adapter off, or the initial weights)."""

    objective: Literal["kto"] = Field("kto", description="Kahneman-Tversky optimization")
    beta: float = Field(
        0.1,
        gt=0,
        le=100,
        description="how far the policy may move from the reference (TRL's beta; 0.1 is usual)",
        title="Beta",
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        le=100,
        description=(
            "the weight of a desirable row's loss; with more undesirable than desirable rows, raise "
            "it so that desirable_weight x desirable rows is 1 to 4/3 times undesirable_weight x "
            "undesirable rows"
        ),
        title="Desirable weight",
    )
    undesirable_weight: float = Field(
        1.0, gt=0, le=100, description="the weight of an undesirable row's loss", title="Undesirable weight"
    )

    def sequences_per_example(self) -> int:
        return 2  # the row, and its mismatched row (the KL estimate's)

    def needs_reference(self) -> bool:
        return True

    def check(self, config: TrainConfig) -> None:
        refuse_packing_and_router_loss(config, "trains on whole rows")


METHOD = Method(
    name="kto",
    title="KTO (Kahneman-Tversky optimization)",
    description=(
        "preference tuning on unpaired rows: one completion a prompt, labelled desirable or not, "
        "against a frozen reference"
    ),
    options=KtoOptions,
    data_format="unpaired",
    needs="unpaired rows (prompt, completion and a boolean label: true = desirable)",
    metric_keys=(
        "kto/kl",
        "kto/chosen_reward",
        "kto/rejected_reward",
        "kto/reward_margin",
        "kto/desirable",
        "kto/undesirable",
    ),
    charts=(
        Chart(
            id="reward-margin-chart",
            title="Rewards (KTO)",
            hint=(
                "Implicit rewards (beta times the log-ratio to the reference) of the desirable and the "
                "undesirable completions, and their difference."
            ),
            ylabel="reward",
            lines=(
                ("margin", "kto/reward_margin"),
                ("desirable", "kto/chosen_reward"),
                ("undesirable", "kto/rejected_reward"),
            ),
        ),
        Chart(
            id="kto-kl-chart",
            title="KL estimate (KTO)",
            hint="The batch's estimate of the policy's KL divergence from the reference (the z in the loss).",
            ylabel="KL",
            lines=(("KL", "kto/kl"),),
        ),
    ),
    example="row",
    example_sequences="2 sequences (the completion, and forward only a mismatched one for the KL estimate)",
    order=25,
)
