"""API shapes (request and response bodies). Tables live in ``server/tables.py``."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from engine import CheckpointSpec, EngineSpec, EvalSpec, HyperSpec, MethodSpec, TrackingSpec
from engine.data import FormatChoice
from engine.export import CHECKPOINT, FORMATS, MERGED, formats_help, variants_help
from engine.planner import HARDWARE_RANGES, HOSTS_LIMIT
from server.kinds import JobStatus

# One line of text: no control character, NUL above all (PostgreSQL can neither store nor compare
# it). Every id, name and path or query parameter is one (``server.deps.plain_parameters``).
LINE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
Line = Annotated[str, StringConstraints(max_length=255, pattern=LINE_PATTERN)]
# The largest INTEGER (event ids, step numbers) on PostgreSQL: a larger number in a path or query
# could match no row, and the database refuses to compare with it.
MAX_INT = 2**31 - 1
# the 200 answers that are not JSON (``responses=`` of the routes): for the OpenAPI schema
EVENT_STREAM = {
    "description": "server-sent events, each with its name (a job event's kind), JSON data and an id",
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {
                    "event": {"type": "string"},
                    "data": {"type": "string", "contentMediaType": "application/json"},
                    "id": {"type": "string"},
                },
                "required": ["data"],
            }
        }
    },
}
TAR_FILE = {
    "description": "a tar archive",
    "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
}


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable, e.g. not_found, invalid_request, invalid_config")
    message: str = Field(description="for a person: names the field and the value")
    param: str | None = Field(None, description="the offending parameter or field (dotted), if one")
    details: list[dict[str, Any]] | None = Field(
        None, description="every problem, when there are several (e.g. one per invalid dataset row)"
    )
    errors_total: int | None = Field(
        None, description="how many problems there are; details lists only the first 100 of them"
    )
    errors_truncated: bool | None = Field(None, description="whether details leaves some problems out")


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
    source: dict[str, Any] | None = Field(
        None, description='where it came from when pulled: {"hub": repo, "config", "split", "sha", "files"}'
    )


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic]


class ModelPublic(BaseModel):
    name: str
    source: Literal["demo", "models", "hub", "hf-cache"] = Field(
        description="demo, a folder of the models folder, one pulled from the Hub, the local HF cache"
    )
    architecture: str | None = Field(description="the model class its config.json names")
    parameters: int | None
    size_bytes: int
    ready: bool = Field(description="loadable now (false: the demo, prepared on first use)")
    family: str | None = Field(description='readable family of the architecture, e.g. "Qwen3-MoE"')
    moe: bool = Field(description="a mixture-of-experts model")
    experts: int | None = Field(description="routed experts per MoE block (null: dense, or not given)")
    active_experts: int | None = Field(description="experts each token is routed to (null: dense)")
    supported: bool = Field(description="the engine can fine-tune it; a job or plan with it is a 422 if not")
    unsupported_reason: str | None = Field(description="why it is not supported (null when it is)")
    hub: dict[str, Any] | None = Field(
        None, description='a pulled model\'s origin: {"repo_id", "revision", "sha", "pulled_at"}'
    )
    quantization: str | None = Field(
        None,
        description='how its checkpoint is quantized ("bitsandbytes 4-bit (nf4)", "mxfp4"; null: not): '
        "with method.base_bits 4 such weights stay packed in host RAM, else they are decoded on load",
    )


class ModelsPublic(BaseModel):
    data: list[ModelPublic]


class DataOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    format: FormatChoice = Field(
        "auto", description="the rows' format (GET /api/datasets/formats), or auto-detect"
    )
    max_length: int = Field(1024, ge=8, le=1_048_576)  # the bounds of engine.config.DataSpec
    packing: bool = False
    validation_fraction: float = Field(0.0, ge=0.0, le=0.5)


# a TrainConfig section: JSON values (no inf or NaN, which no database column can hold either)
Section = dict[str, JsonValue]


def _inlined(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    """``node`` with each ``#/$defs/`` reference replaced by its definition (a definition that
    refers to itself again is left as any object)."""
    if isinstance(node, list):
        return [_inlined(v, defs, seen) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        name = ref.removeprefix("#/$defs/")
        rest = {k: _inlined(v, defs, seen) for k, v in node.items() if k != "$ref"}
        if name in seen:
            return {"type": "object", **rest}
        return {**_inlined(defs[name], defs, (*seen, name)), **rest}
    out = {k: _inlined(v, defs, seen) for k, v in node.items()}
    if isinstance(out.get("discriminator"), dict):  # its mapping names the definitions inlined
        out["discriminator"] = {k: v for k, v in out["discriminator"].items() if k != "mapping"}
    return out


def section_schema(model: Any) -> WithJsonSchema:
    """A section's documented schema: the engine's own model of it (``engine.config``), though the
    service validates the section with the whole ``TrainConfig`` (one set of rules and messages)."""
    schema = TypeAdapter(model).json_schema(mode="validation")
    defs = schema.pop("$defs", {})
    return WithJsonSchema(_inlined(schema, defs))


MethodSection = Annotated[Section, section_schema(MethodSpec)]
HyperSection = Annotated[Section, section_schema(HyperSpec)]
EngineSection = Annotated[Section, section_schema(EngineSpec)]
CheckpointSection = Annotated[Section, section_schema(CheckpointSpec)]
EvalSection = Annotated[Section, section_schema(EvalSpec)]
TrackingSection = Annotated[Section, section_schema(TrackingSpec)]


class JobBase(BaseModel):
    """The fields a job request and a plan request share: the engine's TrainConfig sections."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Line | None = None
    validation_dataset_id: Line | None = None
    data: DataOptions = Field(default_factory=lambda: DataOptions())
    method: MethodSection = Field(
        default_factory=dict, description="the training method and its options (GET /api/methods)"
    )
    hyper: HyperSection = Field(default_factory=dict, description=HyperSpec.__doc__ or "hyperparameters")
    engine: EngineSection = Field(default_factory=dict, description=EngineSpec.__doc__ or "engine")
    checkpoint: CheckpointSection = Field(default_factory=dict, description=CheckpointSpec.__doc__ or "")
    eval: EvalSection = Field(default_factory=dict, description=EvalSpec.__doc__ or "")
    tracking: TrackingSection = Field(default_factory=dict, description=TrackingSpec.__doc__ or "")


