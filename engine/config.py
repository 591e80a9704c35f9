"""The engine's configurations, validated; no torch import.

``TrainConfig`` (pydantic) is everything a fine-tuning run needs; the service validates job
requests with the same model, so a bad value gets the same message everywhere: the dotted field
name, what is wrong, and the value given. ``EngineConfig`` (a dataclass) is how the RoundPipe
engine itself trains. Both raise ``ConfigError`` (a ``ValueError``) carrying the field.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from engine import methods
from engine.data.formats import FormatChoice
from engine.errors import ConfigError
from engine.methods.contract import MethodOptions
from engine.optimizers import choices, optimizer_names, optimizer_spec
from engine.tracking import uris

DEMO_MODEL = "demo"
# a validator's error context key: the value as a message shows it (instead of the input)
SHOWN = "shown"
# the compute dtypes the engine supports (engine.parallel.host maps them to torch dtypes)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


# Counts of steps (and the step numbers they lead to) stay within a 32-bit signed integer: the
# service keeps a job's step and step count in INTEGER columns, and no run gets near it.
MAX_STEPS = 2**31 - 1
# Seeds stay within 32 bits: numpy's and most samplers' range; the engine derives per-epoch
# seeds as ``seed * 1_000_003 + epoch``, which then stays inside torch's 64-bit seed range.
MAX_SEED = 2**32 - 1


class _Strict(BaseModel):
    # no inf or NaN (JSON has neither; Python's parser takes ``Infinity``): no bound holds them
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False, defer_build=True)


class ModelSpec(_Strict):
    path: str = Field(DEMO_MODEL, description='a local Hugging Face model folder, or "demo"')
    name: str | None = Field(None, description="the name recorded in exports (default: the folder's name)")


class DataSpec(_Strict):
    train: str = Field(..., description="training file: .jsonl, .csv or .parquet")
    validation: str | None = Field(None, description="validation file (same formats)")
    validation_fraction: float = Field(0.0, ge=0.0, le=0.5, description="held out from train when no file")
    format: FormatChoice = Field("auto", description="the rows' format (engine.data.formats), or auto-detect")
    max_length: int = Field(1024, ge=8, le=1_048_576, description="tokens per sequence: a longer row is cut")
    packing: bool = Field(
        False, description="several short rows concatenated into one sequence of up to max_length"
    )
    image_store: str | None = Field(
        None,
        description="the folder of the service's content-addressed image store (sha256: image references)",
    )


# the ``method`` section: the options of the method its ``objective`` names (``engine.methods``;
# to a type checker, what every method's options have in common)
if TYPE_CHECKING:
    MethodSpec = MethodOptions
else:
    MethodSpec = methods.MethodSpec


@functools.cache
def _method_adapter() -> TypeAdapter[Any]:
    """The method section's validator on its own (built on first use: a command that never calls
    ``method_options`` does not pay for it)."""
    return TypeAdapter(MethodSpec)


def method_options(raw: dict[str, Any] | None = None, /, **fields: Any) -> MethodOptions:
    """A ``method`` section validated: its method's options (``raw`` and ``fields`` together).

    Raises:
        ConfigError: naming the field (``method.beta``), as ``TrainConfig.parse`` does.
    """
    try:
        options: MethodOptions = _method_adapter().validate_python({**(raw or {}), **fields})
    except ValidationError as exc:
        errors = [{**e, "loc": ("method", *e["loc"])} for e in exc.errors()]
        raise ConfigError(error_field(errors[0]), "; ".join(_error_line(e) for e in errors)) from None
    return options


def override_method(raw: dict[str, Any], **given: Any) -> dict[str, Any]:
    """A dumped ``method`` section with settings given in the earlier form (``kind``,
    ``dpo_tuning``; None: not given) or any other field put on top: a given ``kind`` replaces the
    dumped objective and tuning, a given ``dpo_tuning`` the dumped tuning."""
    out = dict(raw)
    given = {k: v for k, v in given.items() if v is not None}
    if "kind" in given:
        out.pop("objective", None)
        out.pop("tuning", None)
        out.pop("dpo_tuning", None)
    if "dpo_tuning" in given:
        out.pop("tuning", None)
    out.update(given)
    return out


class HyperSpec(_Strict):
    epochs: float | None = Field(
        1.0, gt=0, le=1000, description="passes over the training rows (a fraction allowed)"
    )
    max_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="optimizer steps to run; when set it decides the run's length"
    )
    batch_size: int = Field(8, ge=1, le=1 << 20, description="sequences per optimizer step")
    learning_rate: float = Field(2e-4, gt=0, le=10, description="the peak learning rate")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="the learning rate after warm-up: constant, or decaying linearly or on a cosine to 0",
    )
    warmup_steps: int = Field(
        0, ge=0, le=MAX_STEPS, description="steps of linear rise from 0 to learning_rate"
    )
    weight_decay: float = Field(0.0, ge=0, le=10, description="decoupled weight decay (AdamW), or L2 for SGD")
    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1e6, description="gradients clipped to this global norm (null: no clipping)"
    )
    optimizer: str = Field(
        "adamw", json_schema_extra={"enum": list(optimizer_names())}, description="the host-side optimizer"
    )
    router_aux_loss: bool = Field(
        False, description="mixture-of-experts models: add the routers' load-balancing loss"
    )
    router_aux_loss_coef: float | None = Field(
        None, ge=0, le=1000, description="its weight (default: the model config's router_aux_loss_coef)"
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="seeds the data order, the validation split, LoRA's initialisation and dropout",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "a step whose loss or gradient norm is not finite is skipped (no weight changes); the job "
            "fails after this many in a row"
        ),
    )

    @field_validator("optimizer", mode="before")
    @classmethod
    def _registered(cls, name: Any) -> Any:
        names = optimizer_names()
        if name not in names:
            # worded as pydantic words a Literal, so the message reads like every other choice's
            expected = {"expected": choices(names, "'")}
            raise PydanticCustomError("literal_error", "Input should be {expected}", expected)
        return name

    @model_validator(mode="after")
    def _length(self) -> HyperSpec:
        if self.epochs is None and self.max_steps is None:
            raise ConfigError("epochs", "set epochs or max_steps")
        return self


class EngineSpec(_Strict):
    devices: Literal["auto"] | list[str] = Field(
        "auto",
        description='the workers: "auto" (every GPU of the host, else one CPU worker) or devices ("cuda:0")',
    )
    num_microbatches: int = Field(
        4,
        ge=1,
        le=4096,
        description="pieces a batch is cut into, which flow through the pipeline one after another",
    )
    async_optimizer: bool = Field(
        False, description="the optimizer step overlaps the next step's compute (its weights one step behind)"
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description='"auto": bfloat16 on GPU workers, float32 on CPU workers'
    )
    partition: dict[str, Any] | None = Field(
        None,
        description=(
            "a fixed pipeline partition instead of the planner's: layer counts "
            '{"forward": [...], "fused": N, "backward": [...]}'
        ),
    )
    tf32: bool = Field(True, description="float32 compute on GPUs: let matmuls use TensorFloat-32")


def resolve_compute_dtype(dtype: str, *, on_gpu: bool) -> str:
    """The dtype ``"auto"`` stands for: bfloat16 on GPU workers, float32 on CPU workers.

    The one place this rule lives: the run, the planner and the service all call it.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu else "float32"


