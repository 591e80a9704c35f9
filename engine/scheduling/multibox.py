"""One training step of a job that spans several boxes: each box's RoundPipe pipeline over its share
of the batch, the gradient exchange between the boxes, and the optimizer's update.

Every box runs the same pipeline over its own ``num_workers`` GPUs and holds the whole model; before
each optimizer step the boxes sum their fp32 gradients with a ring all-reduce, priced by
:mod:`engine.scheduling.exchange` (its bytes, its time, whether the step hides it). Every box then
applies the same update on its host, so the update does not shrink with more boxes.

How the batch is shared (``batch``):

- ``"fixed"``: the job's batch stays what it is and the boxes split it, as the engine does: the batch
  is cut into ``boxes × num_microbatches`` micro-batches and each box runs ``num_microbatches`` of
  them, so a box's micro-batch holds ``1 / boxes`` of the rows of a micro-batch of the same batch on
  one box. ``costs`` and ``hop`` are for that one-box micro-batch; each layer's forward and backward
  time and the hop (an activation's copy) are taken as proportional to the rows. That is a first-order
  rule: a GPU computes small micro-batches less efficiently, so real splits of a small batch do worse.
- ``"per-box"``: every box runs micro-batches as ``costs`` give them; the batch grows with the boxes
  (``boxes`` times the tokens a step trains).

How a step adds up (``async_optimizer``):

- synchronous: one box's iteration (``roundpipe-sync``: one iteration, its fill and drain included),
  then the exchange, then the update, which overlaps the next iteration layer by layer (a layer's
  next upload waits only for that layer's new copy; the planner prices one box so too):
  ``exchange + max(iteration, update)``;
- asynchronous (staleness 1): iterations chain without a flush (``roundpipe-async-steady``: the
  steady period) while the optimizer thread exchanges and updates beside the next iteration:
  ``max(period, exchange + update)``; the exchange is hidden when ``exchange + update`` fits in
  the period.

With one box there is no exchange, and with no update either the step is :func:`simulate`'s
makespan of the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduling.exchange import exchange
from engine.scheduling.partition import LayerCost, Plan
from engine.scheduling.simulate import SimResult, simulate

BATCHES = ("fixed", "per-box")


@dataclass(frozen=True)
class BoxStep:
    """One step of a job on ``boxes`` boxes; every time is in the unit of the costs.

    Attributes:
        boxes: the boxes in the job.
        batch: ``"fixed"`` or ``"per-box"`` (see the module docstring).
        async_optimizer: the asynchronous optimizer (staleness 1).
        iteration: one box's forward and backward over its share (the sync makespan, or the
            async steady period).
        exchange: the gradient exchange's time.
        update: the optimizer's update of the masters on each box's host.
        step: the time of one step.
        exposed: what the exchange adds to the step (0 when hidden).
        hidden: the asynchronous step hides the exchange and the update behind the next iteration.
        gradient_bytes: the fp32 gradients each box holds.
        bytes_per_step: what each box sends (and receives) per step.
        batch_scale: the tokens a step trains, as a multiple of the batch ``costs`` describe
            (1 for ``"fixed"``, ``boxes`` for ``"per-box"``).
        pipeline: the simulated pipeline of one box.
    """

    boxes: int
    batch: str
    async_optimizer: bool
    iteration: float
    exchange: float
    update: float
    step: float
    exposed: float
    hidden: bool
    gradient_bytes: float
    bytes_per_step: float
    batch_scale: int
    pipeline: SimResult

    @property
    def throughput(self) -> float:
        """Batches (of the size ``costs`` describe) per unit of time, over all the boxes."""
        return self.batch_scale / self.step if self.step > 0 else math.inf


def simulate_boxes(
    costs: Sequence[LayerCost],
    *,
    boxes: int,
    num_workers: int,
    num_microbatches: int,
    plan: Plan,
    trainable_params: int,
    link_gbps: float,
    link_measured: bool = False,
    hop: float = 0.0,
    update: float = 0.0,
    async_optimizer: bool = False,
    batch: str = "fixed",
    batch_rows: int | None = None,
    unit_s: float = 1e-3,
    mode: str = "physical",
) -> BoxStep:
    """Simulate one step of a RoundPipe job on ``boxes`` boxes of ``num_workers`` GPUs each.

    Args:
        costs: per layer (input layer first, output layer last), per micro-batch of the whole
            batch on one box (``"fixed"``) or of each box (``"per-box"``).
        boxes: k >= 1 boxes in the job.
        num_workers: N >= 1 GPUs of each box.
        num_microbatches: M >= 1 micro-batches each box runs per step (the engine keeps it per box).
        plan: the RoundPipe partition each box runs.
        trainable_params: the weights the job trains (their fp32 gradients are exchanged).
        link_gbps: the link between the boxes, Gbit/s (nominal unless ``link_measured``).
        link_measured: ``link_gbps`` is a measured all-reduce rate, taken as is.
        hop: latency of an activation between two GPUs of a box, for the micro-batch of ``costs``.
        update: the optimizer's update on each box's host, in the unit of the costs.
        async_optimizer: chain iterations with the asynchronous optimizer (staleness 1).
        batch: ``"fixed"`` (the boxes split the job's batch) or ``"per-box"`` (each box runs
            micro-batches as ``costs`` give them).
        batch_rows: the job's batch in sequences, when known (``"fixed"`` only): the engine needs
            at least one per micro-batch, ``boxes × num_microbatches`` in all.
        unit_s: seconds per unit of the costs (1e-3: milliseconds).
        mode: the simulator's mode (``"physical"`` or ``"paper"``).

    Returns:
        The :class:`BoxStep`.

    Raises:
        ValueError: a count, time, rate or batch out of range, or what :func:`simulate` refuses.
    """
    if isinstance(boxes, bool) or not isinstance(boxes, int) or boxes < 1:
        raise ValueError(f"boxes={boxes!r} must be an integer >= 1")
    if batch not in BATCHES:
        raise ValueError(f"batch={batch!r} must be one of {BATCHES}")
    if isinstance(trainable_params, bool) or not isinstance(trainable_params, int) or trainable_params < 0:
        raise ValueError(f"trainable_params={trainable_params!r} must be an integer >= 0")
    for name, value in (("update", update), ("hop", hop)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    if not (math.isfinite(unit_s) and unit_s > 0):
        raise ValueError(f"unit_s={unit_s!r} must be finite and > 0")
    if not (math.isfinite(link_gbps) and link_gbps > 0):
        raise ValueError(f"link_gbps={link_gbps!r} must be finite and > 0")
    if batch_rows is not None:
        if batch != "fixed":
            raise ValueError(f"batch_rows={batch_rows!r} applies to batch='fixed', not {batch!r}")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int):
            raise ValueError(f"batch_rows={batch_rows!r} must be an integer")
        if isinstance(num_microbatches, int) and batch_rows < boxes * num_microbatches:
            raise ValueError(
                f"batch_rows={batch_rows} is fewer than boxes × num_microbatches = "
                f"{boxes} × {num_microbatches}: every micro-batch needs a sequence"
            )
    share = 1.0 / boxes if batch == "fixed" else 1.0
    box_costs = [
        LayerCost(c.forward * share, c.backward * share, c.memory_forward, c.memory_backward) for c in costs
    ]
    pipeline = simulate(
        "roundpipe-async-steady" if async_optimizer else "roundpipe-sync",
        box_costs,
        num_workers=num_workers,
        num_microbatches=num_microbatches,
        hop=hop * share,
        plan=plan,
        mode=mode,
    )
    iteration = pipeline.makespan
    ex = exchange(
        trainable_params,
        hosts=boxes,
        link_gbps=link_gbps,
        link_measured=link_measured,
        iteration_s=iteration * unit_s,
        update_s=update * unit_s,
        async_optimizer=async_optimizer,
    )
    exposed = ex.exposed_s / unit_s
    # an update longer than an iteration paces the steps even on one box; the exchange adds what
    # it exposes: all of itself when sync (the update needs the summed gradients)
    step = max(iteration, update) + exposed
    return BoxStep(
        boxes=boxes,
        batch=batch,
        async_optimizer=async_optimizer,
        iteration=iteration,
        exchange=ex.seconds / unit_s,
        update=update,
        step=step,
        exposed=exposed,
        hidden=ex.hidden,
        gradient_bytes=ex.gradient_bytes,
        bytes_per_step=ex.bytes_per_step,
        batch_scale=1 if batch == "fixed" else boxes,
        pipeline=pipeline,
    )


def scaling(one: BoxStep, many: BoxStep) -> float:
    """How many times one box's throughput ``many`` reaches (k boxes ideally reach k).

    Raises:
        ValueError: ``one`` is not a one-box step.
    """
    if one.boxes != 1:
        raise ValueError(f"one.boxes={one.boxes}: the reference must be a single box")
    return many.throughput / one.throughput
