"""Will a job fit, and how long will it take? A plan from a model's ``config.json`` and the hardware.

Pure arithmetic on the model's shapes (no weights, no torch): parameter counts per engine layer
(input layer, decoder blocks, output layer), the host RAM RoundPipe needs (the compute copy of the
weights, fp32 masters, gradients and AdamW moments of the trainable parameters, the stage inputs
kept for recompute), and per stage the GPU memory (the stage's weights twice — current and
prefetched — its activations, and for the fused stage the logits). Times come from FLOPs at an
assumed fraction of the GPUs' peak rate; the engine's own partitioner picks the stages within the
GPU memory, and the schedule simulator (physical mode, weight uploads over the host link) gives the
iteration time. A job that ran calibrates the rate: ``calibrate`` scales the assumed efficiency by
measured over predicted throughput. The job comes in as the run's own ``TrainConfig``
(``Workload.from_train_config``), so the CLI, the service and the web form plan the same thing.

The estimates are first-order: activation sizes assume fused (flash) attention, the optimizer is
assumed hidden behind the next iteration unless it is slower than it, and communication other than
weight uploads and stage-boundary hops is ignored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.config import TrainConfig, resolve_compute_dtype
from engine.errors import ConfigError
from engine.model.families import DEFAULT_LORA_TARGETS
from engine.optimizers import optimizer_spec
from engine.parallel.partition import LayerCost, Plan, auto_partition, stage_memory
from engine.simulation.simulate import closed_form_bubble, simulate

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_OVERHEAD_BYTES = 0.8 * GB  # CUDA context, allocator slack and workspace per GPU
MASTER_AND_GRAD_BYTES_PER_PARAM = 8  # fp32 master 4 + gradient 4; the optimizer state comes on top
OPTIMIZER_PARAMS_PER_S = 1.5e9  # fused CPU AdamW (memory-bound, ~28 bytes moved per parameter)

# The range of each hardware number a plan accepts: every real box lies well inside (an 8 GB
# consumer card to a 1 TB accelerator, an old PCIe 1.0 x4 link to NVLink-C2C), and anywhere in it
# the arithmetic neither divides by (almost) zero nor overflows. The API documents the same ranges.
HARDWARE_RANGES: dict[str, tuple[float, float]] = {
    "num_gpus": (1, 64),
    "gpu_memory_gb": (1.0, 1024.0),  # a card with less cannot hold the CUDA context and a layer
    "gpu_tflops": (1.0, 100_000.0),
    "efficiency": (0.001, 1.0),
    "link_gb_s": (0.1, 10_000.0),
    "host_ram_gb": (1.0, 1_048_576.0),
}
# The largest value of each size in a config.json a plan accepts: far above any real model (the
# largest open ones have ~128 layers, hidden 16k, vocabularies of 256k), small enough that the FLOP
# and byte counts stay finite floats. Depth is held closer: the partition search grows fast with
# it (256 layers take seconds, 1024 minutes).
SHAPE_LIMITS: dict[str, int] = {
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_hidden_layers": 256,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
}
# the workload's counts, likewise (TrainConfig has the same limits or tighter ones)
WORKLOAD_LIMITS: dict[str, int] = {
    "seq_len": 1 << 20,
    "batch_size": 1 << 20,
    "num_microbatches": 4096,
    "lora_r": 4096,
}


@dataclass(frozen=True)
class Shape:
    """What a decoder-only model's ``config.json`` says about its sizes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shape:
        """Read the sizes of a Llama/Qwen/Mistral-style config (text config of a multimodal one).

        Raises:
            ConfigError: a size is missing or not a positive integer (``field`` is its key).
        """
        cfg = config.get("text_config") or config
        if not isinstance(cfg, dict):
            raise ConfigError("text_config", f"config.json: text_config={cfg!r} must be a mapping")
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        sizes = {key: _size(key, cfg.get(key)) for key in need}
        for key in ("num_key_value_heads", "head_dim"):  # optional: derived when absent
            if cfg.get(key) is not None:
                sizes[key] = _size(key, cfg[key])
        heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        head_dim = sizes.get("head_dim", hidden // heads)
        if head_dim < 1:
            raise ConfigError(
                "num_attention_heads",
                f"config.json: num_attention_heads={heads} exceeds hidden_size={hidden} (no head_dim given)",
            )
        return cls(
            hidden=hidden,
            intermediate=sizes["intermediate_size"],
            layers=sizes["num_hidden_layers"],
            heads=heads,
            kv_heads=sizes.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab=sizes["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one decoder block."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def block_params(self) -> int:
        return sum(a * b for a, b in self.linears().values()) + 2 * self.hidden  # + two RMSNorm weights

    def layer_params(self) -> list[int]:
        """Parameters per engine layer: input layer, each block, output layer (a tied head counts once)."""
        embed = self.vocab * self.hidden
        head = self.hidden + (0 if self.tied else embed)
        return [embed, *[self.block_params()] * self.layers, head]

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable parameters of one block's LoRA adapters."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        # families that fuse projections (Phi3: qkv_proj and gate_up_proj; GLM-4: gate_up_proj)
        fused = {"qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
        sizes = self.linears() | fused
        return sum(rank * (a + b) for name, (a, b) in sizes.items() if name in targets)


def _size(key: str, value: Any) -> int:
    """A config.json size: a positive integer within ``SHAPE_LIMITS``, else ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SHAPE_LIMITS[key]:
        raise ConfigError(
            key, f"config.json: {key}={value!r} must be an integer from 1 to {SHAPE_LIMITS[key]}", value=value
        )
    return value


@dataclass(frozen=True)
class Hardware:
    """The box: GPUs, their memory and rate, the host link and RAM."""

    num_gpus: int = 2
    gpu_memory_gb: float = 24.0
    gpu_tflops: float = 165.0  # dense bf16 tensor rate of an RTX 4090
    link_gb_s: float = 25.0  # host <-> GPU, one direction, PCIe 4.0 x16 in practice
    host_ram_gb: float | None = None
    efficiency: float = 0.4  # achieved fraction of the peak rate
    detected: tuple[str, ...] = ()  # which fields were read off the machine


@dataclass(frozen=True)
class Workload:
    """The job: sequence length, batch, method and engine settings."""

    seq_len: int = 2048
    batch_size: int = 16
    method: str = "lora"
    lora_r: int = 16
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    optimizer: str = "adamw"
    num_microbatches: int = 16
    compute_dtype: str = "bfloat16"
    async_optimizer: bool = False
    steps: int | None = None

    @classmethod
    def from_train_config(
        cls, config: TrainConfig, *, on_gpu: bool = True, num_sequences: int | None = None
    ) -> Workload:
        """The workload of a run: the one place a ``TrainConfig`` becomes the planner's input.

        Args:
            config: the run (the CLI's file, a job's stored config, a job request's sections).
            on_gpu: what ``compute_dtype="auto"`` resolves for (the planner plans GPU workers).
            num_sequences: training sequences, when known; with ``hyper.epochs`` and no
                ``hyper.max_steps`` they give the step count the run will take.

        Returns:
            The workload; ``steps`` is None when neither ``max_steps`` nor ``num_sequences`` is known.
        """
        h, e, m = config.hyper, config.engine, config.method
        steps = h.max_steps
        if steps is None and num_sequences is not None:
            # the run's own count (engine/run.py): whole batches per epoch, at least one step
            steps = max(1, math.ceil((h.epochs or 1.0) * (num_sequences // h.batch_size)))
        return cls(
            seq_len=config.data.max_length,
            batch_size=h.batch_size,
            method=m.kind,
            lora_r=m.lora_r,
            target_modules=tuple(m.target_modules),
            num_microbatches=e.num_microbatches,
            compute_dtype=resolve_compute_dtype(e.compute_dtype, on_gpu=on_gpu),
            async_optimizer=e.async_optimizer,
            optimizer=h.optimizer,
            steps=steps,
        )


@dataclass
class PlanReport:
    fits: bool
    problems: list[str]
    suggestions: list[str]
    parameters: int
    trainable: int
    host_ram: dict[str, float]
    stages: list[dict[str, Any]]
    partition: str
    gpu_memory_needed_gb: float
    gpu_memory_gb: float
    iteration_s: float
    tokens_per_s: float
    bubble: float
    closed_form_bubble: float
    eta_s: float | None
    assumptions: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The report as text, for the command line."""
        lines = [
            f"fits: {'yes' if self.fits else 'no'}",
            *[f"  problem: {p}" for p in self.problems],
            *[f"  try: {s}" for s in self.suggestions],
            f"parameters: {self.parameters / 1e6:,.1f}M, trainable {self.trainable / 1e6:,.2f}M",
            "host RAM: "
            + ", ".join(
                f"{k.removesuffix('_gb').replace('_', ' ')} {v:.2f} GB" for k, v in self.host_ram.items()
            ),
            f"GPU memory: {self.gpu_memory_needed_gb:.2f} GB of {self.gpu_memory_gb:g} GB per GPU",
        ]
        if self.stages:
            lines.append(f"partition: {self.partition}")
            lines += [
                f"  {s['name']:>4} {s['kind']:<8} layers {s['layers'][0]}-{s['layers'][1]}: "
                f"{s['gpu_memory_gb']:.2f} GB"
                for s in self.stages
            ]
            lines.append(
                f"iteration: {self.iteration_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, bubble "
                f"{100 * self.bubble:.1f}% (closed form {100 * self.closed_form_bubble:.1f}%)"
            )
        if self.eta_s is not None:
            lines.append(f"ETA: {self.eta_s / 3600:.2f} h")
        a = self.assumptions
        lines.append(
            f"assumed: {a['gpu_tflops']:g} TFLOPS per GPU at {100 * a['efficiency']:.0f}% efficiency, "
            f"{a['link_gb_s']:g} GB/s host link"
            + (f"; detected: {', '.join(a['detected'])}" if a["detected"] else "")
        )
        return "\n".join(lines)


def bytes_per_trainable_param(optimizer: str) -> int:
    """Host bytes per trainable parameter: fp32 master and gradient, plus the optimizer's state."""
    return (
        MASTER_AND_GRAD_BYTES_PER_PARAM + optimizer_spec(optimizer, field="optimizer").state_bytes_per_param
    )


def _check(workload: Workload, hardware: Hardware) -> None:
    w, h = workload, hardware
    counts = {name: (1, top) for name, top in WORKLOAD_LIMITS.items()}
    counts["num_gpus"] = (1, int(HARDWARE_RANGES["num_gpus"][1]))
    for name, (low, high) in counts.items():
        value = getattr(h if name == "num_gpus" else w, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(name, f"{name}={value!r} must be an integer from {low} to {high}", value=value)
    if w.num_microbatches > w.batch_size:
        raise ConfigError(
            "num_microbatches", f"num_microbatches={w.num_microbatches} exceeds batch_size={w.batch_size}"
        )
    if w.method not in ("lora", "full"):
        raise ConfigError("method", f"method={w.method!r} must be 'lora' or 'full'")
    if w.compute_dtype not in DTYPE_BYTES:
        raise ConfigError(
            "compute_dtype", f"compute_dtype={w.compute_dtype!r} must be one of {sorted(DTYPE_BYTES)}"
        )
    for label in ("gpu_memory_gb", "gpu_tflops", "link_gb_s", "efficiency", "host_ram_gb"):
        rate, (least, most) = getattr(h, label), HARDWARE_RANGES[label]
        if rate is None and label == "host_ram_gb":
            continue
        if isinstance(rate, bool) or not (isinstance(rate, int | float) and least <= rate <= most):
            raise ConfigError(
                label, f"{label}={rate!r} must be a number from {least:g} to {most:g}", value=rate
            )


def layer_costs(shape: Shape, workload: Workload, hardware: Hardware) -> tuple[list[LayerCost], list[float]]:
    """Per engine layer: times per micro-batch (seconds) and GPU bytes, and the parameter bytes."""
    w = workload
    dtype = DTYPE_BYTES[w.compute_dtype]
    tokens = w.batch_size * w.seq_len / w.num_microbatches  # per micro-batch
    rate = hardware.gpu_tflops * 1e12 * hardware.efficiency
    lora = w.method == "lora"
    # backward: input gradients (one forward's FLOPs) plus weight gradients (another) when trained
    bwd_factor = 1.0 if lora else 2.0
    params = shape.layer_params()
    param_bytes = [float(p * dtype) for p in params]
    # saved for backward per token and block: norm inputs, q/k/v/o, the MLP's gate/up/act outputs
    act_block = dtype * (6 * shape.hidden + 2 * shape.kv_heads * shape.head_dim + 3 * shape.intermediate)
    boundary = tokens * shape.hidden * dtype
    costs = []
    for i, p in enumerate(params):
        if i == 0:  # embedding lookup
            fwd = 0.0
            act = boundary
        elif i == len(params) - 1:  # final norm, LM head, loss: logits and their gradient in fp32
            fwd = 2.0 * shape.hidden * shape.vocab * tokens / rate
            act = boundary + 2 * tokens * shape.vocab * 4
        else:
            fwd = (
                (2.0 * shape.block_params() + 2.0 * w.seq_len * shape.heads * shape.head_dim) * tokens / rate
            )
            act = tokens * act_block
        trained_grads = 0.0 if lora else p * dtype  # weight gradients leave the GPU as they are made
        costs.append(
            LayerCost(
                forward=fwd,
                backward=bwd_factor * fwd,
                memory_forward=2 * p * dtype + boundary,  # current and prefetched weights
                memory_backward=2 * p * dtype + act + trained_grads,
            )
        )
    return costs, param_bytes


def plan_job(config: dict[str, Any], hardware: Hardware, workload: Workload) -> PlanReport:
    """Memory, fit and speed of a fine-tune on a box.

    Args:
        config: the base model's ``config.json`` as a dict.
        hardware: the GPUs, link and host RAM.
        workload: sequence length, batch, method, engine settings and (optionally) steps.

    Returns:
        A :class:`PlanReport`; ``fits`` is False with ``problems`` and ``suggestions`` when it does not.

    Raises:
        ConfigError: a bad config.json size or setting; ``field`` names it (a ``ValueError``).
    """
    _check(workload, hardware)
    shape = Shape.from_config(config)
    try:
        return _report(shape, hardware, workload)
    except (ZeroDivisionError, OverflowError) as exc:  # the ranges above should make this unreachable
        raise ConfigError("config", f"these sizes and this hardware give no finite plan ({exc})") from exc


def _report(shape: Shape, hardware: Hardware, workload: Workload) -> PlanReport:
    w, h = workload, hardware
    dtype = DTYPE_BYTES[w.compute_dtype]
    params = shape.layer_params()
    total = sum(params)
    trainable = total if w.method == "full" else shape.layers * shape.lora_params(w.lora_r, w.target_modules)
    costs, param_bytes = layer_costs(shape, w, h)
    budget = h.gpu_memory_gb * GB - CUDA_OVERHEAD_BYTES
    problems: list[str] = []
    suggestions: list[str] = []
    n, m = h.num_gpus, w.num_microbatches
    largest = max(max(c.memory_forward, c.memory_backward) for c in costs)
    plan: Plan | None = None
    if largest > budget:
        problems.append(
            f"one layer needs {largest / GB:.1f} GB on a GPU at {w.batch_size * w.seq_len // m} tokens per "
            f"micro-batch; {h.gpu_memory_gb:g} GB GPUs leave {budget / GB:.1f} GB"
        )
        if m < w.batch_size:
            suggestions.append(
                f"more micro-batches (num_microbatches up to {w.batch_size}) or a shorter seq_len"
            )
        else:
            suggestions.append("a shorter seq_len or a smaller batch_size")
    else:
        plan = auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
    tokens = w.batch_size * w.seq_len
    boundaries = len(plan.checkpoint_boundaries()) if plan is not None else 1
    host = {
        "weights_gb": total * dtype / GB,
        "optimizer_gb": trainable * bytes_per_trainable_param(w.optimizer) / GB,
        "second_weights_buffer_gb": (trainable * dtype / GB) if w.async_optimizer else 0.0,
        "stage_inputs_gb": boundaries * tokens * shape.hidden * dtype / GB,
    }
    host["total_gb"] = sum(host.values())
    if h.host_ram_gb is not None and host["total_gb"] > 0.9 * h.host_ram_gb:
        problems.append(f"host RAM: needs {host['total_gb']:.1f} GB, the host has {h.host_ram_gb:g} GB")
        if w.method == "full":
            suggestions.append("LoRA instead of a full fine-tune (no fp32 copy and moments of every weight)")
        suggestions.append("a host with more RAM, or a smaller model")
    stages: list[dict[str, Any]] = []
    iteration = bubble = closed = 0.0
    if plan is not None:
        for stage in plan.slots:
            stages.append(
                {
                    "name": stage.name,
                    "kind": stage.kind,
                    "layers": [stage.start, stage.stop],
                    "gpu_memory_gb": (stage_memory(stage, costs) + CUDA_OVERHEAD_BYTES) / GB,
                }
            )
        # async: the period of iterations chained without a flush; sync: one iteration, then the flush
        result = simulate(
            "roundpipe-async-steady" if w.async_optimizer else "roundpipe-sync",
            costs,
            num_workers=n,
            num_microbatches=m,
            hop=2 * (tokens / m) * shape.hidden * dtype / (h.link_gb_s * GB),  # down, then up
            plan=plan,
            mode="physical",
            param_bytes=param_bytes,
            bandwidth=h.link_gb_s * GB,
            round_size=m,  # the engine's default: one round of every micro-batch
            rotation="fixed",
        )
        optimizer_s = trainable / OPTIMIZER_PARAMS_PER_S
        iteration = max(result.makespan, optimizer_s)
        bubble = result.bubble
        closed = closed_form_bubble(num_workers=n, num_microbatches=m, num_slots=plan.num_slots)
    need = max((s["gpu_memory_gb"] for s in stages), default=largest / GB)
    return PlanReport(
        fits=not problems,
        problems=problems,
        suggestions=suggestions,
        parameters=total,
        trainable=trainable,
        host_ram=host,
        stages=stages,
        partition=plan.describe() if plan is not None else "",
        gpu_memory_needed_gb=need,
        gpu_memory_gb=h.gpu_memory_gb,
        iteration_s=iteration,
        tokens_per_s=tokens / iteration if iteration > 0 else 0.0,
        bubble=bubble,
        closed_form_bubble=closed,
        eta_s=iteration * w.steps if (w.steps and iteration) else None,
        assumptions={
            "gpu_tflops": h.gpu_tflops,
            "efficiency": h.efficiency,
            "link_gb_s": h.link_gb_s,
            "detected": list(h.detected),
            "optimizer_params_per_s": OPTIMIZER_PARAMS_PER_S,
        },
    )


def calibrate(hardware: Hardware, *, predicted_tokens_per_s: float, measured_tokens_per_s: float) -> Hardware:
    """The hardware with its efficiency scaled so a past job's prediction matches its measurement
    (kept within ``HARDWARE_RANGES["efficiency"]``).

    Raises:
        ValueError: a non-positive throughput.
    """
    if not (predicted_tokens_per_s > 0 and measured_tokens_per_s > 0):
        raise ValueError(
            "throughputs must be positive "
            f"(predicted {predicted_tokens_per_s!r}, measured {measured_tokens_per_s!r})"
        )
    scaled = hardware.efficiency * measured_tokens_per_s / predicted_tokens_per_s
    low, high = HARDWARE_RANGES["efficiency"]
    return replace(hardware, efficiency=min(high, max(low, scaled)))