class CheckpointSpec(_Strict):
    every_steps: int = Field(
        100, ge=1, le=MAX_STEPS, description="a checkpoint every N steps (and at the end)"
    )
    keep_last: int = Field(3, ge=1, le=10_000, description="checkpoints kept: older ones are deleted")


class EvalSpec(_Strict):
    every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="validation loss every N steps (and at the end)"
    )


class MlflowSpec(_Strict):
    """An MLflow tracking server the run logs to (credentials: the settings or the environment
    variables MLflow reads, never the config)."""

    tracking_uri: str = Field(..., min_length=1, max_length=2000, description="http(s)://host:port or file:")
    experiment: str = Field(
        "roundhouse", min_length=1, max_length=500, description="the MLflow experiment's name"
    )
    log_adapter: bool = Field(False, description="log the final checkpoint's export as the run's artifact")

    @field_validator("tracking_uri")
    @classmethod
    def _no_secrets(cls, uri: str) -> str:
        wrong = uris.problem(uri)
        if wrong is not None:  # shown redacted: the value may hold the secret it is refused for
            raise PydanticCustomError("tracking_uri", wrong, {SHOWN: uris.redact_url(uri)})
        return uri


class WandbSpec(_Strict):
    """A Weights & Biases project the run logs to (the API key: the settings, never the config)."""

    project: str = Field(..., min_length=1, max_length=128, description="the W&B project")
    entity: str | None = Field(None, min_length=1, max_length=128, description="the W&B team or user")
    name: str | None = Field(None, min_length=1, max_length=128, description="the run's name")
    tags: list[str] = Field(default_factory=list, max_length=20, description="the run's tags")
    mode: Literal["online", "offline"] = Field("online", description='"offline" writes the run files only')

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: list[str]) -> list[str]:
        if any(not t or len(t) > 64 for t in tags):
            raise PydanticCustomError("tags", "each tag must have 1 to 64 characters", {})
        return tags


