"""GRPO's rollouts: the time each step spends sampling completions before it trains on them.

A GRPO step (``engine.methods.grpo``) first samples ``group_size`` completions of each of its
``batch_size`` prompts with the policy (``engine.methods.rollouts``): ``model.generate`` on the
whole model in the compute dtype. Where, as ``rollout_device`` decides: on the first GPU when the
model's bytes fit in ``ROLLOUT_HEADROOM`` of its free memory (the pipeline's workers are idle
meanwhile; the model is copied there over the host link at each step), else on the host's CPU
(a CPU host always). The planner prices the worst case, every completion running to
``max_completion_tokens``:

- the prefill: 2 FLOPs per active weight for each prompt token of each of the ``B * G`` rows;
- each of ``max_completion_tokens`` decode steps: one new token for every row, the longer of its
  FLOPs (2 per active weight per row) at the device's rate and one read of every weight (its
  bytes in the compute dtype) at the device's memory rate. A small batch is bound by memory, a
  large one by compute;
- on a GPU, the copy of the model to it, once a step, at the host link's rate.

Rates: a GPU's is the plan's (``gpu_tflops`` at ``efficiency``) and reads at
``GPU_MEMORY_GB_S``; a CPU host's is the plan's (``Hardware.cpu_host``, calibrated by a finished
job); a GPU box's host CPU has ``host_cores`` (as its worker reports them, else
``HOST_CORES_ASSUMED``) at ``CPU_GFLOPS_PER_CORE`` each; a host reads at ``HOST_MEMORY_GB_S``.
Attention's own FLOPs, the sampler and ``generate``'s Python overhead per token (which bounds a
small model on a GPU) are left out; completions that stop early make the real step shorter.

With ``beta`` > 0 each batch of completions also gets the reference's log-probabilities
(``RoundPipe.token_logps``: a LoRA run's base with the adapters off, a full fine-tune's frozen
copy of its initial weights): one forward-only pass through the pipeline over the step's rows,
priced as the DPO reference pass prices one batch (``reference.forward_seconds``). With
``num_iterations`` mu > 1 a batch also gets the policy's own log-probabilities before its first
step (another such pass), and trains mu steps: a step's share of the sampling is 1/mu of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.methods.reference import forward_seconds
from engine.planner.memory import CUDA_OVERHEAD_BYTES
from engine.planner.shapes import Shape
from engine.planner.workload import (
    CPU_GFLOPS_PER_CORE,
    DTYPE_BYTES,
    GB,
    GPU_MEMORY_GB_S,
    HOST_CORES_ASSUMED,
    HOST_MEMORY_GB_S,
    Hardware,
    Workload,
)
from engine.scheduling.partition import Plan

ROLLOUT_HEADROOM = 0.75  # engine.methods.rollouts.rollout_device's share of a GPU's free memory


@dataclass(frozen=True)
class RolloutTime:
    """One GRPO step's time besides its training iteration, in seconds.

    Attributes:
        device: where the completions are sampled: ``"gpu"`` (the first) or ``"cpu"`` (the host's).
        reason: where, and why there, in words.
        generation_s: sampling the step's completions (prefill and decode).
        upload_s: copying the model to the GPU that samples (0 on the CPU).
        reference_s: the reference's log-probabilities of the completions (0 when ``beta`` is 0).
        old_s: the policy's log-probabilities of the completions before the first step on them
            (0 when ``num_iterations`` is 1).
        iterations: the steps each batch of completions trains (``num_iterations``).
        rows: completions sampled a batch (``batch_size * group_size``).
        completion_tokens: tokens each is priced at (``max_completion_tokens``).
        tokens_per_s: completion tokens sampled per second (every row's, over the decode).
        gflops: the sampling device's assumed rate (GFLOP/s).
        memory_gb_s: the rate it reads the weights at (GB/s).
        bound: what limits a decode step: ``"compute"`` or ``"memory"``.
    """

    device: str
    reason: str
    generation_s: float
    upload_s: float
    reference_s: float
    old_s: float
    iterations: int
    rows: int
    completion_tokens: int
    tokens_per_s: float
    gflops: float
    memory_gb_s: float
    bound: str

    @property
    def total_s(self) -> float:
        """A batch of completions: sampled, and its log-probabilities measured."""
        return self.generation_s + self.upload_s + self.reference_s + self.old_s

    @property
    def per_step_s(self) -> float:
        """A step's share: the batch's time over the steps that train on it."""
        return self.total_s / self.iterations

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def host_gflops(hardware: Hardware) -> float:
    """The achieved rate (GFLOP/s) of the host's CPU cores, when they sample the completions."""
    if hardware.device == "cpu":  # the plan's own rate: the cores', calibrated when a job ran
        return hardware.gpu_tflops * hardware.efficiency * 1000
    return (hardware.host_cores or HOST_CORES_ASSUMED) * CPU_GFLOPS_PER_CORE


def model_bytes(shape: Shape, workload: Workload, trainable: int) -> float:
    """The whole model's bytes in the compute dtype (every weight, a LoRA run's adapters too), as
    ``engine.methods.rollouts.model_bytes`` counts the model that samples."""
    weights = sum(shape.layer_params()) + (trainable if workload.tuning == "lora" else 0)
    return float(weights * DTYPE_BYTES[workload.compute_dtype])


def sampling_device(shape: Shape, workload: Workload, hardware: Hardware, trainable: int) -> tuple[str, str]:
    """``("gpu" or "cpu", where in words)``: the first GPU when the model fits in ``ROLLOUT_HEADROOM`` of its
    memory less the CUDA overhead, as ``rollout_device`` decides with the free memory it finds."""
    if hardware.device == "cpu":
        return "cpu", "the host's CPU (no GPU)"
    need = model_bytes(shape, workload, trainable)
    free = hardware.gpu_memory_gb * GB - CUDA_OVERHEAD_BYTES
    if need <= ROLLOUT_HEADROOM * free:
        return "gpu", f"the first GPU (the model's {need / GB:.1f} GB fit in {free / GB:.1f} GB)"
    return "cpu", (
        f"the host's CPU (the model's {need / GB:.1f} GB do not fit in {ROLLOUT_HEADROOM:.0%} of a GPU's "
        f"{free / GB:.1f} GB)"
    )


def rollout_time(
    shape: Shape,
    workload: Workload,
    hardware: Hardware,
    plan: Plan | None,
    weights: Sequence[float],
    trainable: int = 0,
) -> RolloutTime | None:
    """A GRPO batch's sampling time (and its reference's and old log-probabilities' passes);
    None for a method that samples none.

    Args:
        shape: the model's sizes.
        workload: the job (``samples``, ``sequences`` rows of ``completion_tokens``).
        hardware: the box.
        plan: the job's partition (the reference pass runs through it; None: not priced).
        weights: bytes of each engine layer's upload (the reference pass's).
        trainable: the job's trainable parameters (a LoRA run's adapters sample too).
    """
    w = workload
    if not w.samples:
        return None
    device, reason = sampling_device(shape, w, hardware, trainable)
    rows, tokens = w.sequences, w.completion_tokens
    active = sum(shape.active_block_params(b) for b in range(shape.layers)) + shape.hidden * shape.vocab
    stored = model_bytes(shape, w, trainable)
    if device == "gpu":
        flops, read = hardware.gpu_tflops * 1e12 * hardware.efficiency, GPU_MEMORY_GB_S
        upload = stored / (hardware.link_gb_s * GB)
    else:
        flops, read, upload = host_gflops(hardware) * 1e9, HOST_MEMORY_GB_S, 0.0
    prompt = w.mean_prompt_len if w.mean_prompt_len is not None else max(1, w.seq_len - tokens)
    prefill = 2.0 * active * rows * prompt / flops
    compute = 2.0 * active * rows / flops
    memory = stored / (read * GB)
    decode = max(compute, memory)
    reference = old = 0.0
    if plan is not None and (w.kl_reference or w.num_iterations > 1):
        forward = forward_seconds(shape, w, hardware, plan, weights)
        reference = forward if w.kl_reference else 0.0
        old = forward if w.num_iterations > 1 else 0.0
    return RolloutTime(
        device=device,
        reason=reason,
        generation_s=prefill + tokens * decode,
        upload_s=upload,
        reference_s=reference,
        old_s=old,
        iterations=w.num_iterations,
        rows=rows,
        completion_tokens=tokens,
        tokens_per_s=rows / decode if decode > 0 else 0.0,
        gflops=flops / 1e9,
        memory_gb_s=read,
        bound="compute" if compute >= memory else "memory",
    )