class Placement(BaseModel):
    """Where a job may run: one host (by the name the GPUs page shows), and/or a GPU count each
    host must have; or several hosts at once (``hosts``), each running the job's pipeline on its
    share of every batch (``services.placement``)."""

    model_config = ConfigDict(extra="forbid")

    host: (
        Annotated[
            str, StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
        ]
        | None
    ) = Field(None, description="the worker host's name (GET /api/gpus); null: any host")
    gpus: int | None = Field(None, ge=1, le=1024, description="GPUs the host must have; null: any")
    hosts: Annotated[int, Field(ge=1, le=HOSTS_LIMIT)] | Literal["auto"] | None = Field(
        None,
        description=f'boxes the job runs on at once, data-parallel (1 to {HOSTS_LIMIT}), or "auto": as many'
        " free hosts as fit, at least min_hosts; null: one",
    )
    min_hosts: int | None = Field(
        None,
        ge=1,
        le=HOSTS_LIMIT,
        description="the fewest boxes it may start or resume on after a box is lost (the batch stays"
        ' the same); null: hosts (fewer not allowed), 1 for "auto"',
    )

    @model_validator(mode="after")
    def _boxes(self) -> Placement:
        several = self.hosts == "auto" or (isinstance(self.hosts, int) and self.hosts > 1)
        if several and self.host is not None:
            raise ValueError(
                f"placement.hosts={self.hosts!r} with placement.host={self.host!r}: a job on several"
                " boxes cannot be pinned to one host (leave host out)"
            )
        if self.min_hosts is not None:
            if self.hosts is None:
                raise ValueError(f"placement.min_hosts={self.min_hosts} needs placement.hosts")
            if isinstance(self.hosts, int) and self.min_hosts > self.hosts:
                raise ValueError(
                    f"placement.min_hosts={self.min_hosts} is more than placement.hosts={self.hosts}"
                )
        return self


