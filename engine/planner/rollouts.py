"""GRPO's rollouts: the time each step spends sampling completions before it trains on them.

A GRPO step (``engine.methods.grpo``) first samples ``group_size`` completions of each of its
``batch_size`` prompts with the policy (``engine.methods.rollouts``): ``model.generate`` on the
host's copy of the weights, in the compute dtype, on the host's CPU cores (RoundPipe keeps every
weight in host RAM; a GPU box's GPUs do not sample). The planner prices the worst case, every
completion running to ``max_completion_tokens``:

- the prefill: 2 FLOPs per active weight for each prompt token of each of the ``B * G`` rows;
- each of ``max_completion_tokens`` decode steps: one new token for every row, the longer of its
  FLOPs (2 per active weight per row) at the host's rate and one read of every weight (its bytes
  in the compute dtype) at the host's memory rate. A small batch is bound by memory, a large one
  by compute.

The host's rate: a CPU host's is the plan's (``Hardware.cpu_host``, calibrated by a finished
job); a GPU box's host has ``host_cores`` (as its worker reports them, else
``HOST_CORES_ASSUMED``) at ``CPU_GFLOPS_PER_CORE`` each. Its memory rate is
``HOST_MEMORY_GB_S``. Attention's own FLOPs, the sampling's softmax and Python's overhead per
token are left out; completions that stop early make the real step shorter.

With ``beta`` > 0 each step also computes the base model's log-probabilities of the completions
(``RoundPipe.token_logps`` with the adapters off): one forward-only pass through the pipeline over
the step's rows, priced as the DPO reference pass prices one batch (``reference.forward_seconds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.methods.reference import forward_seconds
from engine.planner.shapes import Shape
from engine.planner.workload import (
    CPU_GFLOPS_PER_CORE,
    DTYPE_BYTES,
    GB,
    HOST_CORES_ASSUMED,
    HOST_MEMORY_GB_S,
    Hardware,
    Workload,
)
from engine.scheduling.partition import Plan


@dataclass(frozen=True)
class RolloutTime:
    """One GRPO step's time besides its training iteration, in seconds.

    Attributes:
        generation_s: sampling the step's completions on the host (prefill and decode).
        reference_s: the base model's log-probabilities of the completions (0 when ``beta`` is 0).
        rows: completions sampled a step (``batch_size * group_size``).
        completion_tokens: tokens each is priced at (``max_completion_tokens``).
        tokens_per_s: completion tokens sampled per second (every row's, over the decode).
        host_gflops: the host's assumed rate (GFLOP/s).
        host_memory_gb_s: the host's assumed memory rate (GB/s).
        bound: what limits a decode step: ``"compute"`` or ``"memory"``.
    """

    generation_s: float
    reference_s: float
    rows: int
    completion_tokens: int
    tokens_per_s: float
    host_gflops: float
    host_memory_gb_s: float
    bound: str

    @property
    def total_s(self) -> float:
        return self.generation_s + self.reference_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation_s": self.generation_s,
            "reference_s": self.reference_s,
            "rows": self.rows,
            "completion_tokens": self.completion_tokens,
            "tokens_per_s": self.tokens_per_s,
            "host_gflops": self.host_gflops,
            "host_memory_gb_s": self.host_memory_gb_s,
            "bound": self.bound,
        }


def host_gflops(hardware: Hardware) -> float:
    """The achieved rate (GFLOP/s) of the host's CPU cores, which sample the completions."""
    if hardware.device == "cpu":  # the plan's own rate: the cores', calibrated when a job ran
        return hardware.gpu_tflops * hardware.efficiency * 1000
    return (hardware.host_cores or HOST_CORES_ASSUMED) * CPU_GFLOPS_PER_CORE


def rollout_time(
    shape: Shape, workload: Workload, hardware: Hardware, plan: Plan | None, weights: Sequence[float]
) -> RolloutTime | None:
    """A GRPO step's sampling (and KL reference pass) time; None for a method that samples none.

    Args:
        shape: the model's sizes.
        workload: the job (``samples``, ``sequences`` rows of ``completion_tokens``).
        hardware: the box; the host's CPU samples.
        plan: the job's partition (the reference pass runs through it; None: not priced).
        weights: bytes of each engine layer's upload (the reference pass's).
    """
    w = workload
    if not w.samples:
        return None
    rows, tokens = w.sequences, w.completion_tokens
    active = sum(shape.active_block_params(b) for b in range(shape.layers)) + shape.hidden * shape.vocab
    stored = sum(shape.block_params(b) for b in range(shape.layers)) + shape.hidden * shape.vocab
    flops = host_gflops(hardware) * 1e9
    prompt = w.mean_prompt_len if w.mean_prompt_len is not None else max(1, w.seq_len - tokens)
    prefill = 2.0 * active * rows * prompt / flops
    compute = 2.0 * active * rows / flops
    memory = stored * DTYPE_BYTES[w.compute_dtype] / (HOST_MEMORY_GB_S * GB)
    decode = max(compute, memory)
    generation = prefill + tokens * decode
    reference = 0.0
    if w.kl_reference and plan is not None:
        reference = forward_seconds(shape, w, hardware, plan, weights)
    return RolloutTime(
        generation_s=generation,
        reference_s=reference,
        rows=rows,
        completion_tokens=tokens,
        tokens_per_s=rows / decode if decode > 0 else 0.0,
        host_gflops=flops / 1e9,
        host_memory_gb_s=HOST_MEMORY_GB_S,
        bound="compute" if compute >= memory else "memory",
    )
