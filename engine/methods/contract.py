"""What a training method is, as every part of the product reads it; no torch import.

A method is a package ``engine.methods.<name>``: its ``__init__`` defines ``METHOD``, a
``Method`` (what it is called, the rows it trains on, the metrics it logs and how the job page
charts them) whose ``options`` is a pydantic model derived from ``MethodOptions``: the fields every
method shares (what trains, the LoRA settings) and its own, with its refusals as validators
(``check`` for those that read other sections of the run). Its ``train`` module holds the torch
side: the fused stage's loss (``OBJECTIVE``, an ``engine.parallel.objective.Objective`` class) and
the run-side object the loop drives (``RUN``, an ``engine.methods.base.MethodRun`` class).

The run configuration (``engine.config``), the planner, the service's API schema and the web form
all read these: a method's options are written once.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.errors import ConfigError
from engine.model.families import DEFAULT_LORA_TARGETS

if TYPE_CHECKING:
    from engine.config import TrainConfig
    from engine.methods.base import MethodRun
    from engine.parallel.objective import Objective

TUNINGS = ("lora", "full")
# the rows a method trains on (engine.data's formats each serve one of these)
DataFamily = Literal["supervised", "preference", "prompts", "unpaired"]
# a LoRA target parameter: a dotted path suffix ending in the parameter's name
_PARAMETER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class Rollouts:
    """What a method samples each batch before it trains (``engine.planner.rollouts`` prices it).

    Attributes:
        group_size: completions sampled per prompt.
        completion_tokens: the longest completion.
        kl_reference: each step also takes a reference's log-probabilities of the completions.
        steps_per_batch: optimizer steps each sampled batch trains.
    """

    group_size: int
    completion_tokens: int
    kl_reference: bool
    steps_per_batch: int


class MethodOptions(BaseModel):
    """The ``method`` section of a run: what trains and how, common to every method.

    A method's own options subclass this with ``objective`` narrowed to its name. After
    validation ``kind`` and ``dpo_tuning`` read the earlier one-word form of the same choice
    (stored jobs and API clients may still send it: ``engine.methods.legacy``).
    """

    # no inf or NaN (JSON has neither; Python's parser takes ``Infinity``): no bound holds them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)

    objective: str = Field(
        "sft",
        description="the training method (GET /api/methods lists them with their options)",
        title="Method",
    )
    tuning: Literal["lora", "full"] = Field(
        "lora", description='what trains: a LoRA adapter ("lora") or every weight ("full")', title="Trains"
    )
    lora_r: int = Field(16, ge=1, le=4096, description="the LoRA rank", title="LoRA rank")
    lora_alpha: float = Field(
        32.0, gt=0, le=1e6, description="the LoRA scale's numerator (scale alpha / r)", title="LoRA alpha"
    )
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input", title="LoRA dropout"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="the linear layers LoRA adapts, by name suffix",
        title="LoRA target modules",
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description=(
            "weights LoRA adapts directly (peft target_parameters), e.g. a mixture-of-experts model's "
            '"mlp.experts.gate_up_proj"; "experts" stands for its family\'s expert weights'
        ),
        title="LoRA target parameters",
    )
    base_bits: Literal[16, 4] = Field(
        16,
        description=(
            "LoRA only: 4 keeps the frozen base's block weights in host memory and on the wire in 4 bits "
            "(NF4, the QLoRA format), decoded on the GPUs: about 3.5x less host RAM and PCIe traffic for "
            "them, at the cost of the quantization's error in the base"
        ),
        title="Base bits",
    )

    vision_tower: Literal["frozen", "lora", "full"] = Field(
        "frozen",
        description=(
            "a vision-language model's vision tower: kept frozen, adapted by LoRA (LoRA runs) or "
            "trained whole; a text model takes only frozen"
        ),
        title="Vision tower",
    )
    projector: Literal["frozen", "lora", "full"] = Field(
        "frozen",
        description=(
            "a vision-language model's projector (the layers between the vision tower and the "
            "language model): frozen, LoRA (LoRA runs) or trained whole; a text model takes only frozen"
        ),
        title="Vision projector",
    )

    # the common fields: the web form shows them once, above each method's own
    COMMON: ClassVar[tuple[str, ...]] = (
        "objective",
        "tuning",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "target_parameters",
        "base_bits",
        "vision_tower",
        "projector",
    )

    @property
    def lora(self) -> bool:
        """Whether the run trains a LoRA adapter (any method) rather than every weight."""
        return self.tuning == "lora"

    @property
    def kind(self) -> str:
        """The earlier one-word form: ``"lora"``/``"full"`` for supervised runs, else the method."""
        return self.tuning if self.objective == "sft" else self.objective

    @property
    def dpo_tuning(self) -> str:
        """The earlier name of ``tuning`` for a preference method."""
        return self.tuning

    def own_options(self) -> dict[str, Any]:
        """The method's own fields and their values (not the common ones)."""
        return {k: getattr(self, k) for k in type(self).model_fields if k not in self.COMMON}

    # -- what the run, the planner and the service ask of a method ------------------------------
    def sequences_per_example(self) -> int:
        """The sequences one example becomes in a batch (a preference pair: 2)."""
        return 1

    def steps_per_batch(self) -> int:
        """The optimizer steps each batch trains (GRPO's ``num_iterations``)."""
        return 1

    def batch_rows(self, batch_size: int) -> tuple[int, str]:
        """The sequences a batch of ``batch_size`` examples is cut into micro-batches by (a
        preference pair's two stay in one), and how a message names that count."""
        return batch_size, f"hyper.batch_size={batch_size}"

    def rollouts(self) -> Rollouts | None:
        """What each step samples before it trains (GRPO's completions), for the planner; None:
        nothing."""
        return None

    def needs_reference(self) -> bool:
        """Whether a reference pass over every example runs once before the first step."""
        return False

    def check(self, config: TrainConfig) -> None:
        """Refuse what the method cannot train with in the rest of the run (``data``, ``hyper``,
        ``engine``): a ``ConfigError`` naming the field, relative to the run's root."""

    @field_validator("target_parameters")
    @classmethod
    def _parameter_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not (isinstance(n, str) and _PARAMETER_NAME.fullmatch(n))]
        if bad:
            raise PydanticCustomError(
                "parameter_name",
                "{bad}: each entry must be a dotted parameter name such as 'mlp.experts.down_proj', or "
                "'experts'",
                {"bad": ", ".join(repr(b) for b in bad)},
            )
        return names

    @model_validator(mode="after")
    def _four_bits_need_a_frozen_base(self) -> MethodOptions:
        if self.base_bits == 4 and not self.lora:
            raise ConfigError(
                "base_bits",
                "method.base_bits=4: a 4-bit base is for LoRA (its base does not train); full "
                "fine-tuning updates every weight in 16 or 32 bits",
                value=self.base_bits,
            )
        return self

    @model_validator(mode="after")
    def _parameter_lora_has_no_dropout(self) -> MethodOptions:
        if self.lora and self.target_parameters and self.lora_dropout:
            raise ConfigError(
                "lora_dropout",
                f"method.lora_dropout={self.lora_dropout}: LoRA on parameters (method.target_parameters) "
                "cannot apply dropout; set it to 0",
                value=self.lora_dropout,
            )
        return self


