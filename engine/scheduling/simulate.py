"""Simulate one training iteration of a pipeline schedule and measure its bubbles.

Pure Python: nothing here imports torch. Inputs are per-layer costs in the engine's layering (layer 0 the
input layer, the last layer the output layer: final norm, LM head and loss), a hop latency between
workers and, for weight uploads, parameter bytes and a link bandwidth. Times are in whatever unit the
costs use (milliseconds per micro-batch in the benchmarks).

Two modes:

- **paper** follows the rules of the paper's simulator: the fused stage's LM-head forward and a backward
  stage's recompute are *pre-parts* that need only an idle worker, even before their inputs arrive;
  RoundPipe runs rounds of exactly N micro-batches and starts each round on the worker that frees up
  first; nothing is uploaded.
- **physical** gates every pre-part on its inputs (the head forward on the last forward stage's output,
  a recompute on its checkpointed stage input), rotates rounds as the engine dispatches them
  (``(g0 + S) mod N``) and, when bytes and bandwidth are given, uploads each RoundPipe stage's weights on
  its worker's link: a stage's upload starts once the link is free and the stage two before on that
  worker has finished (double buffering), and the stage's first micro-batch waits for it. Stage-bound
  schedules keep their weights resident, so they upload nothing.

The RoundPipe dispatch comes from :func:`engine.scheduling.schedule.build_schedule`; the stage-bound orders
from :mod:`engine.scheduling.baselines`; the event core from :mod:`engine.scheduling.timeline`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from engine.scheduling.baselines import BOUND_SCHEDULES, bound_ops
from engine.scheduling.partition import LayerCost, Plan, validate_plan
from engine.scheduling.schedule import SlotRun, build_schedule, split_rounds
from engine.scheduling.timeline import Op, OpTime, Timeline, render_svg

MODES = ("paper", "physical")
ROUNDPIPE_SCHEDULES = ("roundpipe-sync", "roundpipe-async", "roundpipe-async-steady")
SCHEDULES = (*BOUND_SCHEDULES, *ROUNDPIPE_SCHEDULES)
ROTATIONS = ("earliest", "fixed")
# The steady state chains this many iterations and measures the last half.
STEADY_ITERATIONS = 8


@dataclass(frozen=True)
class SimResult:
    """The simulated timeline and its bubble figures.

    For ``roundpipe-async`` the timeline is the sync one and ``bubble`` leaves out each worker's fill and
    drain: ``(Σ idle − Σ fill − Σ drain) / (N × makespan)``. For ``roundpipe-async-steady`` ``makespan``
    is the period of one iteration in a chain of iterations without a flush, busy and idle are averaged
    per iteration over the measured window, and fill and drain are 0.
    """

    schedule: str
    mode: str
    num_workers: int
    makespan: float
    busy: tuple[float, ...]  # per worker: forward, recompute, head and backward time
    idle: tuple[float, ...]  # per worker: makespan − busy
    fill: tuple[float, ...]  # per worker: start of its first non-empty op
    drain: tuple[float, ...]  # per worker: makespan − end of its last non-empty backward op
    bubble: float
    ops: tuple[OpTime, ...]


def simulate(
    schedule: str,
    costs: Sequence[LayerCost],
    *,
    num_workers: int,
    num_microbatches: int,
    hop: float = 0.0,
    plan: Plan | None = None,
    stages: Sequence[int] | None = None,
    mode: str = "paper",
    param_bytes: Sequence[float] | None = None,
    bandwidth: float | None = None,
    round_size: int | None = None,
    rotation: str | None = None,
) -> SimResult:
    """Simulate one iteration of ``schedule`` and measure makespan, busy and idle time and bubbles.

    Args:
        schedule: one of ``SCHEDULES``.
        costs: per layer (input layer first, output layer last); ``forward``/``backward`` are times per
            micro-batch, ``backward`` excluding the recompute (which costs ``forward``).
        num_workers: N >= 1.
        num_microbatches: M >= 1.
        hop: latency of a dependency between two different workers (>= 0).
        plan: the RoundPipe partition (RoundPipe schedules only).
        stages: stage-bound schedules only: layers per stage, bottom-up, ``v·N`` entries summing to
            ``len(costs)``; 0 is an empty stage; stage ``s`` runs on worker ``s mod N``.
        mode: "paper" or "physical" (see the module docstring).
        param_bytes: per-layer parameter bytes, for weight uploads (physical mode, with ``bandwidth``).
        bandwidth: bytes per time unit of a worker's upload link.
        round_size: micro-batches per RoundPipe round; paper mode allows only N; physical mode
            defaults to N and accepts any size :func:`build_schedule` does.
        rotation: "earliest" (a round starts on the worker whose last op ends first, ties to the lowest
            index) or "fixed" (``(g0 + S) mod N``, the engine's dispatch); default by mode as above.

    Returns:
        The :class:`SimResult`.

    Raises:
        ValueError: an unknown schedule, mode or rotation; a count, cost, hop, byte or bandwidth value out
            of range; a missing or misplaced ``plan``/``stages``; weight traffic in paper mode; or a
            schedule the workers cannot finish.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    _check_int("num_workers", num_workers)
    _check_int("num_microbatches", num_microbatches)
    _check_costs(costs)
    uploads = _check_uploads(costs, mode, param_bytes, bandwidth)
    n, m = num_workers, num_microbatches
    if schedule in BOUND_SCHEDULES:
        if plan is not None:
            raise ValueError(f"plan applies to RoundPipe schedules, not to {schedule!r}; pass stages")
        if stages is None:
            raise ValueError(f"stages (layers per stage) are required for {schedule!r}")
        tl = Timeline(num_workers=n, hop=hop)
        tl.add(bound_ops(schedule, costs, stages, num_workers=n, num_microbatches=m))
        return _result(schedule, mode, n, list(tl.times.values()))
    if stages is not None:
        raise ValueError(f"stages apply to stage-bound schedules, not to {schedule!r}; pass plan")
    if plan is None:
        raise ValueError(f"plan (a RoundPipe partition) is required for {schedule!r}")
    validate_plan(plan)
    if plan.num_layers != len(costs):
        raise ValueError(f"plan.num_layers={plan.num_layers} does not match len(costs)={len(costs)}")
    if mode == "paper" and round_size not in (None, n):
        raise ValueError(f"round_size={round_size!r}: paper mode runs rounds of exactly num_workers={n}")
    rotation = rotation if rotation is not None else ("earliest" if mode == "paper" else "fixed")
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} must be one of {ROTATIONS}")
    steady = schedule == "roundpipe-async-steady"
    tl = Timeline(num_workers=n, hop=hop)
    pipe = _RoundPipe(tl, plan, costs, mode=mode, uploads=uploads)
    pipe.run(
        num_microbatches=m,
        round_size=n if round_size is None else round_size,
        rotation=rotation,
        iterations=STEADY_ITERATIONS if steady else 1,
    )
    timed = list(tl.times.values())
    if steady:
        return _steady_result(mode, n, timed, pipe.iteration_ends)
    result = _result(schedule, mode, n, timed)
    if schedule == "roundpipe-async":
        gaps = sum(result.idle) - sum(result.fill) - sum(result.drain)
        bubble = gaps / (n * result.makespan) if result.makespan > 0 else 0.0
        result = dataclasses.replace(result, bubble=bubble)
    return result


