"""The stages the running engine trains on: per-layer costs (a parameter-bytes proxy, then
measured times), the per-stage memory budget, the partition chosen from them, and its
step x worker grid.

Memory per layer is an estimate of what one worker holds while it runs the layer's stage:
the weights in the compute dtype, the same again for the next stage's weights it prefetches
meanwhile, and activations of one micro-batch — the hidden state for a forward stage, and for a
block trained with recompute what autograd keeps for its backward: given the model's planner
``Shape``, the bytes per token its family's measured coefficients give
(``engine.planner.activations``), else about 16 hidden-sized tensors. A fused or backward stage
adds, per trainable weight, the micro-batch's gradient in the compute dtype and its fp32
accumulator; the output layer adds one chunk of the loss's logits (fp32 logits and their
gradient, plus the head's output in the compute dtype).
The budget a stage must fit is a share of the smallest GPU divided among the workers that
share a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.parallel.board import Iteration
from engine.parallel.host import HostState
from engine.planner.activations import block_bytes_per_token
from engine.planner.shapes import Shape
from engine.scheduling.partition import LayerCost, Plan, auto_partition, proxy_costs
from engine.scheduling.partition_search import search_partition
from engine.scheduling.schedule import build_schedule, render_grid

# hidden-sized tensors a block keeps for backward, for a family the measured table lacks
ACTIVATIONS_PER_BLOCK_BACKWARD = 16
_DTYPE_NAMES = {4: "float32", 2: "bfloat16"}  # float16 blocks keep what bfloat16 ones do
GPU_MEMORY_SHARE = 0.45  # of the smallest GPU, for one stage when no budget is given
REPLAN_EVALUATIONS = 100  # simulations the re-plan from measured times may spend


def memory_costs(
    host: HostState,
    *,
    microbatch_tokens: int,
    hidden_size: int,
    dtype_bytes: int,
    vocab_size: int = 0,
    loss_chunk_tokens: int = 2048,
    shape: Shape | None = None,
) -> list[LayerCost]:
    """Proxy costs (parameter bytes) with memory estimates for one micro-batch size.

    Args:
        vocab_size, loss_chunk_tokens: the output layer's logits chunk is
            ``min(loss_chunk_tokens, microbatch_tokens) x vocab_size``.
        shape: the model's sizes (``engine.planner.activations.model_shape``): a block's kept
            activations are then its family's measured bytes per token, as the planner counts
            them; without it, or for a family the table lacks, ``ACTIVATIONS_PER_BLOCK_BACKWARD``
            hidden-sized tensors.
    """
    act = microbatch_tokens * hidden_size * dtype_bytes
    logits = min(loss_chunk_tokens, microbatch_tokens) * vocab_size * (4 + 4 + dtype_bytes)
    param = [float(host.param_bytes(i)) for i in range(host.num_layers)]
    proxies = proxy_costs(param)
    costs = []
    last = host.num_layers - 1
    for i, c in enumerate(proxies):
        weights = 2 * param[i]  # this stage's and the prefetched next stage's
        # the fp32 accumulator, plus the micro-batch's gradient when it comes in a lower dtype
        grads = (4.0 + (dtype_bytes if dtype_bytes < 4 else 0)) * host.trainable_numel(i)
        kept = float(act * (ACTIVATIONS_PER_BLOCK_BACKWARD if 0 < i < last else 2))
        per_token = None
        if shape is not None and 0 < i < last:
            per_token = block_bytes_per_token(shape, i - 1, _DTYPE_NAMES.get(dtype_bytes, ""))
        if per_token is not None:
            kept = microbatch_tokens * per_token
        head = logits if i == last else 0
        costs.append(
            LayerCost(c.forward, c.backward, weights + 2 * act + head, weights + grads + kept + head)
        )
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
        it.settle_layer_times()
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


def memory_budget(
    devices: Sequence[torch.device],
    budget_bytes: int | None,
    *,
    total_memory: Callable[[torch.device], int] | None = None,
) -> float | None:
    """Bytes one stage (on one worker) may use.

    ``budget_bytes`` when given; else a share of the smallest GPU, divided among the workers
    listed on one GPU (they hold their stages at the same time).

    Args:
        total_memory: a GPU's memory in bytes (default: what CUDA reports).

    Returns:
        None (unlimited) when every worker is a CPU thread and no budget is given.
    """
    if budget_bytes is not None:
        return float(budget_bytes)
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    total = total_memory or (lambda d: int(torch.cuda.get_device_properties(d).total_memory))
    sharing = max(cuda.count(d) for d in cuda)
    return GPU_MEMORY_SHARE * min(total(d) for d in cuda) / sharing


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
