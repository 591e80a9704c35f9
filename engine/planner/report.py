"""The plan of one job on one box: fit, memory by term, time, and the longest sequence that fits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.errors import ConfigError
from engine.methods.reference import reference_seconds
from engine.model.families import DEFAULT_LORA_TARGETS, FAMILIES
from engine.planner.memory import (
    CUDA_OVERHEAD_BYTES,
    Memory,
    fitting_plan,
    layer_times,
    layers_fit,
    memory_model,
)
from engine.planner.shapes import Shape
from engine.planner.workload import (
    DTYPE_BYTES,
    GB,
    HARDWARE_RANGES,
    WORKLOAD_LIMITS,
    Hardware,
    Workload,
    bytes_per_trainable_param,
    check,
)
from engine.scheduling.partition import LayerCost, Plan
from engine.scheduling.simulate import closed_form_bubble, simulate

OPTIMIZER_PARAMS_PER_S = 1.5e9  # fused CPU AdamW (memory-bound, ~28 bytes moved per parameter)
HOST_RAM_SHARE = 0.9  # of the host's RAM a job may plan to use (the OS and the service need some)
SEQ_LEN_STEP = 64  # the longest sequence that fits is a multiple of this (or the model's context)
GUESSES = 3  # partitions the host-RAM edge search guesses with before it halves


@dataclass
class PlanReport:
    """What :func:`plan_job` answers; every size in GB (1e9 bytes).

    ``stages`` list each stage's layers and GPU memory on its worker, with the terms of
    ``engine.planner.memory`` (``memory_gb``). ``max_seq_len`` is the longest sequence (tokens
    per sequence, at the job's sequences per micro-batch) whose plan fits, a multiple of
    ``SEQ_LEN_STEP``; ``max_seq_len_limit`` says what stops it: ``"gpu_memory"``,
    ``"host_ram"``, ``"context"`` (the model's ``max_position_embeddings``) or ``"planner"``
    (the largest ``seq_len`` a plan takes).

    A DPO job's step trains 2 sequences a pair (``tokens_per_s`` counts both); ``reference_s`` is
    its reference pass (a forward over every training and validation pair, once, before the first
    step), part of ``eta_s``; None for a supervised job or when the pair count is unknown.
    """

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
    max_seq_len: int = 0
    max_seq_len_limit: str = "gpu_memory"
    workers_per_gpu: int = 1
    reference_s: float | None = None
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
            (
                f"worker memory (host RAM): {self.gpu_memory_needed_gb:.2f} GB of {self.gpu_memory_gb:.1f} GB"
                if self.assumptions.get("device") == "cpu"
                else f"GPU memory: {self.gpu_memory_needed_gb:.2f} GB of {self.gpu_memory_gb:g} GB per GPU"
            )
            + (f" ({self.workers_per_gpu} workers per GPU)" if self.workers_per_gpu > 1 else ""),
            f"longest sequence that fits: {self.max_seq_len:,} tokens (limited by "
            f"{self.max_seq_len_limit.replace('_', ' ')})",
        ]
        if self.stages:
            lines.append(f"partition: {self.partition}")
            for s in self.stages:
                terms = ", ".join(f"{k} {v:.2f}" for k, v in s["memory_gb"].items() if v and k != "total")
                lines.append(
                    f"  {s['name']:>4} {s['kind']:<8} layers {s['layers'][0]}-{s['layers'][1]}: "
                    f"{s['gpu_memory_gb']:.2f} GB ({terms})"
                )
            lines.append(
                f"iteration: {self.iteration_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, bubble "
                f"{100 * self.bubble:.1f}% (closed form {100 * self.closed_form_bubble:.1f}%)"
            )
        a = self.assumptions
        if a.get("objective", "sft") != "sft":  # a preference method: pairs, maybe a reference pass
            pairs = a.get("reference_pairs")
            lines.append(
                f"{a['objective'].upper()}: 2 sequences a pair ({a['sequences_per_step']:,} a step); "
                + (
                    "no reference pass"
                    if not a.get("needs_reference")
                    else f"reference pass over {pairs:,} pairs: {self.reference_s:.1f} s (in the ETA)"
                    if pairs is not None and self.reference_s is not None
                    else "reference pass not counted (the pair count is unknown)"
                )
            )
        if self.eta_s is not None:
            lines.append(f"ETA: {self.eta_s / 3600:.2f} h")
        rate = (
            f"{1000 * a['gpu_tflops']:g} GFLOP/s fp32 achieved on the CPU"
            if a["device"] == "cpu"
            else f"{a['gpu_tflops']:g} TFLOPS per GPU at {100 * a['efficiency']:.0f}% efficiency, "
            f"{a['link_gb_s']:g} GB/s host link"
        )
        lines.append(
            f"assumed: {a['hardware']}; {rate}; {a['tokens_per_sequence']:,.0f} tokens per sequence"
            + (" (from the data)" if a["tokens_from_data"] else " (max_length)")
            + (f"; detected: {', '.join(a['detected'])}" if a["detected"] else "")
        )
        return "\n".join(lines)


@dataclass
class _Assessment:
    """One job's memory on one box: what the report and the sequence search share."""

    memory: Memory
    costs: list[LayerCost]
    plan: Plan | None
    host: dict[str, float]
    trainable: int

    def limit(self, hardware: Hardware) -> str | None:
        """The resource the job does not fit, or None."""
        if self.plan is None:
            return "gpu_memory"
        if hardware.host_ram_gb is not None and self.host["total_gb"] > HOST_RAM_SHARE * hardware.host_ram_gb:
            return "host_ram"
        return None


def lora_targets(shape: Shape, workload: Workload) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules and parameters LoRA adapts, as the run resolves them (``engine.training.run``): the
    family's own modules when the run kept the default, ``"experts"`` its expert weights."""
    spec = FAMILIES.get(shape.architecture or "")
    modules = workload.target_modules
    if spec is not None and tuple(modules) == tuple(DEFAULT_LORA_TARGETS):
        modules = spec.lora_targets
    experts = tuple(getattr(spec, "expert_parameters", ()))
    parameters: list[str] = []
    for name in workload.target_parameters:
        parameters += [p for p in (experts if name == "experts" else (name,)) if p not in parameters]
    return tuple(modules), tuple(parameters)


def _trainable(shape: Shape, workload: Workload) -> list[int]:
    w = workload
    if w.tuning == "full":
        return shape.layer_params()
    modules, parameters = lora_targets(shape, w)
    blocks = [shape.lora_block_params(b, w.lora_r, modules, parameters) for b in range(shape.layers)]
    return [0, *blocks, 0]


def _assess(shape: Shape, workload: Workload, hardware: Hardware) -> _Assessment:
    w = workload
    per_layer = _trainable(shape, w)
    memory = memory_model(shape, w, hardware, per_layer)
    costs = memory.costs(layer_times(shape, w, hardware))
    plan = fitting_plan(
        memory, costs, num_workers=w.num_workers(hardware), num_microbatches=w.num_microbatches
    )
    trainable = sum(per_layer)
    boundaries = len(plan.checkpoint_boundaries()) if plan is not None else 1
    return _Assessment(memory, costs, plan, _host_ram(shape, w, trainable, boundaries), trainable)


def _host_ram(shape: Shape, workload: Workload, trainable: int, boundaries: int) -> dict[str, float]:
    """Host RAM by term (GB): the compute copy of the weights, the trainable weights' fp32
    masters, gradients and optimizer state (and a second copy in async mode), and the inputs of
    the stages that recompute (``boundaries`` of them) for every sequence of the batch (both of
    each DPO pair)."""
    w = workload
    dtype = DTYPE_BYTES[w.compute_dtype]
    host = {
        "weights_gb": sum(shape.layer_params()) * dtype / GB,
        "optimizer_gb": trainable * bytes_per_trainable_param(w.optimizer) / GB,
        "second_weights_buffer_gb": (trainable * dtype / GB) if w.async_optimizer else 0.0,
        "stage_inputs_gb": boundaries * w.sequences * w.seq_len * shape.hidden * dtype / GB,
    }
    host["total_gb"] = sum(host.values())
    return host


def longest_sequence(shape: Shape, workload: Workload, hardware: Hardware) -> tuple[int, str]:
    """The longest ``seq_len`` (a multiple of ``SEQ_LEN_STEP``, or the model's context) whose
    plan fits, at the job's batch and micro-batch count, and what stops a longer one.

    A binary search: the GPUs' part of the fit is checked per layer (cheap, and exactly the plan's
    rule, see ``engine.planner.memory.layers_fit``); the host's, which depends on the partition
    (its stage inputs), only where the GPUs fit and bounds on the stage count leave it open. The
    search keeps "the lower end fits, the upper does not", so the answer fits and one step more
    does not.

    Returns:
        ``(tokens, limit)``; ``(0, resource)`` when not even ``SEQ_LEN_STEP`` tokens fit.
    """
    top, top_limit = WORKLOAD_LIMITS["seq_len"], "planner"
    if shape.context is not None and shape.context < top:
        top, top_limit = shape.context, "context"
    steps = -(-top // SEQ_LEN_STEP)

    def length(k: int) -> int:
        return min(k * SEQ_LEN_STEP, top)

    def at(k: int) -> Workload:
        return replace(workload, seq_len=length(k))

    def gpu_fits(k: int) -> bool:
        return layers_fit(memory_model(shape, at(k), hardware, _trainable(shape, workload)))

    lo, hi = 0, steps + 1  # k = lo fits (0: nothing), k = hi does not (past the top)
    while hi - lo > 1:  # the GPUs alone first
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if gpu_fits(mid) else (lo, mid)
    stop = "gpu_memory" if hi <= steps else top_limit
    if not lo or hardware.host_ram_gb is None:
        return length(lo), stop
    # host RAM is fixed + B x seq_len x per_token, B (checkpoint boundaries: the fused and backward
    # stages' starts) at most the engine layers less one: below that bound's edge every length
    # fits; above it a partition tells, and the last one's B guesses the edge
    fixed = _host_ram(shape, workload, sum(_trainable(shape, workload)), 0)["total_gb"] * GB
    room = HOST_RAM_SHARE * hardware.host_ram_gb * GB - fixed
    per_token = workload.sequences * shape.hidden * DTYPE_BYTES[workload.compute_dtype]

    def edge_at(boundaries: float) -> int:  # the last k that fits with this many boundaries
        return int(max(room, 0.0) / (boundaries * per_token) // SEQ_LEN_STEP)

    sure = edge_at((shape.layers + 1) * (1 + 1e-9))
    if sure >= lo:
        return length(lo), stop
    edge = _assess(shape, at(lo), hardware)
    if edge.limit(hardware) is None:
        return length(lo), stop
    lo, hi, stop = sure, lo, "host_ram"
    boundaries, probes = _boundaries(edge), 0
    while hi - lo > 1:
        # near the edge the partition, hence B, hardly changes: the guess (or the step past the
        # lower end when the guess is it) closes the bracket in a probe or two; halving after that
        guess = min(max(edge_at(boundaries), lo + 1), hi - 1)
        mid = guess if probes < GUESSES else (lo + hi) // 2
        probes += 1
        probe = _assess(shape, at(mid), hardware)
        boundaries = _boundaries(probe)
        lo, hi = (mid, hi) if probe.limit(hardware) is None else (lo, mid)
    return length(lo), stop


def _boundaries(assessment: _Assessment) -> int:
    plan = assessment.plan
    return max(1, len(plan.checkpoint_boundaries())) if plan is not None else 1


def plan_job(config: dict[str, Any], hardware: Hardware, workload: Workload) -> PlanReport:
    """Memory, fit and speed of a fine-tune on a box, and the longest sequence that fits.

    Args:
        config: the base model's ``config.json`` as a dict.
        hardware: the GPUs, link and host RAM.
        workload: sequence length, batch, method, engine settings and (optionally) steps.

    Returns:
        A :class:`PlanReport`; ``fits`` is False with ``problems`` and ``suggestions`` when it does not.

    Raises:
        ConfigError: a bad config.json size or setting; ``field`` names it (a ``ValueError``).
    """
    check(workload, hardware)
    shape = Shape.from_config(config)
    try:
        return _report(shape, hardware, workload)
    except (ZeroDivisionError, OverflowError) as exc:  # the ranges above should make this unreachable
        raise ConfigError("config", f"these sizes and this hardware give no finite plan ({exc})") from exc


def _report(shape: Shape, hardware: Hardware, workload: Workload) -> PlanReport:
    w, h = workload, hardware
    dtype = DTYPE_BYTES[w.compute_dtype]
    a = _assess(shape, w, h)
    memory, plan, host = a.memory, a.plan, a.host
    share = w.workers_per_gpu()
    problems: list[str] = []
    suggestions: list[str] = []
    n, m = w.num_workers(h), w.num_microbatches
    longest, stop = longest_sequence(shape, w, h)
    if plan is None:
        per = f"{h.gpu_memory_gb:g} GB GPUs leave {memory.capacity / GB:.1f} GB" + (
            f" per worker ({share} share a GPU)" if share > 1 else ""
        )
        problems.append(
            f"one layer needs {memory.largest_layer() / GB:.1f} GB on a GPU (with the next stage's "
            f"weights) at {w.sequences * w.seq_len // m} tokens per micro-batch; {per}"
        )
        if longest:
            suggestions.append(f"seq_len {longest} or shorter (the longest that fits)")
        if m < w.batch_size:
            suggestions.append(f"more micro-batches (num_microbatches up to {w.batch_size})")
        else:
            suggestions.append("a shorter seq_len or a smaller batch_size")
    if a.limit(h) == "host_ram":
        problems.append(f"host RAM: needs {host['total_gb']:.1f} GB, the host has {h.host_ram_gb:g} GB")
        if stop == "host_ram" and longest:
            suggestions.append(f"seq_len {longest} or shorter (the longest whose stage inputs fit)")
        if w.tuning == "full":
            suggestions.append("LoRA instead of a full fine-tune (no fp32 copy and moments of every weight)")
        suggestions.append("a host with more RAM, or a smaller model")
    stages: list[dict[str, Any]] = []
    iteration = bubble = closed = 0.0
    overhead = CUDA_OVERHEAD_BYTES / share
    if plan is not None:
        for i, stage in enumerate(plan.slots):
            terms = memory.stage_terms(plan, i, n)
            stages.append(
                {
                    "name": stage.name,
                    "kind": stage.kind,
                    "layers": [stage.start, stage.stop],
                    "gpu_memory_gb": (terms["total"] + overhead) / GB,
                    "memory_gb": {k: v / GB for k, v in terms.items()},
                }
            )
        tokens = w.sequences * w.timed_seq_len
        # async: the period of iterations chained without a flush; sync: one iteration, then the flush
        result = simulate(
            "roundpipe-async-steady" if w.async_optimizer else "roundpipe-sync",
            a.costs,
            num_workers=n,
            num_microbatches=m,
            hop=2 * (tokens / m) * shape.hidden * dtype / (h.link_gb_s * GB),  # down, then up
            plan=plan,
            mode="physical",
            param_bytes=memory.weights,
            bandwidth=h.link_gb_s * GB,
            round_size=m,  # the engine's default: one round of every micro-batch
            rotation="fixed",
        )
        iteration = max(result.makespan, a.trainable / OPTIMIZER_PARAMS_PER_S)
        bubble = result.bubble
        closed = closed_form_bubble(num_workers=n, num_microbatches=m, num_slots=plan.num_slots)
    worker = max((s["gpu_memory_gb"] for s in stages), default=(memory.largest_layer() + overhead) / GB)
    reference = reference_seconds(shape, w, h, plan, memory.weights) if plan is not None else None
    eta = iteration * w.steps + (reference or 0.0) if (w.steps and iteration) else None
    return PlanReport(
        fits=not problems,
        problems=problems,
        suggestions=suggestions,
        parameters=sum(shape.layer_params()),
        trainable=a.trainable,
        host_ram=host,
        stages=stages,
        partition=plan.describe() if plan is not None else "",
        gpu_memory_needed_gb=worker * share,
        gpu_memory_gb=h.gpu_memory_gb,
        iteration_s=iteration,
        tokens_per_s=w.sequences * w.timed_seq_len / iteration if iteration > 0 else 0.0,
        bubble=bubble,
        closed_form_bubble=closed,
        eta_s=eta,
        max_seq_len=longest,
        max_seq_len_limit=stop,
        workers_per_gpu=share,
        reference_s=reference,
        assumptions={
            "device": h.device,
            "hardware": hardware_label(h),
            "tokens_per_sequence": w.timed_seq_len,
            "tokens_from_data": w.mean_seq_len is not None,
            "gpu_tflops": h.gpu_tflops,
            "efficiency": h.efficiency,
            "link_gb_s": h.link_gb_s,
            "detected": list(h.detected),
            "optimizer_params_per_s": OPTIMIZER_PARAMS_PER_S,
            "loss_chunk_tokens": w.loss_chunk_tokens,
            "method": w.method,
            "objective": w.objective,
            "tuning": w.tuning,
            "needs_reference": w.needs_reference,
            "sequences_per_step": w.sequences,
            "reference_pairs": w.reference_pairs if w.needs_reference else None,
        },
    )


def hardware_label(hardware: Hardware) -> str:
    """The box a plan is for, in words (the web's plan card shows it)."""
    h = hardware
    if h.device == "cpu":
        return "CPU host (no GPU reported)"
    return f"{h.num_gpus} GPU{'s' if h.num_gpus != 1 else ''} of {h.gpu_memory_gb:g} GB"


def calibrate(hardware: Hardware, *, predicted_tokens_per_s: float, measured_tokens_per_s: float) -> Hardware:
    """The hardware with its efficiency scaled so a past job's prediction matches its measurement
    (kept within ``HARDWARE_RANGES["efficiency"]``; past its top, the rate is scaled instead).

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
    if scaled <= high:
        return replace(hardware, efficiency=max(low, scaled))
    # faster than the peak assumed (a CPU host plans at efficiency 1): the rate itself goes up
    tflops = min(HARDWARE_RANGES["gpu_tflops"][1], hardware.gpu_tflops * scaled / high)
    return replace(hardware, efficiency=high, gpu_tflops=tflops)
