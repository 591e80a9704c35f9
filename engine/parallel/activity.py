"""Where a step's time went besides compute: what the workers record and the metrics made from it.

Every record holds points in time: clock readings (``time.perf_counter``) on CPU workers, CUDA
timing events on GPU workers. The events are read only when a step's metrics are made (on the
optimizer thread, after the step), as the busy spans are, so measuring adds no host
synchronisation to the workers' loop.

An iteration's ``Activity``:

- waits: how long a stage's compute stood waiting. ``weights``: from the moment the stage wanted
  to start until its weights were on the device (the optimizer publishing them, then their
  upload, unless a prefetch had already brought them). ``activations``: per micro-batch, from
  the moment the compute could take its input until it arrived (the hidden state handed over by
  the stage below, the micro-batch's tokens for the first stage, and in a backward stage also
  the gradient handed down by the stage above; that last wait falls inside the stage's busy
  span, since the stage's recompute runs before it).
- copies: host-to-device and device-to-host copies with their bytes, each timed on its copy
  stream (CUDA) or on the worker's thread (CPU). On CPU workers activations and gradients are
  handed over without a copy: only weight uploads move bytes there.
- gaps: per worker, from its last compute before the iteration (in the previous iteration it
  ran, an evaluation included) to its first compute in this one. A worker's first iteration has
  none. Waits for weights at an iteration's start fall inside its gap.
- prefetched: per stage run, whether its weights had been prefetched (their upload queued while
  the worker's previous stage computed; on a GPU that upload may still be in flight, which shows
  as a wait for weights).

Copies count in the iteration of the stage run that queued them: a prefetch of the next
iteration's first stage counts in the one before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WEIGHTS = "weights"
ACTIVATIONS = "activations"
H2D = "h2d"  # host to device
D2H = "d2h"  # device to host


def seconds(a: Any, b: Any) -> float:
    """Seconds from point ``a`` to point ``b``: clock readings, or CUDA timing events of one
    device (waited for first; they are read after the work they mark has finished)."""
    if isinstance(a, float):
        return float(b - a)
    a.synchronize()
    b.synchronize()
    return float(a.elapsed_time(b)) / 1000.0


def covered(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (overlapping copies count once)."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


@dataclass
class Activity:
    """What the workers recorded in one iteration besides their busy spans (see the module)."""

    # (WEIGHTS | ACTIVATIONS, start, end)
    waits: list[tuple[str, Any, Any]] = field(default_factory=list)
    # (worker, H2D | D2H, bytes, start, end)
    copies: list[tuple[int, str, int, Any, Any]] = field(default_factory=list)
    # (worker, end of its last compute before, start of its first compute in this iteration)
    gaps: list[tuple[int, Any, Any]] = field(default_factory=list)
    prefetched: list[bool] = field(default_factory=list)  # per stage run
    # settled into numbers by ``settle``
    wait_s: dict[str, float] = field(default_factory=dict)
    copy_bytes: dict[str, int] = field(default_factory=dict)
    copy_s: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0

    def settle(self) -> None:
        """Turn the recorded points into seconds and bytes (reads the CUDA events; idempotent)."""
        waits, self.waits = self.waits, []
        for kind, a, b in waits:
            self.wait_s[kind] = self.wait_s.get(kind, 0.0) + max(0.0, seconds(a, b))
        gaps, self.gaps = self.gaps, []
        self.idle_s += sum(max(0.0, seconds(a, b)) for _, a, b in gaps)
        copies, self.copies = self.copies, []
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        origins: dict[int, Any] = {}
        for worker, way, nbytes, a, b in copies:
            self.copy_bytes[way] = self.copy_bytes.get(way, 0) + nbytes
            # one worker's copies on one time line (its first copy's start), where they may
            # overlap (two streams one way)
            origin = origins.setdefault(worker, a)
            start = 0.0 if a is origin else seconds(origin, a)
            spans.setdefault((worker, way), []).append((start, start + max(0.0, seconds(a, b))))
        for (_, way), intervals in spans.items():
            self.copy_s[way] = self.copy_s.get(way, 0.0) + covered(intervals)


class IdleGaps:
    """One worker's last compute: what its idle gap before an iteration starts from."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.last: tuple[Any, int] | None = None  # (end of the last compute, its iteration's serial)

    def gap(
        self, serial: int, spans: Sequence[tuple[Any, Any]], *, train: bool
    ) -> tuple[int, Any, Any] | None:
        """After a stage run with busy ``spans`` in iteration ``serial``: the gap before its first
        compute when it is the worker's first stage of a training iteration, else None."""
        if not spans:
            return None
        last, self.last = self.last, (spans[-1][1], serial)
        if last is None or last[1] == serial or not train:
            return None
        return (self.worker, last[0], spans[0][0])


def activity_metrics(activities: Sequence[Activity], *, num_workers: int, period: float) -> dict[str, float]:
    """A step's metrics from its iterations' activity (settled here).

    Args:
        num_workers: the seconds per worker are the workers' sums divided by it.
        period: the step period the idle ratio is a share of.

    Returns:
        ``pipeline/idle_between_s`` (each worker's compute-idle time between iterations, summed
        over the step's iterations, averaged over the workers) and ``pipeline/idle_between_ratio``
        (that over ``period``); ``time/wait/weights_s`` and ``time/wait/activations_s`` (the
        waits, per worker likewise); ``transfer/{h2d,d2h}_bytes`` and ``transfer/{h2d,d2h}_gbps``
        (bytes / 1e9 over the time copies that way were in flight on each worker, summed over
        workers; 0 without a copy); ``pipeline/prefetch_hit_rate`` (the share of stage runs whose
        weights were prefetched).
    """
    for a in activities:
        a.settle()
    workers = max(num_workers, 1)
    idle = sum(a.idle_s for a in activities) / workers
    metrics = {
        "pipeline/idle_between_s": idle,
        "pipeline/idle_between_ratio": idle / period if period > 0 else 0.0,
    }
    for kind in (WEIGHTS, ACTIVATIONS):
        metrics[f"time/wait/{kind}_s"] = sum(a.wait_s.get(kind, 0.0) for a in activities) / workers
    for way in (H2D, D2H):
        nbytes = sum(a.copy_bytes.get(way, 0) for a in activities)
        busy = sum(a.copy_s.get(way, 0.0) for a in activities)
        metrics[f"transfer/{way}_bytes"] = float(nbytes)
        metrics[f"transfer/{way}_gbps"] = nbytes / 1e9 / busy if busy > 0 else 0.0
    runs = [hit for a in activities for hit in a.prefetched]
    metrics["pipeline/prefetch_hit_rate"] = sum(runs) / len(runs) if runs else 0.0
    return metrics