def timeline_svg(result: SimResult, *, title: str = "", width: int = 1200) -> str:
    """Draw a result's timeline as SVG: a row per worker, forward, recompute and backward in colours.

    Args:
        result: a :func:`simulate` result.
        title: a line above the picture.
        width: picture width in pixels (>= 200).

    Returns:
        SVG text.

    Raises:
        ValueError: ``width`` out of range.
    """
    return render_svg(result.ops, num_workers=result.num_workers, title=title, width=width)


def closed_form_bubble(*, num_workers: int, num_microbatches: int, num_slots: int) -> float:
    """RoundPipe's bubble with equal slots and no hop: ``N(N−1) / (M·S + N(N−1))``.

    Args:
        num_workers: N >= 1.
        num_microbatches: M >= 1.
        num_slots: S >= 1 slots per round.

    Returns:
        The bubble ratio.

    Raises:
        ValueError: an argument is not a positive integer.
    """
    _check_int("num_workers", num_workers)
    _check_int("num_microbatches", num_microbatches)
    _check_int("num_slots", num_slots)
    idle = num_workers * (num_workers - 1)
    return idle / (num_microbatches * num_slots + idle)


def uniform_costs(
    num_blocks: int, *, fwd: float, bwd: float, head_fwd: float, head_bwd: float
) -> list[LayerCost]:
    """Costs of a model whose decoder blocks all cost the same; the input layer costs 0.

    Args:
        num_blocks: decoder blocks (>= 1).
        fwd: forward time of one block per micro-batch.
        bwd: backward time of one block, excluding its recompute.
        head_fwd: forward time of the output layer (final norm, LM head, loss).
        head_bwd: its backward time.

    Returns:
        ``num_blocks + 2`` layer costs (memory fields 0).

    Raises:
        ValueError: ``num_blocks`` < 1 or a negative or non-finite time.
    """
    _check_int("num_blocks", num_blocks)
    for name, value in (("fwd", fwd), ("bwd", bwd), ("head_fwd", head_fwd), ("head_bwd", head_bwd)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    block = LayerCost(fwd, bwd, 0.0, 0.0)
    return [LayerCost(0.0, 0.0, 0.0, 0.0), *([block] * num_blocks), LayerCost(head_fwd, head_bwd, 0.0, 0.0)]


def plan_from_blocks(num_blocks: int, *, forward: Sequence[int], backward: Sequence[int]) -> Plan:
    """The engine plan of a partition written in decoder blocks.

    Args:
        num_blocks: decoder blocks L.
        forward: blocks per forward stage, bottom-up.
        backward: blocks per backward stage, top-down; ``backward[0]`` is the fused stage (the output
            layer plus that many top blocks, possibly 0). ``sum(forward) + backward[0] == L`` and
            ``sum(backward) == L``; a list where both sum to L with ``backward[0] == 0`` is the same.

    Returns:
        The plan over ``L + 2`` layers: the input layer joins the first forward and the last backward
        stage, the output layer the fused stage.

    Raises:
        ValueError: the counts do not describe such a partition.
    """
    _check_int("num_blocks", num_blocks)
    if not backward:
        raise ValueError("backward must hold at least the fused stage's block count")
    if not forward:
        if list(backward) != [num_blocks]:
            raise ValueError(f"with no forward stages, backward={list(backward)} must be [{num_blocks}]")
        return Plan.from_counts(num_blocks + 2, forward=[], fused=num_blocks + 2, backward=[])
    fwd = [forward[0] + 1, *forward[1:]]
    bwd = [*backward[1:-1], backward[-1] + 1] if len(backward) > 1 else []
    return Plan.from_counts(num_blocks + 2, forward=fwd, fused=backward[0] + 1, backward=bwd)


def layers_from_blocks(blocks: Sequence[int]) -> list[int]:
    """Layers per stage of a stage-bound partition written in decoder blocks.

    Args:
        blocks: blocks per stage, bottom-up (0 for an empty stage); the output layer joins the last
            stage, the input layer the first.

    Returns:
        Layer counts for :func:`simulate`'s ``stages``.

    Raises:
        ValueError: an empty list or a negative count.
    """
    if not blocks:
        raise ValueError("blocks must list at least one stage")
    for i, b in enumerate(blocks):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"blocks[{i}]={b!r} must be an integer >= 0")
    out = list(blocks)
    out[0] += 1
    out[-1] += 1
    return out


