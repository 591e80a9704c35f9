"""API shapes (request and response bodies). Tables live in ``server/tables.py``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import CheckpointSpec, EngineSpec, EvalSpec, HyperSpec, MethodSpec


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable, e.g. not_found, invalid_request, invalid_config")
    message: str = Field(description="for a person: names the field and the value")
    param: str | None = Field(None, description="the offending parameter or field (dotted), if one")
    details: list[dict[str, Any]] | None = Field(
        None, description="every problem, when there are several (e.g. one per invalid dataset row)"
    )


class ErrorBody(BaseModel):
    """The one error shape of every failed request (``server/errors.py``)."""

    error: ErrorDetail


class DatasetPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    filename: str
    format: str
    rows: int
    size_bytes: int
    sha256: str
    created_at: datetime


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic]


class ModelPublic(BaseModel):
    name: str
    source: Literal["demo", "models", "hf-cache"]
    architecture: str | None
    parameters: int | None
    size_bytes: int
    ready: bool


class ModelsPublic(BaseModel):
    data: list[ModelPublic]


class DataOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["auto", "chat", "instruction", "prompt_completion", "text"] = "auto"
    max_length: int = 1024
    packing: bool = False
    validation_fraction: float = 0.0


class JobBase(BaseModel):
    """The fields a job request and a plan request share: the engine's TrainConfig sections."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=255)
    validation_dataset_id: str | None = None
    data: DataOptions = Field(default_factory=lambda: DataOptions())
    method: dict[str, Any] = Field(default_factory=dict, description=MethodSpec.__doc__ or "LoRA or full")
    hyper: dict[str, Any] = Field(default_factory=dict, description=HyperSpec.__doc__ or "hyperparameters")
    engine: dict[str, Any] = Field(default_factory=dict, description=EngineSpec.__doc__ or "engine")
    checkpoint: dict[str, Any] = Field(default_factory=dict, description=CheckpointSpec.__doc__ or "")
    eval: dict[str, Any] = Field(default_factory=dict, description=EvalSpec.__doc__ or "")


class JobCreate(JobBase):
    """A fine-tune: the base model and dataset by name/id, and the engine's TrainConfig sections."""

    base_model: str = Field(..., description='a name from GET /api/models, or "demo"')
    dataset_id: str


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    status: str
    base_model: str
    dataset_id: str
    validation_dataset_id: str | None
    step: int
    total_steps: int | None
    error: str | None
    attempts: int
    config: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobsPublic(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None


class EventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    step: int | None
    message: str
    data: dict[str, Any]
    created_at: datetime


class EventsPublic(BaseModel):
    data: list[EventPublic]
    next_after: int | None


class MetricPoint(BaseModel):
    step: int | None
    value: float
    time: datetime


class MetricsPublic(BaseModel):
    data: dict[str, list[MetricPoint]]


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    authenticated: bool = Field(description="the request carried a valid key (the UI's login check)")


class PreviewToken(BaseModel):
    text: str
    trained: bool


class PreviewRow(BaseModel):
    line: int
    truncated: bool
    tokens: list[PreviewToken]


class PreviewPublic(BaseModel):
    dataset_id: str
    model: str
    rows: list[PreviewRow]


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    kind: Literal["adapter", "full"]
    metrics: dict[str, Any]
    created_at: datetime


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]


class DevicePublic(BaseModel):
    index: int
    name: str
    utilization: float | None
    memory_used: int | None
    memory_total: int | None
    temperature: float | None
    power_w: float | None


class HostPublic(BaseModel):
    worker: str
    hostname: str
    gpu: bool
    message: str
    devices: list[DevicePublic]
    cpu: dict[str, float]
    sampled_at: datetime | None
    heartbeat_at: datetime
    online: bool


class HostsPublic(BaseModel):
    data: list[HostPublic]


class HistogramBin(BaseModel):
    lo: int
    hi: int
    count: int


class StatsPublic(BaseModel):
    rows: int
    sampled: int
    max_length: int
    truncated_share: float
    mean: float
    max: int
    histogram: list[HistogramBin]


class HardwareSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_gpus: int | None = Field(None, ge=1, le=64)
    gpu_memory_gb: float | None = Field(None, gt=0)
    gpu_tflops: float | None = Field(None, gt=0, description="peak bf16 rate per GPU (RTX 4090: 165)")
    efficiency: float | None = Field(None, gt=0, le=1, description="achieved fraction of the peak")
    link_gb_s: float | None = Field(None, gt=0, description="host <-> GPU bandwidth per GPU")
    host_ram_gb: float | None = Field(None, gt=0)


class PlanRequest(JobBase):
    """A job to plan: the body of ``POST /api/jobs`` (the dataset optional, a config.json instead of
    the base model allowed), the hardware (detected from the workers where left out) and a past
    job to calibrate the rate by."""

    base_model: str | None = Field(None, description='a name from GET /api/models (default "demo")')
    dataset_id: str | None = Field(None, description="its row count turns hyper.epochs into steps")
    config: dict[str, Any] | None = Field(None, description="a config.json instead of a base model name")
    hardware: HardwareSpec = Field(default_factory=lambda: HardwareSpec())
    calibrate_job_id: str | None = Field(None, description="scale the rate by this job's measured tokens/s")
