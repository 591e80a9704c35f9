"""GRPO (``method.objective: "grpo"``): reinforcement fine-tuning on prompts scored by a grader
(Shao et al., 2024; with DAPO's and Dr. GRPO's loss variants).

Each step samples ``group_size`` completions of each prompt, scores them with the grader and
trains on the group-relative advantages with the clipped ratio objective, ``num_iterations``
steps a batch. The torch side is ``engine.methods.grpo.train``; the sampling
``engine.methods.rollouts``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_serializer, model_validator

from engine.errors import ConfigError
from engine.graders import GraderSpec, as_given, validate_grader
from engine.methods.contract import Chart, Method, MethodOptions, Rollouts, refuse_packing_and_router_loss

if TYPE_CHECKING:
    from engine.config import TrainConfig


class GrpoOptions(MethodOptions):
    """GRPO: group-relative advantages of graded completions, the clipped ratio objective."""

    objective: Literal["grpo"] = Field("grpo", description="reinforcement fine-tuning with a grader")
    grader: GraderSpec | None = Field(
        None,
        description=(
            "the grader that scores each completion, in OpenAI's shapes: string_check, "
            "text_similarity, python, multi, or ours: regex, json_schema, length "
            "(POST /v1/fine_tuning/alpha/graders/validate checks one)"
        ),
        title="Grader",
    )
    group_size: int = Field(
        4, ge=2, le=64, description="completions sampled per prompt (4-16 is usual)", title="Group size"
    )
    max_completion_tokens: int = Field(
        64, ge=1, le=32_768, description="the longest completion sampled", title="Max completion tokens"
    )
    temperature: float = Field(
        1.0, gt=0, le=10, description="the sampling temperature (1.0 is usual)", title="Temperature"
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling's probability mass (1: off)", title="Top p"
    )
    beta: float = Field(
        0.0,
        ge=0,
        le=100,
        description=(
            "the weight of the KL term to the reference (0: none): a LoRA run's base with the adapter "
            "off, a full fine-tune's frozen copy of its initial weights in host memory"
        ),
        title="Beta (KL)",
    )
    epsilon: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="the ratio's clip below 1 (and above, by default)",
        title="Clip (epsilon)",
    )
    epsilon_high: float | None = Field(
        None,
        gt=0,
        le=10,
        description="the ratio's clip above 1 (DAPO's clip-higher, e.g. 0.28; default epsilon)",
        title="Clip above (epsilon high)",
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo",
        description=(
            "how token losses average: per completion then over completions (grpo), over every token "
            "of the batch (dapo), or over completions x max_completion_tokens (dr_grpo)"
        ),
        title="Loss",
    )
    scale_rewards: bool = Field(
        True,
        description="divide each group's advantages by its rewards' std (Dr. GRPO: false)",
        title="Scale rewards",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=16,
        description=(
            "optimizer steps on each batch of completions (the paper's mu, TRL's num_iterations): the "
            "batch's prompts, completions, rewards and the policy's log-probabilities from before the "
            "first of them are reused, so the clipped ratio bounds how far the later steps move; 1: one "
            "step per batch (the ratio is 1)"
        ),
        title="Steps per batch",
    )

    base_bits: Literal[16, 4] = Field(
        16,
        description="GRPO samples on the host with the model's own weights: its base stays in 16 bits",
        title="Base bits",
        json_schema_extra={"enum": [16]},  # 4 is refused (below), with why
    )

    def sequences_per_example(self) -> int:
        return self.group_size

    def steps_per_batch(self) -> int:
        return self.num_iterations

    def rollouts(self) -> Rollouts:
        return Rollouts(self.group_size, self.max_completion_tokens, self.beta > 0, self.num_iterations)

    def batch_rows(self, batch_size: int) -> tuple[int, str]:
        return (
            batch_size * self.group_size,
            f"hyper.batch_size={batch_size} x method.group_size={self.group_size}",
        )

    def check(self, config: TrainConfig) -> None:
        refuse_packing_and_router_loss(config, "samples whole completions")
        if config.data.max_length - self.max_completion_tokens < 1:
            raise ConfigError(
                "method.max_completion_tokens",
                f"method.max_completion_tokens={self.max_completion_tokens} leaves no room for the prompt "
                f"within data.max_length={config.data.max_length}",
                value=self.max_completion_tokens,
            )

    @model_validator(mode="after")
    def _samples_on_the_host(self) -> GrpoOptions:
        if self.base_bits == 4:
            raise ConfigError(
                "base_bits",
                "method.base_bits=4: GRPO samples on the host with the model's own weights, and a "
                "4-bit base keeps none there; use base_bits 16",
                value=4,
            )
        return self

    @field_serializer("grader")
    def _grader_as_given(self, grader: GraderSpec | None) -> dict[str, Any] | None:
        return None if grader is None else as_given(grader)  # the job keeps the JSON it was given

    @model_validator(mode="after")
    def _a_valid_grader(self) -> GrpoOptions:
        if self.grader is None:
            raise ConfigError("grader", "method.grader: GRPO needs a grader that scores completions")
        try:
            validate_grader(self.grader, field="method.grader").close()
        except ConfigError as exc:  # its field relative to this section, as every other's
            raise ConfigError(exc.field.removeprefix("method."), str(exc), value=exc.value) from None
        return self


METHOD = Method(
    name="grpo",
    title="GRPO (reinforcement fine-tuning with graders)",
    description=(
        "reinforcement fine-tuning: each step samples a group of completions per prompt, scores them "
        "with a grader and trains on the group-relative advantages (GRPO's clipped objective)"
    ),
    options=GrpoOptions,
    data_format="prompts",
    needs=(
        "prompt rows ('messages' ending with a user turn, or 'prompt' without a completion) and the "
        "fields its grader reads"
    ),
    metric_keys=(
        "reward/mean",
        "reward/min",
        "reward/max",
        "reward/std",
        "reward/val",
        "grpo/kl",
        "grpo/clip_fraction",
        "grpo/grader_errors",
        "completion/length",
        "completion/length_max",
        "completion/finished",
    ),
    charts=(
        Chart(
            id="reward-chart",
            title="Rewards (GRPO)",
            hint=(
                "The grader's scores of each step's completions, and of greedy completions of the "
                "validation prompts."
            ),
            ylabel="reward",
            lines=(
                ("mean", "reward/mean"),
                ("min", "reward/min"),
                ("max", "reward/max"),
                ("validation", "reward/val"),
            ),
            more="reward/",
        ),
        Chart(
            id="grpo-chart",
            title="KL, clipping and reward spread (GRPO)",
            hint=(
                "How far the policy moved from the base model (beta's KL term), the share of tokens whose "
                "ratio was clipped, and how much rewards differ within a prompt's group (none: nothing "
                "to learn from)."
            ),
            ylabel="value",
            lines=(
                ("KL to the base", "grpo/kl"),
                ("clipped share", "grpo/clip_fraction"),
                ("reward std in a group", "reward/std"),
            ),
        ),
        Chart(
            id="completion-chart",
            title="Completion length (GRPO)",
            hint="Tokens per sampled completion.",
            ylabel="tokens",
            lines=(("mean", "completion/length"), ("longest", "completion/length_max")),
        ),
    ),
    order=30,
)
