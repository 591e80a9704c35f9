"""The OpenAI fine-tuning API's shapes (``file``, ``fine_tuning.job``, ``fine_tuning.job.event``,
``fine_tuning.job.checkpoint``, ``model``, ``list``), as OpenAI documents them, plus the
``roundhouse`` field: our own extension, which OpenAI's clients ignore (in a request, pass it with
``extra_body={"roundhouse": {...}}``)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model

from engine import MAX_SEED
from engine.graders import GraderJson
from engine.methods import METHODS
from server.schemas import (
    LINE_PATTERN,
    CheckpointSection,
    DataOptions,
    EngineSection,
    EvalSection,
    HyperSection,
    Line,
    MethodSection,
    SweepRange,
)
from server.services.openai_compat import (
    AUTO_BATCH_SIZE,
    AUTO_BETA,
    AUTO_EPOCHS,
    AUTO_LEARNING_RATE_MULTIPLIER,
    BASE_LEARNING_RATE,
    EXTENSIONS,
    METHOD_TYPES,
    takes_beta,
)

Auto = Literal["auto"]
JobState = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=LINE_PATTERN)]
MetadataValue = Annotated[str, StringConstraints(max_length=512, pattern=LINE_PATTERN)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]
AUTO_DEFAULTS = (
    f'"auto" (or left out) is: n_epochs {AUTO_EPOCHS}, batch_size {AUTO_BATCH_SIZE}, '
    f"learning_rate_multiplier {AUTO_LEARNING_RATE_MULTIPLIER:g} "
    f"(of a base rate of {BASE_LEARNING_RATE['lora']:g} for LoRA, "
    f"{BASE_LEARNING_RATE['full']:g} for full weights, or roundhouse.hyper.learning_rate), beta {AUTO_BETA:g}"
)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    param: str | None = Field(description="the offending parameter (dotted), if one")
    code: str | None = Field(description="machine-readable, e.g. not_found, invalid_dataset")


class OpenAIErrorBody(BaseModel):
    """The error of every failed ``/v1`` request (OpenAI's shape; a request that does not validate
    is a 400)."""

    error: OpenAIErrorDetail


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a ``/v1`` route: its error statuses, and any other error ("default", in
    place of FastAPI's 422, which ``/v1`` answers as a 400), in OpenAI's error shape."""
    other = {"default": {"model": OpenAIErrorBody, "description": "an error"}}
    return other | {s: {"model": OpenAIErrorBody, "description": HTTPStatus(s).phrase} for s in statuses}


# -- requests ------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Hyperparameters(_Request):
    """Each "auto" (or left out) is the stated default."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_extra={"description": AUTO_DEFAULTS}
    )

    batch_size: Auto | Annotated[int, Field(ge=1, le=1 << 20)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=1000)] = "auto"
    n_epochs: Auto | Annotated[int, Field(ge=1, le=1000)] = "auto"


class DpoHyperparameters(Hyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = "auto"


class ReinforcementHyperparameters(Hyperparameters):
    """OpenAI's reinforcement hyperparameters: ``eval_interval`` is how often the validation
    prompts are graded (``eval.every_steps``); ``reasoning_effort``, ``compute_multiplier`` and
    ``eval_samples`` are accepted and have no effect here (GRPO's own settings, group_size,
    max_completion_tokens, temperature, beta, loss_type, ..., go in roundhouse.method)."""

    eval_interval: Auto | Annotated[int, Field(ge=1, le=1 << 20)] = "auto"
    eval_samples: Auto | Annotated[int, Field(ge=1, le=1 << 20)] = "auto"
    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=1000)] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class SupervisedMethod(_Request):
    hyperparameters: Hyperparameters | None = None


class DpoMethod(_Request):
    hyperparameters: DpoHyperparameters | None = None


class ReinforcementMethod(_Request):
    grader: GraderJson = Field(
        description="the grader that scores each sampled completion, in OpenAI's shapes: string_check, "
        "text_similarity, python, multi (and ours: regex, json_schema, length); "
        "POST /v1/fine_tuning/alpha/graders/validate checks one"
    )
    hyperparameters: ReinforcementHyperparameters | None = None


# method.type: OpenAI's (supervised, dpo, reinforcement) and our extension's, every other method
# of the registry by its own name (engine.methods: orpo, kto, ...)
MethodType: Any = Literal[tuple(METHOD_TYPES)]
METHOD_TYPE_HELP = "; ".join(
    [
        'supervised: a LoRA adapter (or every weight: roundhouse.method.tuning "full")',
        "dpo: preference tuning (roundhouse.method.tuning lora or full)",
        *(f"{t} (our extension): {METHODS[METHOD_TYPES[t]].description}" for t in EXTENSIONS),
        "reinforcement: GRPO on a file of prompts, each completion scored by reinforcement.grader "
        "(group_size, max_completion_tokens, temperature, beta, loss_type, ...: roundhouse.method)",
    ]
)


def _extension(method_type: str, beta: type[BaseModel], plain: type[BaseModel]) -> Any:
    """The request's (or the job's) options of an extension's method: hyperparameters with its
    beta when its options have one."""
    objective = METHOD_TYPES[method_type]
    title = METHODS[objective].title
    chosen = beta if takes_beta(objective) else plain
    return (chosen | None, Field(None, description=f"our extension, {title}: as dpo's"))


class OpenAIMethod(_Request):
    """The method types OpenAI has; ``Method`` adds our extension's."""

    type: str = Field(description=METHOD_TYPE_HELP)
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