def refuse_packing_and_router_loss(config: TrainConfig, why: str) -> None:
    """The refusal of a method that trains whole examples (pairs, sampled completions): no
    ``data.packing``, and no ``hyper.router_aux_loss`` (its loss is not a token mean)."""
    name = config.method.objective.upper()
    if config.data.packing:
        raise ConfigError("data.packing", f"data.packing=true: {name} {why} and cannot pack them", value=True)
    if config.hyper.router_aux_loss:
        raise ConfigError(
            "hyper.router_aux_loss",
            f"hyper.router_aux_loss=true: not defined for {name}; set it to false",
            value=True,
        )


@dataclass(frozen=True)
class Chart:
    """One chart of the job page: metrics drawn together, one line each.

    Attributes:
        id: the chart element's id on the page.
        title: the card's heading.
        hint: one sentence under it: what the lines mean.
        ylabel: the y axis' label.
        lines: ``(name, metric key)`` of each line, e.g. ``("margin", "dpo/reward_margin")``.
        share: the values are shares in [0, 1] (the axis runs from 0 to 1).
        more: a key prefix whose other metrics join the chart as lines as they arrive (GRPO's
            ``reward/<grader>``), named by the rest of the key.
    """

    id: str
    title: str
    hint: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]
    share: bool = False
    more: str | None = None

    def listing(self) -> dict[str, Any]:
        """The chart as JSON for the service's method listing."""
        return {
            "id": self.id,
            "title": self.title,
            "hint": self.hint,
            "ylabel": self.ylabel,
            "lines": [list(line) for line in self.lines],
            "share": self.share,
            "more": self.more,
        }


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: the ``method.objective`` value, e.g. ``"dpo"``.
        title: a short label for listings and the web form.
        description: one sentence for listings and error messages.
        options: its ``method`` section's model (``objective`` a ``Literal`` of ``name``).
        data_format: the rows it trains on: ``"supervised"`` (chat, instruction,
            prompt/completion or text), ``"preference"`` (a prompt with a preferred and a
            rejected answer), ``"prompts"`` (a prompt whose completions are sampled and graded)
            or ``"unpaired"`` (a prompt, one answer and whether it is desirable).
        needs: what a dataset must hold, for the message that refuses one of another format.
        metric_keys: the metrics it logs besides ``loss/train`` and ``loss/val``.
        charts: how the job page draws them.
        order: its place in listings (the web form's choices).
        example: what one example of its data is called in plans ("pair", "row").
        example_sequences: the sequences an example trains as, in plans ("2 sequences
            (preferred and rejected)").
    """

    name: str
    title: str
    description: str
    options: type[MethodOptions]
    data_format: DataFamily
    needs: str
    metric_keys: tuple[str, ...]
    charts: tuple[Chart, ...] = ()
    order: int = 100
    example: str = "example"
    example_sequences: str = "1 sequence"

    @property
    def module(self) -> str:
        """The module of its torch side."""
        return f"engine.methods.{self.name}.train"

    def defaults(self) -> MethodOptions:
        """Its options with every default, unvalidated (a field with no default, GRPO's grader,
        stays unset): what the method is like when a job does not say."""
        return self.options.model_construct(objective=self.name)

    def run_class(self) -> type[MethodRun]:
        """The method's ``MethodRun`` class (imports its module, and torch)."""
        run: type[MethodRun] = importlib.import_module(self.module).RUN
        return run

    def objective_class(self) -> type[Objective]:
        """The method's fused-stage loss: its ``Objective`` class (imports its module, and torch)."""
        objective: type[Objective] = importlib.import_module(self.module).OBJECTIVE
        return objective

    def listing(self) -> dict[str, Any]:
        """The method as JSON for the service's listing: its options' JSON schema among the rest."""
        defaults = self.defaults()
        fields = type(defaults).model_fields
        return {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "data_format": self.data_format,
            "sequences_per_example": defaults.sequences_per_example(),
            "needs_reference": defaults.needs_reference(),
            "config_fields": {k: fields[k].description or k for k in fields if k not in MethodOptions.COMMON},
            "options_schema": self.options.model_json_schema(),
            "common_fields": list(MethodOptions.COMMON),
            "metric_keys": list(self.metric_keys),
            "charts": [c.listing() for c in self.charts],
            "tunings": list(TUNINGS),
        }