# --- RoundPipe ---


class _RoundPipe:
    """Builds RoundPipe ops round by round onto a timeline."""

    def __init__(
        self, tl: Timeline, plan: Plan, costs: Sequence[LayerCost], *, mode: str, uploads: list[float] | None
    ) -> None:
        self.tl = tl
        self.slots = plan.slots
        self.last_forward = len(plan.forward) - 1  # -1: no forward stages
        self.mode = mode
        self.pre: list[float] = []
        self.main: list[float] = []
        self.upload: list[float] = []
        self.checkpoint: list[int | None] = []  # forward slot producing a backward stage's input
        out_layer = len(costs) - 1
        for stage in self.slots:
            layers = stage.layers
            fwd = sum(costs[i].forward for i in layers)
            bwd = sum(costs[i].backward for i in layers)
            if stage.kind == "forward":
                pre, main = 0.0, fwd
            elif stage.kind == "fused":
                pre = costs[out_layer].forward
                main = fwd - pre + bwd
            else:
                pre, main = fwd, bwd
            self.pre.append(pre)
            self.main.append(main)
            self.upload.append(sum(uploads[i] for i in layers) if uploads is not None else 0.0)
            producer = None
            if stage.kind == "backward" and stage.start > 0:
                producer = next(i for i, f in enumerate(plan.forward) if f.start < stage.start <= f.stop)
            self.checkpoint.append(producer)
        self.uploads = uploads is not None
        self.runs_of: dict[int, list[SlotRun]] = {}
        self.iteration_ends: list[float] = []

    def run(self, *, num_microbatches: int, round_size: int, rotation: str, iterations: int) -> None:
        n, s = self.tl.num_workers, len(self.slots)
        g0 = 0
        for it in range(iterations):
            if rotation == "fixed":
                runs, g0 = build_schedule(
                    num_slots=s,
                    num_workers=n,
                    num_microbatches=num_microbatches,
                    round_size=round_size,
                    iteration=it,
                    start_worker=g0,
                )
                self._add(runs)
            else:
                for r, mbs in enumerate(split_rounds(num_microbatches, round_size)):
                    if it or r:
                        g0 = min(range(n), key=lambda w: (self.tl.last_end(w), w))
                    one, _ = build_schedule(
                        num_slots=s,
                        num_workers=n,
                        num_microbatches=len(mbs),
                        round_size=None,
                        iteration=it,
                        start_worker=g0,
                    )
                    self._add([dataclasses.replace(run, round=r, microbatches=mbs) for run in one])
            ends = [t.end for key, t in self.tl.times.items() if isinstance(key, tuple) and key[0] == it]
            self.iteration_ends.append(max(ends, default=0.0))

    def _add(self, runs: Sequence[SlotRun]) -> None:
        ops: list[Op] = []
        for run in runs:
            it, r, slot = run.iteration, run.round, run.slot
            kind = self.slots[slot].kind
            name = self.slots[slot].name
            before = self.runs_of.setdefault(run.worker, [])
            upload_key: tuple[Hashable, ...] = ()
            if self.uploads:
                freed: tuple[Hashable, ...] = ()
                if len(before) >= 2:
                    old = before[-2]
                    freed = ((old.iteration, old.round, old.slot, old.microbatches[-1]),)
                upload_key = (("upload", it, r, slot),)
                ops.append(
                    Op(upload_key[0], run.worker, self.upload[slot], deps=freed, kind="upload", label=name)
                )
            before.append(run)
            for i, mb in enumerate(run.microbatches):
                deps: tuple[Hashable, ...] = ((it, r, slot - 1, mb),) if slot > 0 else ()
                if kind == "backward" and self.last_forward >= 0:
                    deps += ((it, r, self.last_forward, mb),)
                pre_deps: tuple[Hashable, ...] = ()
                if self.mode == "physical":
                    if kind == "fused" and self.last_forward >= 0:
                        pre_deps = ((it, r, self.last_forward, mb),)
                    producer = self.checkpoint[slot]
                    if producer is not None:
                        pre_deps = ((it, r, producer, mb),)
                if i == 0:
                    deps += upload_key
                ops.append(
                    Op(
                        (it, r, slot, mb),
                        run.worker,
                        self.main[slot],
                        pre=self.pre[slot],
                        deps=deps,
                        pre_deps=pre_deps,
                        kind=kind,
                        label=f"{name}.m{mb}",
                    )
                )
        self.tl.add(ops)