Method = create_model(
    "Method",
    __base__=OpenAIMethod,
    type=(MethodType, Field(description=METHOD_TYPE_HELP)),
    **{t: _extension(t, DpoMethod, SupervisedMethod) for t in EXTENSIONS},
)


class RoundhouseOptions(_Request):
    """Our extension: the sections of ``POST /api/jobs`` (``engine.config.TrainConfig``), e.g.
    ``{"method": {"lora_r": 8, "lora_alpha": 16}, "hyper": {"max_steps": 100}, "engine":
    {"num_microbatches": 4}}``. The OpenAI fields, where given, override what these set."""

    data: DataOptions = Field(default_factory=lambda: DataOptions())
    method: MethodSection = Field(
        default_factory=dict,
        description="the method's own options and what trains (tuning, lora_r, ...); its objective is "
        "method.type's",
    )
    hyper: HyperSection = Field(default_factory=dict, description="max_steps, learning_rate, schedule, ...")
    engine: EngineSection = Field(default_factory=dict, description="devices, num_microbatches, ...")
    checkpoint: CheckpointSection = Field(default_factory=dict, description="every_steps, keep_last")
    eval: EvalSection = Field(default_factory=dict, description="every_steps")


class FineTuningJobCreate(_Request):
    """A fine-tuning job (OpenAI's request, and our extension); "auto" hyperparameters are the
    stated defaults (see ``hyperparameters``)."""

    model: Line = Field(description='a base model name from GET /v1/models (e.g. "demo")')
    training_file: Line = Field(description="a file id from POST /v1/files")
    validation_file: Line | None = None
    suffix: (
        Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] | None
    ) = Field(None, description="part of the job's name and of fine_tuned_model: letters, digits, . _ -")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="a random one if not given"
    )
    metadata: Metadata | None = Field(
        None, description="up to 16 pairs: keys of 64, values of 512 characters"
    )
    hyperparameters: Hyperparameters | None = Field(
        None, description=f"deprecated: use method; {AUTO_DEFAULTS}"
    )
    method: Method | None = None  # type: ignore[valid-type]
    integrations: list[dict[str, Any]] | None = Field(
        None,
        description='[{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}]: the run logs to '
        'W&B (the key: ROUNDHOUSE_WANDB_API_KEY); our extension: wandb.mode "offline"',
    )
    roundhouse: RoundhouseOptions | None = Field(
        None, description="Roundhouse's extension: TrainConfig sections (LoRA rank, engine settings, ...)"
    )


# -- responses -----------------------------------------------------------------------------------
class FileObject(BaseModel):
    id: str = Field(
        description='"file-" and the dataset id of /api/datasets; a job\'s result file: '
        '"file-results-<job id>"'
    )
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["fine-tune", "fine-tune-results"] = "fine-tune"
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    roundhouse: dict[str, Any] = Field(
        description="the dataset: id, name, format, rows, sha256; a result file: job_id, and the metric "
        "key of each column"
    )


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