class TrackingSpec(_Strict):
    """Experiment trackers the run's metrics also go to (``engine.tracking``)."""

    tensorboard: bool = Field(False, description="event files under output_dir/tensorboard")
    mlflow: MlflowSpec | None = Field(None, description="log to an MLflow tracking server or folder")
    wandb: WandbSpec | None = Field(None, description="log to Weights & Biases")


class TrainConfig(_Strict):
    """A whole fine-tuning run."""

    model: ModelSpec = Field(default_factory=lambda: ModelSpec(), description="the base model")
    data: DataSpec = Field(description="the training rows and how they become sequences")
    method: MethodSpec = Field(default_factory=lambda: methods.METHODS["sft"].defaults())
    hyper: HyperSpec = Field(
        default_factory=lambda: HyperSpec(), description="the optimizer and the run's length"
    )
    engine: EngineSpec = Field(
        default_factory=lambda: EngineSpec(),
        description="the RoundPipe engine: workers, micro-batches, precision",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=lambda: CheckpointSpec(), description="when checkpoints are saved, how many are kept"
    )
    eval: EvalSpec = Field(default_factory=lambda: EvalSpec(), description="validation during the run")
    tracking: TrackingSpec = Field(default_factory=lambda: TrackingSpec())
    output_dir: str = Field(
        "runs/default", min_length=1, description="the run's folder: checkpoints, log, exports"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        # micro-batches cut a batch's rows (GRPO's: each prompt's group)
        rows, what = self.method.batch_rows(self.hyper.batch_size)
        if self.engine.num_microbatches > rows and "num_microbatches" not in self.engine.model_fields_set:
            # the default does not fit a small batch: as many micro-batches as it has sequences
            # (a refusal names only what the caller set)
            self.engine.num_microbatches = rows
        if self.engine.num_microbatches > rows:
            raise ConfigError(
                "engine.num_microbatches",
                f"engine.num_microbatches={self.engine.num_microbatches} exceeds {what}: each "
                "micro-batch needs a sequence",
            )
        self.method.check(self)
        return self

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read a JSON or YAML file; relative data/model/output paths resolve against its folder.

        Raises:
            ValueError: unreadable file or invalid values (every problem named by field).
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{p}: {exc.strerror or exc}") from exc
        if p.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}: line {exc.lineno}: {exc.msg}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: the config must be a mapping, got {type(raw).__name__}")
        config = cls.parse(raw)
        return config.resolved(p.parent)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> TrainConfig:
        """Validate a mapping.

        Raises:
            ConfigError: listing every bad field and its value; ``field`` is the first one's.
        """
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(error_field(exc.errors()[0]), describe_errors(exc)) from None

    def resolved(self, base: Path) -> TrainConfig:
        """Paths made absolute against ``base`` (the config file's folder)."""

        def fix(v: str | None) -> str | None:
            if v is None or v == DEMO_MODEL or Path(v).is_absolute():
                return v
            return str((base / v).resolve())

        c = self.model_copy(deep=True)
        c.data.train = fix(c.data.train) or c.data.train
        c.data.validation = fix(c.data.validation)
        c.model.path = fix(c.model.path) or c.model.path
        c.output_dir = fix(c.output_dir) or c.output_dir
        return c


