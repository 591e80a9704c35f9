"""The training methods: one registry, one module per method.

Adding a method is one ``MethodEntry`` in ``METHODS`` and its module: the run configuration
(``method.objective``), the run loop (``engine.training.run``), the planner, the service and the
web form all read this table. An entry says what the method trains on and how: its config
fields, the data format, the sequences each example becomes, whether a reference pass runs
before the first step, the metrics it logs. Its module holds the fused stage's loss (an
``engine.parallel.objective.Objective``) and the run-side object (``MethodRun``) the loop
drives. Nothing here imports torch; a method's module is imported when a run needs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.errors import ConfigError
from engine.optimizers import choices

if TYPE_CHECKING:
    from engine.methods.base import MethodRun
    from engine.parallel.objective import Objective

TUNINGS = ("lora", "full")


@dataclass(frozen=True)
class MethodEntry:
    """One training method.

    Attributes:
        name: the ``method.objective`` value, e.g. ``"dpo"``.
        title: a short label for listings and the web form.
        description: one sentence for listings and error messages.
        data_format: the rows it trains on: ``"supervised"`` (chat, instruction,
            prompt/completion or text), ``"preference"`` (a prompt with a preferred and a
            rejected answer) or ``"prompts"`` (a prompt whose completions are sampled and graded).
        sequences_per_example: the sequences one example becomes (a preference pair: 2; a
            prompt: its group, ``method.group_size``, which the planner reads from the job).
        needs_reference: a reference pass over every example runs once before the first step.
        config_fields: the ``method.*`` fields it reads besides what trains (``tuning``) and the
            LoRA settings, each with what it means for this method.
        metric_keys: the metrics it logs besides ``loss/train`` and ``loss/val``.
        module: the module holding its fused-stage loss (``OBJECTIVE``, an
            ``engine.parallel.objective.Objective`` class) and its ``MethodRun`` (``RUN``).
    """

    name: str
    title: str
    description: str
    data_format: Literal["supervised", "preference", "prompts"]
    sequences_per_example: int
    needs_reference: bool
    config_fields: dict[str, str]
    metric_keys: tuple[str, ...]
    module: str

    def run_class(self) -> type[MethodRun]:
        """The method's ``MethodRun`` class (imports its module, and torch)."""
        run: type[MethodRun] = importlib.import_module(self.module).RUN
        return run

    def objective_class(self) -> type[Objective]:
        """The method's fused-stage loss: its ``Objective`` class (imports its module, and torch)."""
        objective: type[Objective] = importlib.import_module(self.module).OBJECTIVE
        return objective

    def listing(self) -> dict[str, Any]:
        """The entry as JSON for the service's method listing."""
        return {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "data_format": self.data_format,
            "sequences_per_example": self.sequences_per_example,
            "needs_reference": self.needs_reference,
            "config_fields": dict(self.config_fields),
            "metric_keys": list(self.metric_keys),
            "tunings": list(TUNINGS),
        }


METHODS: dict[str, MethodEntry] = {
    "sft": MethodEntry(
        name="sft",
        title="Supervised fine-tuning",
        description=(
            "next-token cross entropy on the answers of chat, instruction, prompt/completion or text rows"
        ),
        data_format="supervised",
        sequences_per_example=1,
        needs_reference=False,
        config_fields={},
        metric_keys=("accuracy/train", "accuracy/val"),
        module="engine.methods.sft",
    ),
    "dpo": MethodEntry(
        name="dpo",
        title="DPO (direct preference optimization)",
        description=(
            "preference tuning against a frozen reference: the sigmoid DPO loss on pairs of a preferred "
            "and a rejected answer"
        ),
        data_format="preference",
        sequences_per_example=2,
        needs_reference=True,
        config_fields={
            "beta": (
                "how far the model may move from the reference: smaller lets it move further (0.1 is usual)"
            )
        },
        metric_keys=(
            "dpo/reward_margin",
            "dpo/reward_accuracy",
            "dpo/chosen_reward",
            "dpo/rejected_reward",
            "dpo/pairs",
        ),
        module="engine.methods.dpo",
    ),
    "orpo": MethodEntry(
        name="orpo",
        title="ORPO (odds-ratio preference optimization)",
        description=(
            "reference-free preference tuning: the preferred answer's negative log-likelihood plus beta "
            "times the odds-ratio loss of the preferred over the rejected answer"
        ),
        data_format="preference",
        sequences_per_example=2,
        needs_reference=False,
        config_fields={
            "beta": (
                "the weight of the odds-ratio loss against the preferred answer's likelihood (0.1 is usual)"
            )
        },
        metric_keys=(
            "orpo/nll",
            "orpo/odds_ratio_loss",
            "orpo/log_odds_ratio",
            "orpo/reward_accuracy",
            "orpo/chosen_logp",
            "orpo/rejected_logp",
            "orpo/pairs",
        ),
        module="engine.methods.orpo",
    ),
    "grpo": MethodEntry(
        name="grpo",
        title="GRPO (reinforcement fine-tuning with graders)",
        description=(
            "reinforcement fine-tuning: each step samples a group of completions per prompt, scores them "
            "with a grader and trains on the group-relative advantages (GRPO's clipped objective)"
        ),
        data_format="prompts",
        sequences_per_example=4,
        needs_reference=False,
        config_fields={
            "grader": (
                "the grader that scores each completion (string_check, text_similarity, python, multi, ...)"
            ),
            "group_size": "completions sampled per prompt (4-16 is usual)",
            "max_completion_tokens": "the longest completion sampled",
            "temperature": "the sampling temperature (1.0 is usual)",
            "top_p": "nucleus sampling's probability mass (1: off)",
            "beta": (
                "the weight of the KL term to the reference (0: none): the base model for LoRA, a frozen "
                "copy of the initial weights in host memory for a full fine-tune"
            ),
            "epsilon": "the clip of the policy ratio (0.2 is usual)",
            "epsilon_high": "the clip above 1 when it differs (DAPO's clip-higher, e.g. 0.28)",
            "loss_type": "grpo (per completion), dapo (per token) or dr_grpo (no length bias)",
            "scale_rewards": "divide each group's advantages by its rewards' spread",
            "num_iterations": (
                "optimizer steps on each batch of completions (the paper's mu; 1 is usual, 2-4 reuse "
                "expensive rollouts, the clipped ratio bounding the later steps)"
            ),
        },
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
        module="engine.methods.grpo",
    ),
}

OBJECTIVES = tuple(METHODS)


def method_names() -> tuple[str, ...]:
    """The registered method names, in registry order."""
    return OBJECTIVES


def method_entry(name: str, *, field: str = "method.objective") -> MethodEntry:
    """The registry entry of ``name``.

    Raises:
        ConfigError: ``name`` is not registered (names the field, the value and the choices).
    """
    entry = METHODS.get(name)
    if entry is None:
        raise ConfigError(field, f"{field}={name!r}: must be {choices(method_names())}", value=name)
    return entry


def methods_listing() -> list[dict[str, Any]]:
    """Every method as JSON, in registry order (``GET /api/methods``)."""
    return [m.listing() for m in METHODS.values()]


def sequences_per_example(name: str, group_size: int | None = None) -> int:
    """The sequences one example of method ``name`` trains: its entry's, or for a method that
    samples groups (GRPO) the job's ``group_size`` when given."""
    entry = method_entry(name)
    if entry.data_format == "prompts" and group_size is not None:
        return group_size
    return entry.sequences_per_example


def preference_methods() -> tuple[str, ...]:
    """The methods that train on preference rows."""
    return tuple(n for n, m in METHODS.items() if m.data_format == "preference")