class JobCreate(JobBase):
    """A fine-tune: the base model and dataset by name/id, and the engine's TrainConfig sections."""

    base_model: Line = Field(..., description='a name from GET /api/models, or "demo"')
    dataset_id: Line
    placement: Placement | None = Field(None, description="where it may run (null: any worker)")


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    status: JobStatus
    base_model: str
    dataset_id: str
    validation_dataset_id: str | None
    step: int
    total_steps: int | None
    error: str | None
    attempts: int
    config: dict[str, Any]
    created_at: datetime
    started_at: datetime | None = Field(description="when a worker first started it")
    finished_at: datetime | None = Field(
        description="when it last reached a final state (a resume clears it)"
    )
    disk_bytes: int = Field(0, description="bytes of its folder: checkpoints, exports, merged builds, log")
    placement: dict[str, Any] | None = Field(None, description="where it may run (null: any worker)")
    sweep_id: str | None = Field(None, description="the sweep it is a trial of (GET /api/sweeps/{id})")


class JobsPublic(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None


class PausedForSpacePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    job_id: str
    name: str
    message: str = Field(description="what did not fit: the path, the bytes needed and free")


class DiskPublic(BaseModel):
    """Disk use of the jobs' folders and the datasets, and the space left where runs are written."""

    jobs: int = Field(description="how many jobs there are")
    jobs_bytes: int = Field(description="every job's folder together (the sum of their disk_bytes)")
    datasets_bytes: int = Field(description="the stored dataset files")
    free_bytes: int = Field(description="free space on the disk of the runs folder")
    capacity_bytes: int = Field(description="size of the disk of the runs folder")
    reserve_bytes: int = Field(description="the space a checkpoint must leave free (else its job pauses)")
    low: bool = Field(description="free space is under the reserve: the next checkpoint pauses its job")
    paused_for_space: list[PausedForSpacePublic] = Field(
        description="jobs a worker paused because a checkpoint did not fit; resume them once space is freed"
    )


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


class PreviewAnswer(BaseModel):
    tokens: list[PreviewToken]
    truncated: bool


class PreviewRow(BaseModel):
    line: int
    truncated: bool
    tokens: list[PreviewToken] = Field(
        description="the row rendered; of a preference or a prompt row, the prompt alone"
    )
    chosen: PreviewAnswer | None = Field(
        None, description="a preference row's preferred answer, after the prompt"
    )
    rejected: PreviewAnswer | None = Field(
        None, description="a preference row's rejected answer, after the prompt"
    )
    label: bool | None = Field(
        None, description="an unpaired (KTO) row's label: true, a desirable completion"
    )
    item: dict[str, Any] | None = Field(
        None,
        description="a prompt row's other fields, what a grader reads as item.<field> (e.g. "
        "reference_answer); its tokens are the prompt alone, nothing trained (GRPO samples the completions)",
    )
    images: list[str] | None = Field(
        None,
        description="a row with images: a thumbnail (a JPEG data URL) of each, in the order of its text",
    )


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
    address: str | None = Field(None, description="where a job's other boxes reach it (advertised)")
    rendezvous_port: int | None = Field(None, description="where it listens as a job's first box")
    interface: str | None = Field(None, description="the NIC the boxes exchange gradients over")
    link_gbps: float | None = Field(None, description="that NIC's nominal speed in Gb/s (null: unknown)")
    link_measured_gbps: float | None = Field(
        None, description="the all-reduce rate its last job on several hosts measured, Gb/s"
    )


class HostGroupPublic(BaseModel):
    """One host: a job runs on one host's GPUs (``placement.host`` names it)."""

    hostname: str
    online: bool = Field(description="a worker of it is sampling")
    gpus: int = Field(description="GPUs its online worker reports (0: none online, or a CPU host)")
    last_seen: datetime = Field(description="the latest heartbeat of its workers")
    workers: list[HostPublic] = Field(description="its workers, online first, newest first")


class HostsPublic(BaseModel):
    data: list[HostPublic] = Field(description="every worker, by host name")
    hosts: list[HostGroupPublic] = Field(default_factory=list, description="the workers grouped by host")


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


def _hardware(name: str, description: str) -> Any:
    """A hardware field within the planner's range for it (``engine.planner.HARDWARE_RANGES``)."""
    low, high = HARDWARE_RANGES[name]
    return Field(None, ge=low, le=high, description=f"{description}; from {low:g} to {high:g}")


class HardwareSpec(BaseModel):
    """The box to plan for; each field left out is read off the workers, else a default."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_gpus: int | None = _hardware("num_gpus", "GPUs the pipeline runs on")
    gpu_memory_gb: float | None = _hardware(
        "gpu_memory_gb", "memory of each GPU in GB (less than 1 cannot hold the CUDA context and a layer)"
    )
    gpu_tflops: float | None = _hardware("gpu_tflops", "peak bf16 rate per GPU in TFLOPS (RTX 4090: 165)")
    efficiency: float | None = _hardware("efficiency", "achieved fraction of the peak rate")
    link_gb_s: float | None = _hardware("link_gb_s", "host <-> GPU bandwidth per GPU in GB/s (PCIe 4.0: 25)")
    host_ram_gb: float | None = _hardware("host_ram_gb", "host RAM in GB")


class PlanRequest(JobBase):
    """A job to plan: the body of ``POST /api/jobs`` (the dataset optional, a config.json instead of
    the base model allowed), the hardware (detected from the workers where left out) and a past
    job to calibrate the rate by."""

    base_model: Line | None = Field(None, description='a name from GET /api/models (default "demo")')
    dataset_id: Line | None = Field(None, description="its row count turns hyper.epochs into steps")
    placement: Placement | None = Field(
        None, description="plan for this host's GPUs (default: the online host with the most GPUs)"
    )
    config: dict[str, JsonValue] | None = Field(
        None, description="a config.json instead of a base model name"
    )
    hardware: HardwareSpec = Field(default_factory=lambda: HardwareSpec())
    calibrate_job_id: Line | None = Field(None, description="scale the rate by this job's measured tokens/s")


class PlanStage(BaseModel):
    """One stage of the planned partition and its worker's GPU memory."""

    name: str = Field(description='"F1".. forward, "B1" fused, "B2".. backward')
    kind: Literal["forward", "fused", "backward"]
    layers: list[int] = Field(description="[start, stop) in engine layers (input, blocks, output layer)")
    gpu_memory_gb: float = Field(description="its worker's GPU memory with its share of the CUDA context")
    memory_gb: dict[str, float] = Field(
        description="by term: weights, prefetch (the next stage's weights), activations, gradients, "
        "logits (one loss chunk), workspace, and their total"
    )


class PlanBaseVariant(BaseModel):
    """A LoRA job with a 16-bit or a 4-bit base (``method.base_bits``); sizes in GB."""

    base_bits: Literal[16, 4]
    fits: bool
    limit: Literal["gpu_memory", "host_ram"] | None = Field(description="what it does not fit, if anything")
    host_ram_gb: float
    weights_gb: float = Field(description="the weights' copy in host RAM (a 4-bit base's blocks packed)")
    pcie_gb_per_iteration: float | None = Field(
        description="weights up, gradients down and stage-boundary activations in one iteration; "
        "null when not even one layer fits a GPU"
    )
    max_seq_len: int
    max_seq_len_limit: Literal["gpu_memory", "host_ram", "context", "planner"]


class PlanExchange(BaseModel):
    """A job on several hosts: the gradient exchange of each step (``engine.scheduling.exchange``)."""

    hosts: int = Field(description="the boxes the job spans")
    gradient_bytes: float = Field(description="the fp32 gradients of the trained weights each box holds")
    bytes_per_step: float = Field(description="what each box sends (and receives) a step: a ring all-reduce")
    seconds: float = Field(description="the exchange's time a step")
    link_gbps: float = Field(description="the link it was priced at, Gbit/s")
    link_measured: bool = Field(
        description="the rate an earlier job on these hosts measured (false: their NICs' nominal speed, "
        "or 10 Gbit/s when none is reported, at 85% of it)"
    )
    hidden: bool = Field(description="the asynchronous optimizer hides it behind the next iteration")
    exposed_s: float = Field(description="what it adds to each step (0 when hidden)")


class PlanPublic(BaseModel):
    """The planner's answer (``engine.planner.PlanReport``); sizes in GB (1e9 bytes). A job on
    several hosts (``placement.hosts``) is planned as one box's share of each batch, with the
    gradient exchange between the boxes priced in."""

    fits: bool
    problems: list[str]
    suggestions: list[str]
    parameters: int = Field(description="every weight (all experts of a mixture-of-experts model)")
    trainable: int
    host_ram: dict[str, float] = Field(description="host RAM by term, and its total_gb")
    stages: list[PlanStage]
    partition: str
    gpu_memory_needed_gb: float = Field(description="the largest stage on each worker of one GPU")
    gpu_memory_gb: float
    iteration_s: float
    tokens_per_s: float
    bubble: float
    closed_form_bubble: float
    eta_s: float | None
    max_seq_len: int = Field(
        description="the longest sequence (tokens, at this job's sequences per micro-batch) whose "
        "plan fits; 0 when none does"
    )
    max_seq_len_limit: Literal["gpu_memory", "host_ram", "context", "planner"] = Field(
        description="what stops a longer one: GPU memory, host RAM, the model's context length, "
        "or the largest length a plan takes"
    )
    workers_per_gpu: int = Field(description="workers sharing one GPU's memory (engine.devices)")
    reference_s: float | None = Field(
        None,
        description="DPO: seconds of the reference pass (one forward over every training and "
        "validation pair, before the first step), part of eta_s; null for a supervised job or "
        "when the pair count is unknown (no dataset)",
    )
    base_bits: Literal[16, 4] = Field(16, description="the job's base: 16 bits, or 4 (NF4, LoRA only)")
    pcie: dict[str, float] | None = Field(
        None,
        description="GB one iteration moves over PCIe by term (weights, gradients, activations) "
        "and total_gb; null when not even one layer fits a GPU",
    )
    base_variants: list[PlanBaseVariant] = Field(
        default_factory=list,
        description="a LoRA job with a 16-bit and with a 4-bit base side by side; empty for a full fine-tune",
    )
    step_s: float = Field(
        0.0, description="seconds a step takes: iteration_s, plus rollout_s for GRPO; 0 when nothing fits"
    )
    rollout_s: float | None = Field(
        None,
        description="GRPO: seconds a step samples its completions (every one max_completion_tokens "
        "long; on the first GPU when the model fits there, else the host's CPU) and, with beta > 0, "
        "computes their reference log-probabilities; part of step_s and eta_s; null for other methods",
    )
    rollout_share: float | None = Field(None, description="GRPO: rollout_s over step_s")
    rollout: dict[str, Any] | None = Field(
        None,
        description="GRPO: device (gpu or cpu) and reason, generation_s, upload_s (the model copied to "
        "the GPU), reference_s, rows (completions a step), completion_tokens, tokens_per_s (sampled), "
        "gflops and memory_gb_s (assumed), bound (compute or memory)",
    )
    overheads: dict[str, float] = Field(
        default_factory=dict,
        description="seconds the run spends besides its steps, by term: assumed (start_s, load_s, data_s, "
        "warmup_s, validation_s, save_s) or measured (measured_s: calibrated_from's run less its steady "
        "steps); and their total_s; empty when nothing fits",
    )
    total_s: float | None = Field(
        None,
        description="the run end to end: eta_s plus overheads.total_s (the new-job page's ETA; a sweep adds "
        "its trials' up); null when eta_s is",
    )
    estimate: Literal["planner", "calibrated", "measured"] = Field(
        "planner",
        description="where total_s comes from: the planner's assumptions; the rate calibrated_from measured "
        "with the overheads assumed; or the rate and overheads measured (by calibrate_job_id, else by the "
        "latest 5 jobs of this base model, objective and tuning that ran to their end on the host planned: "
        "their medians)",
    )
    assumptions: dict[str, Any]
    calibrated_from: str | None = Field(
        description="the job whose measured tokens/s scaled the rate: calibrate_job_id, else the latest of "
        "the jobs of this base model, objective and tuning that ran to their end on the host planned (null: "
        "none)"
    )
    hosts: int = Field(1, description='the boxes the job is planned on (placement.hosts; "auto": those free)')
    exchange: PlanExchange | None = Field(
        None, description="the gradient exchange of each step between the boxes; null on one host"
    )
    one_box: dict[str, Any] | None = Field(
        None, description="the whole batch on one box: fits, step_s, tokens_per_s; null on one host"
    )
    scaling: float | None = Field(
        None,
        description="the job's tokens/s over one box's with the whole batch (e.g. 1.86 on 2 hosts); null on "
        "one host or when either does not fit",
    )


# -- the chat playground (POST /api/generate) -------------------------------------------------------
GENERATION_STREAM = {
    "description": "server-sent events: status (waiting, loading, generating), delta (new text), "
    "then done (finish_reason, token counts) or error (the one error shape)",
    "content": EVENT_STREAM["content"],
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=100_000)


class CheckpointRef(BaseModel):
    """A job's checkpoint, as ``GET /api/jobs/{id}/checkpoints`` lists it."""

    model_config = ConfigDict(extra="forbid")

    job_id: Line
    step: int = Field(ge=0, le=MAX_INT)


class GenerationCreate(BaseModel):
    """A chat turn to answer: a base model or a job's checkpoint (one of the two), the
    conversation (ending with the user's turn) and the sampling settings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Line | None = Field(
        None,
        description="a base model name from GET /api/models, or a fine-tuned model or checkpoint by "
        "its OpenAI-style name (fine_tuned_model, fine_tuned_model_checkpoint of /v1/fine_tuning/jobs)",
    )
    checkpoint: CheckpointRef | None = Field(None, description="a job's checkpoint, instead of model")
    messages: list[ChatMessage] = Field(min_length=1, max_length=200)
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="0: always the most likely token")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sample among the likeliest tokens of this mass")
    max_tokens: int = Field(256, ge=1, le=2048, description="the most new tokens of the answer")
    seed: int | None = Field(None, ge=0, le=MAX_INT, description="the same seed gives the same answer")


# -- evaluations (server/api/evaluations.py) -------------------------------------------------------
class EvaluationCreate(BaseModel):
    """A checkpoint of the job to score on a dataset (``engine.inference.evaluate``)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Annotated[int, Field(ge=0, le=MAX_INT)] | Literal["latest"] = Field(
        "latest", description='the step of a checkpoint the job has on disk, or "latest"'
    )
    dataset_id: Line
    max_rows: int = Field(200, ge=1, le=100_000, description="the first rows of the dataset, in order")
    max_new_tokens: int = Field(64, ge=1, le=2048, description="the longest generated answer")
    num_samples: int = Field(5, ge=0, le=50, description="rows shown generated next to their reference")


class EvaluationPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    step: int
    dataset_id: str
    status: Literal["queued", "running", "succeeded", "failed"]
    max_rows: int
    max_new_tokens: int
    num_samples: int
    metrics: dict[str, Any] = Field(
        description="when succeeded: loss, perplexity, token_accuracy, exact_match (null without a short "
        "answer), rows, label_tokens, exact_match_rows, exact_match_correct, short_answer_tokens, device"
    )
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class EvaluationsPublic(BaseModel):
    data: list[EvaluationPublic]


class EvaluationSample(BaseModel):
    line: int = Field(description="the row's line (a Parquet file's row) in the dataset")
    prompt: str = Field(description="the last turn before the answer (a prompt/completion row's prompt)")
    reference: str
    output: str = Field(description="the checkpoint's greedy answer")
    short: bool = Field(description="the reference is short enough for exact match")
    match: bool | None = Field(description="output equals reference (whitespace-trimmed); null if not short")
    images: list[str] = Field(
        default_factory=list,
        description="the row's images as small thumbnails (data URLs); none for a text row",
    )


class EvaluationDetail(EvaluationPublic):
    samples: list[EvaluationSample] = Field(
        description="empty until it succeeded, or when its file went with a pruned checkpoint"
    )
    stored: bool = Field(description="the result file is still in the checkpoint folder")


# -- methods (server/api/methods.py) ---------------------------------------------------------------
class ChartPublic(BaseModel):
    """One chart of a method on the job page."""

    id: str = Field(description="the chart element's id")
    title: str
    hint: str
    ylabel: str
    lines: list[tuple[str, str]] = Field(description="[name, metric key] of each line")
    share: bool = Field(description="values in [0, 1]")
    more: str | None = Field(description="a key prefix whose metrics join the chart as they arrive")


class MethodPublic(BaseModel):
    """A training method (``method.objective``) and what it needs."""

    name: str = Field(description='the value of method.objective, e.g. "dpo"')
    title: str
    description: str
    data_format: Literal["supervised", "preference", "prompts", "unpaired"] = Field(
        description="the rows it trains on: chat, instruction, prompt/completion or text; preference pairs; "
        "prompts, whose completions are sampled and graded (GRPO); or unpaired rows, one answer labelled "
        "desirable or not (KTO)"
    )
    sequences_per_example: int
    needs_reference: bool = Field(
        description="a reference pass over every example runs before the first step"
    )
    config_fields: dict[str, str] = Field(description="its own method.* fields, with what each means")
    options_schema: dict[str, Any] = Field(description="the JSON schema of its method section")
    common_fields: list[str] = Field(description="the method.* fields every method shares")
    metric_keys: list[str] = Field(description="what it logs besides loss/train and loss/val")
    charts: list[ChartPublic] = Field(description="how the job page draws its metrics")
    tunings: list[str] = Field(description="what it can train (method.tuning)")


class MethodsPublic(BaseModel):
    data: list[MethodPublic]


# -- the Hugging Face Hub: pulls and pushes ------------------------------------------------------------
REPO_ID_FIELD = Field(
    min_length=1, max_length=193, pattern=LINE_PATTERN, description='a Hub repo id, "ORG/NAME"'
)
REVISION_FIELD = Field(
    None,
    min_length=1,
    max_length=255,
    pattern=LINE_PATTERN,
    description="a branch, tag or commit (default: main)",
)


class ModelPullCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = REPO_ID_FIELD
    revision: str | None = REVISION_FIELD


class DatasetPullCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = REPO_ID_FIELD
    split: str = Field("train", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    config: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="the subset"
    )
    revision: str | None = REVISION_FIELD
    name: str | None = Field(None, min_length=1, max_length=255, pattern=LINE_PATTERN)


# the export formats a push and a download take: the registry's names (``engine.export.formats``)
ExportFormatName = StrEnum("ExportFormatName", {name: name for name in FORMATS})  # type: ignore[misc]


class PushCreate(BaseModel):
    """A checkpoint's push in one of the export formats (its own files, merged, a GGUF), as a
    download exports it."""

    model_config = ConfigDict(extra="forbid")

    repo_id: str = REPO_ID_FIELD
    private: bool = Field(True, description="create the repo private (when it does not exist yet)")
    format: ExportFormatName = Field(ExportFormatName(CHECKPOINT.name), description=formats_help())
    variant: str | None = Field(
        None, min_length=1, max_length=64, pattern=LINE_PATTERN, description=variants_help()
    )
    merged: bool = Field(
        False,
        deprecated=True,
        description='deprecated: true is the same as "format": "merged" (refused beside another format)',
    )

    @model_validator(mode="before")
    @classmethod
    def _merged_is_a_format(cls, data: Any) -> Any:
        """The deprecated ``merged: true`` read as ``format: "merged"`` when no format is given
        (this and the check below are the one place it is read)."""
        if isinstance(data, dict) and data.get("merged") is True and "format" not in data:
            return {**data, "format": MERGED.name}
        return data

    @field_validator("merged")
    @classmethod
    def _merged_beside_a_format(cls, merged: bool, info: ValidationInfo) -> bool:
        chosen = info.data.get("format")
        if merged and chosen != MERGED.name:
            shown = f"format={chosen}" if chosen is not None else "a format"
            raise ValueError(f"true is the deprecated way to say format=merged: leave it out beside {shown}")
        return merged


TransferKind = Literal["pull", "push", "dataset_pull"]  # transfers.KINDS: a model pull is a "pull"


class TransferPublic(BaseModel):
    id: str
    kind: TransferKind
    repo_id: str
    revision: str | None
    status: Literal["queued", "running", "cancelling", "succeeded", "failed", "cancelled"]
    target: str = Field(
        description="a model pull's model name; a push's repo URL; a dataset pull's dataset name"
    )
    bytes_total: int
    bytes_done: int
    bytes_per_s: float | None
    eta_s: float | None
    files: list[Any]
    commit: str | None
    options: dict[str, Any] = Field(
        description="a push's job_id, step, private, format, variant; a dataset pull's split, config, name"
    )
    dataset_id: str | None = Field(description="a dataset pull's stored dataset, once it succeeded")
    details: list[dict[str, Any]] = Field(
        description="a dataset pull that failed on invalid rows: the first ones, by line, as an upload's"
    )
    error: str | None
    error_code: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class TransfersPublic(BaseModel):
    data: list[TransferPublic]


class ModelDeleted(BaseModel):
    name: str
    freed_bytes: int


class SweepRange(BaseModel):
    """A random search's interval of one field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min: float = Field(gt=0)
    max: float = Field(gt=0)
    log: bool = Field(False, description="draw log-uniformly (learning rates)")


class SweepCreate(BaseModel):
    """A job body searched over named fields (``hyper.learning_rate`` or ``learning_rate``,
    ``method.lora_r``, ``method.lora_alpha``, ``hyper.epochs``, ``hyper.batch_size``,
    ``method.beta``, ...): a grid of value lists, or random draws from lists or intervals."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Line | None = None
    job: JobCreate = Field(description="the body of POST /api/jobs every trial starts from")
    search: Literal["grid", "random"] = "grid"
    parameters: dict[str, list[float] | SweepRange] = Field(
        description='field -> values (grid, random) or {"min", "max", "log"} (random)'
    )
    trials: int | None = Field(
        None, ge=1, le=64, description="random: how many; grid: at most (default: all)"
    )
    seed: int = Field(0, ge=0, le=MAX_INT, description="the random search's draws")
    metric: Line = Field("loss/val", description="what ranks the trials (a metric the runs log)")
    goal: Literal["minimize", "maximize"] = "minimize"
    early_stopping: bool = Field(
        False, description="stop a trial whose metric is worse than the median of the others at the same step"
    )


class SweepTrialPlan(BaseModel):
    params: dict[str, float]
    fits: bool
    eta_s: float | None = Field(description="the trial end to end: steps_s plus overhead_s")
    steps_s: float | None = Field(None, description="its steps (its plan's eta_s)")
    overhead_s: float | None = Field(
        None,
        description="what it costs besides its steps: the trainer's start, the model's load, the data's "
        "preparation, the first step's warm-up, validation passes, checkpoints (its plan's overheads)",
    )
    problems: list[str]


class SweepPlanPublic(BaseModel):
    eta_s: float | None = Field(
        description="every trial end to end, one after another (null: some trial has no ETA)"
    )
    fits: bool = Field(description="every trial fits the workers")
    estimate: Literal["planner", "calibrated", "measured"] = Field(
        "planner",
        description="what priced the trials (the least measured of theirs): this box's measured times, a "
        "job that ran this model here (measured: its rate and overheads; calibrated: its rate), or the "
        "planner's assumptions",
    )
    calibrated_from: str | None = Field(None, description="the job whose measured times priced them")
    trials: list[SweepTrialPlan]


class SweepTrialPublic(BaseModel):
    index: int
    job_id: str
    name: str | None
    params: dict[str, float]
    status: str = Field(description="the job's status, or deleted")
    step: int | None
    total_steps: int | None
    metric: float | None = Field(description="its best value of the sweep's metric so far")
    last_metric: float | None
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None
    stopped_early: dict[str, Any] | None = Field(description="why early stopping ended it, if it did")


class SweepPublic(BaseModel):
    id: str
    name: str
    status: Literal["running", "cancelling", "cancelled", "finished"]
    metric: str
    goal: str
    search: str
    parameters: dict[str, Any]
    early_stopping: bool
    job: dict[str, Any]
    plan: SweepPlanPublic
    created_at: datetime
    cancelled_at: datetime | None
    trials: list[SweepTrialPublic]
    best_job_id: str | None = Field(description="the succeeded trial with the best metric")


class SweepsPublic(BaseModel):
    data: list[SweepPublic]
