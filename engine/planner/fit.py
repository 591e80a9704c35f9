"""Does one job fit one box: its partition within the GPUs, its host RAM, its PCIe traffic, and
the longest sequence that fits; for a LoRA job, with a 16-bit and with a 4-bit base."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from engine.model.families import DEFAULT_LORA_TARGETS
from engine.planner.memory import (
    Memory,
    base_bytes,
    fewest_boundaries,
    fitting_plan,
    layer_times,
    layers_fit,
    memory_model,
)
from engine.planner.quantized import FP32_BYTES
from engine.planner.shapes import Shape
from engine.planner.workload import (
    DTYPE_BYTES,
    GB,
    WORKLOAD_LIMITS,
    Hardware,
    Workload,
    bytes_per_trainable_param,
)
from engine.scheduling.partition import LayerCost, Plan, StageKind

HOST_RAM_SHARE = 0.9  # of the host's RAM a job may plan to use (the OS and the service need some)
SEQ_LEN_STEP = 64  # the longest sequence that fits is a multiple of this (or the model's context)
GUESSES = 3  # partitions the host-RAM edge search guesses with before it halves
GRADIENT_BYTES = 4  # a trained weight's gradient comes down in fp32 (the worker's accumulator)


@dataclass
class Assessment:
    """One job's memory on one box: what the report, the sequence search and the variants share."""

    memory: Memory
    costs: list[LayerCost]
    plan: Plan | None
    host: dict[str, float]
    trainable: int
    per_layer: list[int]

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
    spec = shape.family
    modules = workload.target_modules
    if spec is not None and tuple(modules) == tuple(DEFAULT_LORA_TARGETS):
        modules = spec.lora_targets
    experts = tuple(getattr(spec, "expert_parameters", ()))
    parameters: list[str] = []
    for name in workload.target_parameters:
        parameters += [p for p in (experts if name == "experts" else (name,)) if p not in parameters]
    return tuple(modules), tuple(parameters)


def trainable_per_layer(shape: Shape, workload: Workload) -> list[int]:
    """Trainable parameters per engine layer: every weight, or the LoRA adapters of each block;
    a VLM's tower and projector in the input layer as ``vision_tower`` and ``projector`` say
    (frozen by default, also in a full fine-tune)."""
    w = workload
    vision = 0
    if shape.tower is not None:
        vision = shape.tower.trainable(tower=w.vision_tower, projector=w.projector, rank=w.lora_r)
    if w.tuning == "full":
        params = shape.layer_params()
        return [params[0] - (shape.tower.params if shape.tower is not None else 0) + vision, *params[1:]]
    modules, parameters = lora_targets(shape, w)
    per_layer = list(_lora_per_layer(shape, w.lora_r, modules, parameters))
    per_layer[0] += vision
    return per_layer


@lru_cache(maxsize=256)
def _lora_per_layer(
    shape: Shape, rank: int, modules: tuple[str, ...], parameters: tuple[str, ...]
) -> tuple[int, ...]:
    blocks = [shape.lora_block_params(b, rank, modules, parameters) for b in range(shape.layers)]
    return (0, *blocks, 0)


def assess(shape: Shape, workload: Workload, hardware: Hardware) -> Assessment:
    """The job's memory terms, its partition within the GPUs (None: one layer does not fit) and
    its host RAM."""
    w = workload
    per_layer = trainable_per_layer(shape, w)
    memory = memory_model(shape, w, hardware, per_layer)
    costs = memory.costs(layer_times(shape, w, hardware))
    plan = fitting_plan(
        memory, costs, num_workers=w.num_workers(hardware), num_microbatches=w.num_microbatches
    )
    trainable = sum(per_layer)
    boundaries = len(plan.checkpoint_boundaries()) if plan is not None else 1
    host = host_ram(shape, w, memory.weights, trainable, boundaries)
    return Assessment(memory, costs, plan, host, trainable, per_layer)


