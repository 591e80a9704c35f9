"""The stages the running engine trains on: per-layer costs (a parameter-bytes proxy, then
measured times), the per-stage memory budget, the partition chosen from them, and its
step x worker grid.

Memory per layer is an estimate: the weights in the compute dtype (twice in a fused/backward
stage for trainable weights: their fp32 gradient accumulators), plus activations of one
micro-batch — the hidden state for a forward stage, and for a block trained with recompute
about 16 hidden-sized tensors (attention and MLP intermediates kept for its backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.parallel.board import Iteration
from engine.parallel.host import HostState
from engine.parallel.partition import LayerCost, Plan, auto_partition, proxy_costs
from engine.parallel.schedule import build_schedule, render_grid
from engine.simulation.partition_search import search_partition

ACTIVATIONS_PER_BLOCK_BACKWARD = 16
GPU_MEMORY_SHARE = 0.45  # of the smallest GPU, for one stage when no budget is given
REPLAN_EVALUATIONS = 100  # simulations the re-plan from measured times may spend


def memory_costs(
    host: HostState, *, microbatch_tokens: int, hidden_size: int, dtype_bytes: int
) -> list[LayerCost]:
    """Proxy costs (parameter bytes) with memory estimates for one micro-batch size."""
    act = microbatch_tokens * hidden_size * dtype_bytes
    param = [float(host.param_bytes(i)) for i in range(host.num_layers)]
    proxies = proxy_costs(param)
    costs = []
    for i, c in enumerate(proxies):
        grads = 4.0 * host.trainable_numel(i)
        kept = act * (ACTIVATIONS_PER_BLOCK_BACKWARD if 0 < i < host.num_layers - 1 else 2)
        costs.append(LayerCost(c.forward, c.backward, param[i] + 2 * act, param[i] + grads + kept))
    return costs


def measured_costs(iterations: Sequence[Iteration], memory: Sequence[LayerCost]) -> list[LayerCost]:
    """Average per-micro-batch forward and backward time of every layer over ``iterations``.

    A layer's forward runs once per micro-batch in the fused stage, and twice elsewhere (the
    forward stage and the recompute); its backward runs once.

    Raises:
        ValueError: nothing was measured for some layer.
    """
    fwd = [0.0] * len(memory)
    bwd = [0.0] * len(memory)
    runs = [0] * len(memory)
    for it in iterations:
        m = len(it.microbatches)
        for i in range(len(memory)):
            if i not in it.layer_fwd_s or i not in it.layer_bwd_s:
                raise ValueError(f"no time measured for layer {i} in iteration {it.serial}")
            uses = 1 if i >= it.plan.fused.start else 2
            fwd[i] += it.layer_fwd_s[i] / (m * uses)
            bwd[i] += it.layer_bwd_s[i] / m
            runs[i] += 1
    return [
        LayerCost(fwd[i] / runs[i], bwd[i] / runs[i], mem.memory_forward, mem.memory_backward)
        for i, mem in enumerate(memory)
    ]


def memory_budget(devices: Sequence[torch.device], budget_bytes: int | None) -> float | None:
    """Bytes one stage may use: ``budget_bytes`` when given, else a share of the smallest GPU.

    Returns:
        None (unlimited) when every worker is a CPU thread and no budget is given.
    """
    if budget_bytes is not None:
        return float(budget_bytes)
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    return GPU_MEMORY_SHARE * min(torch.cuda.get_device_properties(d).total_memory for d in cuda)


def choose_plan(
    costs: Sequence[LayerCost],
    *,
    measured: bool,
    num_workers: int,
    num_microbatches: int,
    memory_budget: float | None,
    round_size: int | None,
    async_optimizer: bool,
    previous: Plan | None,
) -> Plan:
    """The partition the engine trains on.

    Measured times: simulate candidate plans as the engine dispatches them (rounds of
    ``round_size``, fixed rotation) and keep the fastest, never slower than the closed form's
    (``previous`` is a candidate too). Parameter bytes are no times: the closed-form objective
    (:func:`auto_partition`) is all they support.

    Raises:
        ValueError: no plan fits ``memory_budget`` (names the blocking layer).
    """
    if not measured:
        return auto_partition(
            costs, num_workers=num_workers, num_microbatches=num_microbatches, memory_budget=memory_budget
        )
    return search_partition(
        costs,
        num_workers=num_workers,
        num_microbatches=num_microbatches,
        memory_budget=memory_budget,
        mode="physical",
        rotation="fixed",
        round_size=round_size or num_microbatches,
        objective="steady" if async_optimizer else "sync",
        seeds=[previous] if previous is not None else (),
        max_evaluations=REPLAN_EVALUATIONS,
    )


def plan_grid(plan: Plan, *, num_workers: int, num_microbatches: int, round_size: int | None) -> str:
    """One training iteration of ``plan`` as a step x worker grid (unit time per micro-batch)."""
    runs, _ = build_schedule(
        num_slots=plan.num_slots,
        num_workers=num_workers,
        num_microbatches=num_microbatches,
        round_size=round_size,
        iteration=0,
        start_worker=0,
    )
    return render_grid(
        runs,
        slot_names=[s.name for s in plan.slots],
        kinds=[s.kind for s in plan.slots],
        num_workers=num_workers,
    )
