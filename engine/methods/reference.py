"""A reference pass (DPO's): the time of one forward-only pass over every pair, before the first step.

The engine computes the reference log-probabilities once (``engine.methods.dpo``): the training
pairs, then the validation pairs, ``batch_size`` pairs at a time in file order, each batch's 2B
rows through ``sequence_logps`` (a LoRA run's with its adapters off, the base model; a full
fine-tune's on the initial weights), which splits them into ``min(num_microbatches, 2B)``
micro-batches and runs the plan's forward stages and the fused stage's forward, no backward
(``RoundPipe._launch(train=False)``), waiting for each batch before the next. Each batch is
simulated as such an iteration: the engine's dispatch (``build_schedule``, one round), each
stage's weights uploaded on its worker's link (double buffered, as in training), a hop between
workers. An adapter's own FLOPs are left out (a few per cent of a block's).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

from engine.planner.memory import layer_times
from engine.planner.shapes import Shape
from engine.planner.workload import DTYPE_BYTES, GB, Hardware, Workload
from engine.scheduling.partition import Plan
from engine.scheduling.schedule import SlotRun, build_schedule
from engine.scheduling.timeline import Op, Timeline


def reference_seconds(
    shape: Shape, workload: Workload, hardware: Hardware, plan: Plan, weights: Sequence[float]
) -> float | None:
    """Seconds of a DPO job's reference pass over its ``reference_pairs``.

    Args:
        shape: the model's sizes.
        workload: the job; a method without a reference pass (``needs_reference``) takes none.
        hardware: the box; uploads run at ``link_gb_s`` per worker.
        plan: the job's partition (its forward stages and fused stage run).
        weights: bytes of each engine layer's upload.

    Returns:
        The seconds, 0 for no pairs; None when the job is not DPO or its pair count is unknown.
    """
    w = workload
    if not w.needs_reference or w.reference_pairs is None:
        return None
    full, rest = divmod(w.reference_pairs, w.batch_size)
    seconds = full * _batch_seconds(shape, w, hardware, plan, weights) if full else 0.0
    if rest:
        seconds += _batch_seconds(shape, replace(w, batch_size=rest), hardware, plan, weights)
    return seconds


def forward_seconds(
    shape: Shape, workload: Workload, hardware: Hardware, plan: Plan, weights: Sequence[float]
) -> float:
    """One forward-only iteration over a batch's ``workload.sequences`` rows through the plan's
    forward stages and fused stage: a reference pass's batch, or a GRPO step's reference
    log-probabilities of its completions (``engine.planner.rollouts``)."""
    return _batch_seconds(shape, workload, hardware, plan, weights)


def _batch_seconds(
    shape: Shape, workload: Workload, hardware: Hardware, plan: Plan, weights: Sequence[float]
) -> float:
    """One batch's forward-only iteration: ``workload.sequences`` rows (``batch_size`` pairs, 2
    rows each)."""
    w = replace(workload, num_microbatches=min(workload.num_microbatches, workload.sequences))
    m, n = w.num_microbatches, w.num_workers(hardware)
    forward = [f for f, _ in layer_times(shape, w, hardware)]
    tokens = w.sequences * w.timed_seq_len / m
    hop = 2 * tokens * shape.hidden * DTYPE_BYTES[w.compute_dtype] / (hardware.link_gb_s * GB)
    slots = (*plan.forward, plan.fused)
    runs, _ = build_schedule(
        num_slots=len(slots), num_workers=n, num_microbatches=m, round_size=m, iteration=0, start_worker=0
    )
    timeline = Timeline(num_workers=n, hop=hop)
    ops: list[Op] = []
    earlier: dict[int, list[SlotRun]] = {}
    for run in runs:
        stage = slots[run.slot]
        mine = earlier.setdefault(run.worker, [])
        # double buffering: the upload waits until the stage two before on this worker is done
        freed: tuple[Hashable, ...] = ((mine[-2].slot, mine[-2].microbatches[-1]),) if len(mine) >= 2 else ()
        mine.append(run)
        upload = ("upload", run.slot)
        seconds = sum(weights[i] for i in stage.layers) / (hardware.link_gb_s * GB)
        ops.append(Op(upload, run.worker, seconds, deps=freed, kind="upload", label=stage.name))
        compute = sum(forward[i] for i in stage.layers)
        for i, mb in enumerate(run.microbatches):
            deps: tuple[Hashable, ...] = ((run.slot - 1, mb),) if run.slot > 0 else ()
            if i == 0:
                deps += (upload,)
            ops.append(Op((run.slot, mb), run.worker, compute, deps=deps, kind="forward", label=stage.name))
    timeline.add(ops)
    return max((t.end for t in timeline.times.values() if t.op.lane == "compute"), default=0.0)