def host_ram(
    shape: Shape, workload: Workload, weights: list[float], trainable: int, boundaries: int
) -> dict[str, float]:
    """Host RAM by term (GB): the compute copy of the weights (``weights``: each layer's upload
    bytes, a 4-bit base's packed), the trainable weights' fp32 masters, gradients and optimizer
    state (and a second copy in async mode), a full fine-tune's frozen copy of its initial
    weights in the compute dtype when GRPO's KL term needs a reference (``kl_reference``; a LoRA
    run's reference is its base), the inputs of the stages that recompute (``boundaries`` of
    them) for every sequence of the batch (both of each DPO pair), and a VLM batch's images as
    the tower takes them (fp32 pixel values)."""
    w = workload
    dtype = DTYPE_BYTES[w.compute_dtype]
    frozen_reference = w.kl_reference and w.tuning == "full"
    host = {
        "weights_gb": sum(weights) / GB,
        "optimizer_gb": trainable * bytes_per_trainable_param(w.optimizer) / GB,
        "second_weights_buffer_gb": (trainable * dtype / GB) if w.async_optimizer else 0.0,
        "reference_weights_gb": (trainable * dtype / GB) if frozen_reference else 0.0,
        "stage_inputs_gb": boundaries * w.sequences * w.seq_len * shape.hidden * dtype / GB,
    }
    if shape.tower is not None:
        pixels = shape.tower.image(*w.image_size).pixel_values if w.images_per_row else 0
        host["images_gb"] = w.sequences * w.images_per_row * pixels * FP32_BYTES / GB
    host["total_gb"] = sum(host.values())
    return host


def pcie_traffic(shape: Shape, workload: Workload, assessment: Assessment) -> dict[str, float] | None:
    """Bytes (GB) one iteration moves between host and GPUs, by term; None without a plan.

    - **weights**: every slot uploads its layers once per iteration (one round of every
      micro-batch, the engine's default; a 4-bit base's packed bytes);
    - **gradients**: every trained weight's gradient comes down once, in fp32;
    - **activations** (first order): per micro-batch a forward or the fused slot takes its input
      up and sends its output (or gradient) down; a backward slot also takes the gradient from
      above up.
    """
    a, w = assessment, workload
    plan = a.plan
    if plan is None:
        return None
    d = DTYPE_BYTES[w.compute_dtype]
    weights = sum(a.memory.weights[i] for stage in plan.slots for i in stage.layers)
    backward = sum(1 for s in plan.slots if s.kind == StageKind.BACKWARD)
    hops = 2 * plan.num_slots + backward
    hidden = w.sequences * w.seq_len * shape.hidden * d  # one hidden state over the whole batch
    terms = {
        "weights_gb": weights / GB,
        "gradients_gb": a.trainable * GRADIENT_BYTES / GB,
        "activations_gb": hops * hidden / GB,
    }
    terms["total_gb"] = sum(terms.values())
    return terms