# --- measurements ---


def _result(schedule: str, mode: str, n: int, timed: Sequence[OpTime]) -> SimResult:
    compute = [t for t in timed if t.op.lane == "compute"]
    # an empty op (a stage without layers) forwards its hops but does not extend the makespan
    makespan = max((t.end for t in compute if t.op.pre + t.op.main > 0), default=0.0)
    busy = [0.0] * n
    first: list[float | None] = [None] * n
    last_any: list[float | None] = [None] * n
    last_back: list[float | None] = [None] * n
    for t in sorted(compute, key=lambda t: t.start):
        w = t.op.worker
        busy[w] += t.op.pre + t.op.main
        if t.op.pre + t.op.main > 0:
            first[w] = t.start if first[w] is None else first[w]
            last_any[w] = t.end
            if t.op.kind != "forward":
                last_back[w] = t.end
    fill = tuple(makespan if f is None else f for f in first)
    drain = tuple(
        0.0 if last_any[w] is None else makespan - _first_set(last_back[w], last_any[w]) for w in range(n)
    )
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (n * makespan) if makespan > 0 else 0.0
    return SimResult(schedule, mode, n, makespan, tuple(busy), idle, fill, drain, bubble, tuple(timed))


def _steady_result(mode: str, n: int, timed: Sequence[OpTime], ends: Sequence[float]) -> SimResult:
    lo, hi = ends[len(ends) // 2 - 1], ends[-1]
    periods = len(ends) - len(ends) // 2
    busy = [0.0] * n
    for t in timed:
        if t.op.lane == "compute":
            busy[t.op.worker] += max(0.0, min(t.end, hi) - max(t.start, lo))
    window = hi - lo
    idle = [window - b for b in busy]
    bubble = sum(idle) / (n * window) if window > 0 else 0.0
    zeros = (0.0,) * n
    return SimResult(
        "roundpipe-async-steady",
        mode,
        n,
        window / periods,
        tuple(b / periods for b in busy),
        tuple(i / periods for i in idle),
        zeros,
        zeros,
        bubble,
        tuple(timed),
    )


def _first_set(a: float | None, b: float | None) -> float:
    if a is not None:
        return a
    return 0.0 if b is None else b


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _check_costs(costs: Sequence[LayerCost]) -> None:
    if len(costs) < 2:
        raise ValueError(f"costs has {len(costs)} layers, need at least 2 (input and output layer)")
    for i, c in enumerate(costs):
        for field in ("forward", "backward"):
            v = getattr(c, field)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"costs[{i}].{field}={v!r} must be finite and >= 0")


def _check_uploads(
    costs: Sequence[LayerCost], mode: str, param_bytes: Sequence[float] | None, bandwidth: float | None
) -> list[float] | None:
    """Per-layer upload times, or None when no weight traffic is modelled."""
    if param_bytes is None and bandwidth is None:
        return None
    if param_bytes is None or bandwidth is None:
        raise ValueError(
            f"param_bytes and bandwidth go together (got param_bytes={'set' if param_bytes else None}, "
            f"bandwidth={bandwidth!r})"
        )
    if mode == "paper":
        raise ValueError(
            "paper mode models no weight traffic: pass param_bytes and bandwidth in physical mode"
        )
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth={bandwidth!r} must be a finite number > 0")
    if len(param_bytes) != len(costs):
        raise ValueError(f"len(param_bytes)={len(param_bytes)} does not match len(costs)={len(costs)}")
    for i, v in enumerate(param_bytes):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"param_bytes[{i}]={v!r} must be finite and >= 0")
    return [v / bandwidth for v in param_bytes]