def field_path(loc: tuple[int | str, ...] | list[int | str]) -> list[str]:
    """An error location as field names: the ``method`` union's tag (the method's name, which
    pydantic puts after ``method``) left out, so ``method.beta`` reads the same for every method."""
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts[:-1]):
        if part == "method" and parts[i + 1] in methods.METHODS:
            del parts[i + 1]
            break
    return parts


def error_field(err: ErrorDetails | dict[str, Any]) -> str:
    """The dotted field of one pydantic error; a ``ConfigError`` raised by a model validator
    names its field relative to that model."""
    loc = field_path(err["loc"])
    inner = err.get("ctx", {}).get("error")
    if isinstance(inner, ConfigError):
        loc.append(inner.field)
    return ".".join(loc) or "config"


def _error_line(err: ErrorDetails | dict[str, Any]) -> str:
    field = ".".join(field_path(err["loc"])) or "config"
    given = err.get("ctx", {}).get(SHOWN, err.get("input"))
    shown = json.dumps(given) if isinstance(given, int | float | str | bool) or given is None else None
    suffix = f" (got {shown})" if shown is not None and err["type"] != "missing" else ""
    return f"{field}: {err['msg']}{suffix}"


def describe_errors(exc: ValidationError) -> str:
    """One line per problem: ``hyper.learning_rate: Input should be greater than 0 (got -1)``."""
    return "; ".join(_error_line(err) for err in exc.errors())