def longest_sequence(
    shape: Shape, workload: Workload, hardware: Hardware, *, at_job: Assessment | None = None
) -> tuple[int, str]:
    """The longest ``seq_len`` (a multiple of ``SEQ_LEN_STEP``, or the model's context) whose
    plan fits, at the job's batch and micro-batch count, and what stops a longer one.

    A binary search: the GPUs' part of the fit is checked per layer (cheap, and exactly the plan's
    rule, see ``engine.planner.memory.layers_fit``); the host's, which depends on the partition
    (its stage inputs), only where the GPUs fit and bounds on the stage count leave it open. The
    search keeps "the lower end fits, the upper does not", so the answer fits and one step more
    does not.

    Args:
        at_job: the job's own assessment, when the caller has it (a probe at the job's length
            reuses it).

    Returns:
        ``(tokens, limit)``; ``(0, resource)`` when not even ``SEQ_LEN_STEP`` tokens fit.
    """
    top, top_limit = WORKLOAD_LIMITS["seq_len"], "planner"
    if shape.context is not None and shape.context < top:
        top, top_limit = shape.context, "context"
    steps = -(-top // SEQ_LEN_STEP)
    per_layer = trainable_per_layer(shape, workload)

    def length(k: int) -> int:
        return min(k * SEQ_LEN_STEP, top)

    def at(k: int) -> Workload:
        return replace(workload, seq_len=length(k))

    def probe(k: int) -> Assessment:
        if at_job is not None and length(k) == workload.seq_len:
            return at_job
        return assess(shape, at(k), hardware)

    def gpu_fits(k: int) -> bool:
        return layers_fit(memory_model(shape, at(k), hardware, per_layer))

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
    weights = _weights(shape, workload, per_layer)
    fixed = host_ram(shape, workload, weights, sum(per_layer), 0)["total_gb"] * GB
    room = HOST_RAM_SHARE * hardware.host_ram_gb * GB - fixed
    if room < 0:  # the weights and optimizer state alone do not fit
        return 0, "host_ram"
    per_token = workload.sequences * shape.hidden * DTYPE_BYTES[workload.compute_dtype]
    sure = _edge_at(room, per_token, (shape.layers + 1) * (1 + 1e-9))
    if sure >= lo:
        return length(lo), stop

    def host_fits(k: int) -> tuple[bool, int]:
        """Whether length ``k`` fits the host (its layers fit the GPUs), and its plan's B; a
        lower bound on B tells a length that cannot fit without a partition (then that bound)."""
        if at_job is None or length(k) != workload.seq_len:
            job = at(k)
            memory = memory_model(shape, job, hardware, per_layer)
            least = fewest_boundaries(memory, memory.costs(layer_times(shape, job, hardware)))
            if least * length(k) * per_token > room * (1 + 1e-9) + 1.0:
                return False, max(1, least)
        result = probe(k)
        return result.limit(hardware) is None, _boundaries(result)

    fits, boundaries = host_fits(lo)
    if fits:
        return length(lo), stop
    lo, hi, stop = sure, lo, "host_ram"
    probes = 0
    while hi - lo > 1:
        # near the edge the partition, hence B, hardly changes: the guess (or the step past the
        # lower end when the guess is it) closes the bracket in a probe or two; halving after that
        guess = min(max(_edge_at(room, per_token, boundaries), lo + 1), hi - 1)
        mid = guess if probes < GUESSES else (lo + hi) // 2
        probes += 1
        fits, boundaries = host_fits(mid)
        lo, hi = (mid, hi) if fits else (lo, mid)
    return length(lo), stop


def _edge_at(room: float, per_token: float, boundaries: float) -> int:
    """The last multiple of ``SEQ_LEN_STEP`` (in steps) whose stage inputs fit ``room`` bytes
    with this many checkpoint boundaries."""
    return int(max(room, 0.0) / (boundaries * per_token) // SEQ_LEN_STEP)


def _weights(shape: Shape, workload: Workload, per_layer: list[int]) -> list[float]:
    """Each layer's upload bytes, as ``memory_model`` counts them (no sequence in them)."""
    d = DTYPE_BYTES[workload.compute_dtype]
    base = base_bytes(shape, d, workload.base_bits)
    if workload.tuning != "lora":
        return list(base.weights)
    return [b + n * d for b, n in zip(base.weights, per_layer, strict=True)]


def _boundaries(assessment: Assessment) -> int:
    plan = assessment.plan
    return max(1, len(plan.checkpoint_boundaries())) if plan is not None else 1


def base_variants(
    shape: Shape, workload: Workload, hardware: Hardware, *, job: Assessment, longest: tuple[int, str]
) -> list[dict[str, Any]]:
    """A LoRA job with a 16-bit and with a 4-bit base, side by side: host RAM, PCIe bytes an
    iteration, whether it fits (and what stops it), the longest sequence that fits and the GPU
    memory a worker needs. ``job`` and ``longest`` are the job's own base's; empty for a full
    fine-tune (its base trains: no 4-bit base)."""
    if workload.tuning != "lora":
        return []
    out = []
    for bits in (16, 4):
        if bits == workload.base_bits:
            a, (tokens, stop) = job, longest
        else:
            other = replace(workload, base_bits=bits)
            a = assess(shape, other, hardware)
            tokens, stop = longest_sequence(shape, other, hardware, at_job=a)
        traffic = pcie_traffic(shape, replace(workload, base_bits=bits), a)
        out.append(
            {
                "base_bits": bits,
                "fits": a.limit(hardware) is None,
                "limit": a.limit(hardware),
                "host_ram_gb": a.host["total_gb"],
                "weights_gb": a.host["weights_gb"],
                "pcie_gb_per_iteration": traffic["total_gb"] if traffic is not None else None,
                "max_seq_len": tokens,
                "max_seq_len_limit": stop,
            }
        )
    return out
