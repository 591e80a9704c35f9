"""``TrainConfig``: everything a fine-tuning run needs, validated (pydantic; no torch import).

The service validates job requests with the same model, so a bad value gets the same message
everywhere: the dotted field name, what is wrong, and the value given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEMO_MODEL = "demo"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ModelSpec(_Strict):
    path: str = Field(DEMO_MODEL, description='a local Hugging Face model folder, or "demo"')
    name: str | None = Field(None, description="the name recorded in exports (default: the folder's name)")


class DataSpec(_Strict):
    train: str = Field(..., description="training file: .jsonl, .csv or .parquet")
    validation: str | None = Field(None, description="validation file (same formats)")
    validation_fraction: float = Field(0.0, ge=0.0, le=0.5, description="held out from train when no file")
    format: Literal["auto", "chat", "instruction", "prompt_completion", "text"] = "auto"
    max_length: int = Field(1024, ge=8, le=1_048_576)
    packing: bool = False


class MethodSpec(_Strict):
    kind: Literal["lora", "full"] = "lora"
    lora_r: int = Field(16, ge=1, le=4096)
    lora_alpha: float = Field(32.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR), min_length=1)


class HyperSpec(_Strict):
    epochs: float | None = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    learning_rate: float = Field(2e-4, gt=0, le=10)
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _length(self) -> HyperSpec:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs or max_steps")
        return self


class EngineSpec(_Strict):
    devices: Literal["auto"] | list[str] = "auto"
    num_microbatches: int = Field(4, ge=1, le=4096)
    async_optimizer: bool = False
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    partition: dict[str, Any] | None = None


def resolve_compute_dtype(dtype: str, *, on_gpu: bool) -> str:
    """The dtype ``"auto"`` stands for: bfloat16 on GPU workers, float32 on CPU workers.

    The one place this rule lives: the run, the planner and the service all call it.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu else "float32"


class CheckpointSpec(_Strict):
    every_steps: int = Field(100, ge=1)
    keep_last: int = Field(3, ge=1)


class EvalSpec(_Strict):
    every_steps: int | None = Field(None, ge=1, description="validation loss every N steps (and at the end)")


class TrainConfig(_Strict):
    """A whole fine-tuning run."""

    model: ModelSpec = Field(default_factory=lambda: ModelSpec())
    data: DataSpec
    method: MethodSpec = Field(default_factory=lambda: MethodSpec())
    hyper: HyperSpec = Field(default_factory=lambda: HyperSpec())
    engine: EngineSpec = Field(default_factory=lambda: EngineSpec())
    checkpoint: CheckpointSpec = Field(default_factory=lambda: CheckpointSpec())
    eval: EvalSpec = Field(default_factory=lambda: EvalSpec())
    output_dir: str = Field("runs/default", min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.engine.num_microbatches > self.hyper.batch_size:
            raise ValueError(
                f"engine.num_microbatches={self.engine.num_microbatches} exceeds "
                f"hyper.batch_size={self.hyper.batch_size}: each micro-batch needs a sequence"
            )
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
        """Validate a mapping; raise ``ValueError`` listing every bad field and its value."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(describe_errors(exc)) from None

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


def describe_errors(exc: ValidationError) -> str:
    """One line per problem: ``hyper.learning_rate: Input should be greater than 0 (got -1)``."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        given = err.get("input")
        shown = json.dumps(given) if isinstance(given, int | float | str | bool) or given is None else None
        suffix = f" (got {shown})" if shown is not None and err["type"] != "missing" else ""
        lines.append(f"{field}: {err['msg']}{suffix}")
    return "; ".join(lines)