@dataclass
class EngineConfig:
    """How the RoundPipe engine trains. Invalid values raise ``ConfigError`` naming the field.

    Attributes:
        devices: worker devices; ``"cpu"`` may repeat (each is a thread with its own stage
            copies), ``"cuda:i"`` names a GPU.
        num_microbatches: micro-batches per ``forward_backward`` call (M).
        round_size: micro-batches per round (M_R >= number of workers); None = all of them.
        optimizer: a name from ``engine.optimizers.OPTIMIZERS`` (``"adamw"``: decoupled weight
            decay, or ``"sgd"``).
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        async_optimizer: staleness-1 mode: the optimizer step overlaps the next iteration.
        compute_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights sent to workers).
        partition: a manual plan ``{"forward": [...], "fused": n, "backward": [...]}`` in layers
            (input layer + blocks + output layer); None = automatic.
        memory_budget_bytes: per-stage memory limit for the automatic partition (None: 45% of the
            smallest GPU's memory, unlimited on CPU workers).
        calibration_steps: iterations whose per-layer times are measured before the automatic
            partition is recomputed from them (0: keep the parameter-bytes proxy plan).
        seed: seeds the dropout masks (per iteration, micro-batch and layer).
        initial_loss_scale: float16 compute only: the starting dynamic loss scale (halved on
            an overflow, which skips that step; doubled after 1000 good steps).
        loss_chunk_tokens: token positions per chunk of the output layer's loss: its logits
            (forward and backward) never exceed ``loss_chunk_tokens x vocab``.
        router_aux_loss: a mixture-of-experts model adds its routers' load-balancing loss, as
            its own ``forward`` does when asked for router logits (``engine.model.router``).
        router_aux_loss_coef: that loss's weight (None: the model config's
            ``router_aux_loss_coef``).
        max_skipped_steps: float16 compute only: fail after this many consecutive steps
            skipped for overflowing gradients (the loss scale cannot recover).
        max_nonfinite_steps: fail after this many consecutive steps skipped because their loss or
            gradient norm was not finite (every dtype; float16's overflows, which the loss scale
            answers, count under ``max_skipped_steps`` instead). A skipped step changes no weight,
            optimizer moment or optimizer step count.
        tf32: float32 compute on GPUs with TensorFloat-32 lets matmuls and convolutions use it
            (about 10 mantissa bits in the products; off gives exact fp32 arithmetic).
        base_bits: 16, or 4: the frozen weights of the decoder blocks (a LoRA base) are kept in
            host memory and sent to the workers packed in NF4, and decoded on the workers
            (``engine.model.quant``).
        optimizer_threads: threads of the host optimizer's one-pass kernels (the fold and the
            AdamW update); None: every core torch uses, less one per GPU worker, whose thread
            launches its kernels meanwhile (at least one).
    """

    devices: list[str] = dataclass_field(default_factory=lambda: ["cpu"])
    num_microbatches: int = 4
    round_size: int | None = None
    optimizer: str = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    max_grad_norm: float | None = None
    async_optimizer: bool = False
    compute_dtype: str = "float32"
    partition: dict[str, Any] | None = None
    memory_budget_bytes: int | None = None
    calibration_steps: int = 2
    seed: int = 0
    initial_loss_scale: float = 2.0**16
    loss_chunk_tokens: int = 2048  # engine.model.loss.DEFAULT_LOSS_CHUNK_TOKENS (no torch here)
    router_aux_loss: bool = False
    router_aux_loss_coef: float | None = None
    max_skipped_steps: int = 50
    max_nonfinite_steps: int = 3
    tf32: bool = True
    optimizer_threads: int | None = None
    base_bits: int = 16

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, want: str) -> ConfigError:
            return ConfigError(f"EngineConfig.{name}", f"EngineConfig.{name}={value!r}: {want}", value=value)

        if not self.devices:
            raise bad("devices", self.devices, "name at least one device")
        for d in self.devices:
            if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
                raise bad("devices", d, 'each device must be "cpu" or "cuda:N"')
        if "cpu" in self.devices and any(d != "cpu" for d in self.devices):
            # CPU workers read host buffers a GPU worker's asynchronous copies may still write
            raise bad("devices", self.devices, "mixes CPU and GPU workers: list only CPUs or only GPUs")
        if self.num_microbatches < 1:
            raise bad("num_microbatches", self.num_microbatches, "must be >= 1")
        if self.round_size is not None and self.round_size < 1:
            raise bad("round_size", self.round_size, "must be >= 1 or None")
        optimizer_spec(self.optimizer, field="EngineConfig.optimizer")
        for name in ("lr", "eps", "weight_decay", "momentum"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise bad(name, v, "must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad("betas", self.betas, "must be two numbers in [0, 1)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad("max_grad_norm", self.max_grad_norm, "must be > 0 or None")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise bad("compute_dtype", self.compute_dtype, f"must be one of {sorted(COMPUTE_DTYPES)}")
        if self.calibration_steps < 0:
            raise bad("calibration_steps", self.calibration_steps, "must be >= 0")
        if isinstance(self.max_skipped_steps, bool) or not (
            isinstance(self.max_skipped_steps, int) and self.max_skipped_steps >= 1
        ):
            raise bad("max_skipped_steps", self.max_skipped_steps, "must be an integer >= 1")
        if isinstance(self.max_nonfinite_steps, bool) or not (
            isinstance(self.max_nonfinite_steps, int) and self.max_nonfinite_steps >= 1
        ):
            raise bad("max_nonfinite_steps", self.max_nonfinite_steps, "must be an integer >= 1")
        if isinstance(self.loss_chunk_tokens, bool) or not (
            isinstance(self.loss_chunk_tokens, int) and self.loss_chunk_tokens >= 1
        ):
            raise bad("loss_chunk_tokens", self.loss_chunk_tokens, "must be an integer >= 1")
        if self.base_bits not in (16, 4) or isinstance(self.base_bits, bool):
            raise bad("base_bits", self.base_bits, "must be 16 or 4")
        threads = self.optimizer_threads
        if threads is not None and (
            isinstance(threads, bool) or not (isinstance(threads, int) and threads >= 1)
        ):
            raise bad("optimizer_threads", threads, "must be an integer >= 1 or None")
        coef = self.router_aux_loss_coef
        if coef is not None and not (
            isinstance(coef, int | float) and not isinstance(coef, bool) and math.isfinite(coef) and coef >= 0
        ):
            raise bad("router_aux_loss_coef", coef, "must be a finite number >= 0 or None")