# batch_size, learning_rate_multiplier, n_epochs, and beta for dpo: as the job runs them
JobHyperparameters = Annotated[
    dict[str, float | int | str | None],
    Field(
        description="batch_size, learning_rate_multiplier, n_epochs (and beta: dpo, orpo; beta, "
        "eval_interval, group_size, max_completion_tokens: reinforcement), as resolved"
    ),
]


class JobMethodOptions(BaseModel):
    hyperparameters: JobHyperparameters


class JobReinforcement(JobMethodOptions):
    grader: GraderJson = Field(description="the grader that scores each completion, as given")


class OpenAIJobMethod(BaseModel):
    """A job's method as OpenAI shows it; ``JobMethod`` adds our extension's types."""

    type: str
    supervised: JobMethodOptions | None = None
    dpo: JobMethodOptions | None = None
    reinforcement: JobReinforcement | None = None


_JOB_EXTENSIONS: dict[str, Any] = {t: (JobMethodOptions | None, None) for t in EXTENSIONS}
JobMethod = create_model(
    "JobMethod",
    __base__=OpenAIJobMethod,
    type=(MethodType, ...),
    **_JOB_EXTENSIONS,
)


class FineTuningJob(BaseModel):
    id: str = Field(description='"ftjob-" and the job id of /api/jobs')
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None = Field(
        description='when succeeded: "ft:<base>:<suffix or roundhouse>:<job id>", its latest checkpoint; '
        "POST /api/generate takes it as model, GET /v1/models/{model}/content downloads it"
    )
    finished_at: int | None
    hyperparameters: JobHyperparameters
    model: str
    organization_id: str
    result_files: list[str] = Field(
        description="once it stopped after a step: its result file, a CSV of step, train_loss, "
        "train_accuracy, valid_loss, valid_mean_token_accuracy (GET /v1/files/{id}/content)"
    )
    seed: int
    status: JobState = Field(
        description="ours mapped: validating -> validating_files; queued, interrupted -> queued; "
        "running, cancelling, pausing -> running; succeeded, failed, cancelled, paused as they are "
        "(roundhouse.status has ours)"
    )
    trained_tokens: int | None = Field(
        description="once it stopped: the tokens of the batches of its steps, padding left out (every epoch "
        "counts: the training file's tokens times the epochs, for a run to the end)"
    )
    training_file: str = Field(description="its file; it may have been deleted since it finished")
    validation_file: str | None
    estimated_finish: int | None = Field(
        description="while running, after its first step: when the run expects to end (else null)"
    )
    integrations: list[dict[str, Any]]
    metadata: dict[str, str] | None
    method: JobMethod  # type: ignore[valid-type]
    roundhouse: dict[str, Any] = Field(description="our job: job_id, name, status, step, total_steps")


class FineTuningJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class FineTuningJobEvent(BaseModel):
    id: str = Field(description='"ftevent-" and the event id of /api/jobs/{id}/events')
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None
    type: Literal["message", "metrics"]


class FineTuningJobEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    model_config = ConfigDict(extra="allow")

    step: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str = Field(description='"ftckpt-<job id>-<step>"')
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(
        description='"ft:<base>:<suffix or roundhouse>:<job id>:ckpt-step-<step>": POST /api/generate '
        "takes it as model, GET /v1/models/{model}/content downloads it"
    )
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int
    roundhouse: dict[str, Any] = Field(description="kind (adapter or full) and our download route")


class FineTuningJobCheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class SweepOptions(_Request):
    """Our extension: how a sweep searches (``POST /api/sweeps`` without its ``job``)."""

    name: Line | None = None
    search: Literal["grid", "random"] = "grid"
    parameters: dict[str, list[float] | SweepRange] = Field(
        description='field -> values, or {"min", "max", "log"} (random): learning_rate, lora_r, lora_alpha, '
        "epochs, batch_size, beta, ..."
    )
    trials: int | None = Field(None, ge=1, le=64)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    metric: Line = "loss/val"
    goal: Literal["minimize", "maximize"] = "minimize"
    early_stopping: bool = False


class FineTuningSweepCreate(FineTuningJobCreate):
    """Our extension: a fine-tuning job request whose hyperparameters a sweep searches."""

    sweep: SweepOptions
