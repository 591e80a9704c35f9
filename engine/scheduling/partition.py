"""Asymmetric RoundPipe partitions: stages, validation, cost model and the automatic partitioner.

Pure Python: nothing here imports torch. Layers are indexed ``0..L-1``; layer 0 is the input layer
(embeddings), layer ``L-1`` the output layer (final norm, LM head, loss).
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class StageKind(StrEnum):
    """A stage's part of a round: forward only, fused (forward, loss and backward), or backward
    with its forward recomputed."""

    FORWARD = "forward"
    FUSED = "fused"
    BACKWARD = "backward"


KINDS = tuple(StageKind)


@dataclass(frozen=True)
class Stage:
    """A run of consecutive layers ``[start, stop)`` executed by one worker in one slot."""

    kind: StageKind  # a plain string is taken and checked
    start: int
    stop: int
    name: str  # forward: "F1".."Fk" bottom-up; fused: "B1"; backward: "B2".."Bk" top-down

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Stage kind={self.kind!r} must be one of {tuple(str(k) for k in KINDS)}")
        object.__setattr__(self, "kind", StageKind(self.kind))

    @property
    def layers(self) -> range:
        """The layer indices of this stage."""
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Plan:
    """An asymmetric partition. Construction does not validate; call :func:`validate_plan`."""

    num_layers: int
    forward: tuple[Stage, ...]
    fused: Stage
    backward: tuple[Stage, ...]

    @property
    def slots(self) -> tuple[Stage, ...]:
        """The stages in the order they run in a round: forward, fused, backward."""
        return (*self.forward, self.fused, *self.backward)

    @property
    def num_slots(self) -> int:
        """Number of slots S in one round."""
        return len(self.forward) + 1 + len(self.backward)

    def to_counts(self) -> dict[str, list[int] | int]:
        """Layer counts: forward bottom-up, the fused stage, backward top-down."""
        return {
            "forward": [len(s.layers) for s in self.forward],
            "fused": len(self.fused.layers),
            "backward": [len(s.layers) for s in self.backward],
        }

    @classmethod
    def from_counts(
        cls, num_layers: int, *, forward: Sequence[int], fused: int, backward: Sequence[int]
    ) -> Plan:
        """Build and validate a plan from layer counts.

        Args:
            num_layers: L, the total number of layers (input and output layer included).
            forward: layers per forward stage, bottom-up.
            fused: layers in the fused stage (the top ones, output layer included).
            backward: layers per backward stage, top-down (the first sits just below the fused stage).

        Returns:
            The plan.

        Raises:
            ValueError: a count is not a positive integer or the counts do not sum to ``num_layers``.
        """
        _check_int("num_layers", num_layers, minimum=2)
        for label, counts in (("forward", forward), ("backward", backward)):
            for i, n in enumerate(counts):
                _check_int(f"{label}[{i}]", n, minimum=1)
        _check_int("fused", fused, minimum=1)
        for label, counts in (("forward", forward), ("backward", backward)):
            if sum(counts) + fused != num_layers:
                raise ValueError(
                    f"{label} counts {list(counts)} (sum {sum(counts)}) plus fused={fused} "
                    f"make {sum(counts) + fused} layers, expected num_layers={num_layers}"
                )
        boundary = num_layers - fused
        fwd: list[Stage] = []
        at = 0
        for i, n in enumerate(forward):
            fwd.append(Stage(StageKind.FORWARD, at, at + n, f"F{i + 1}"))
            at += n
        bwd: list[Stage] = []
        at = boundary
        for i, n in enumerate(backward):
            bwd.append(Stage(StageKind.BACKWARD, at - n, at, f"B{i + 2}"))
            at -= n
        plan = cls(num_layers, tuple(fwd), Stage(StageKind.FUSED, boundary, num_layers, "B1"), tuple(bwd))
        validate_plan(plan)
        return plan

    def checkpoint_boundaries(self) -> tuple[int, ...]:
        """Layer indices ``b`` (``0 < b <= fused.start``) whose input is kept in host memory for recompute.

        Returns:
            Sorted starts of the fused stage and of the backward stages, layer 0 excluded.
        """
        starts = {s.start for s in (self.fused, *self.backward) if s.start > 0}
        return tuple(sorted(starts))

    def describe(self) -> str:
        """One line, e.g. ``"F1[0:3] F2[3:5] | B1[5:8] | B2[3:5] B3[0:3]"``; empty groups are left out."""
        groups = [self.forward, (self.fused,), self.backward]
        return " | ".join(" ".join(f"{s.name}[{s.start}:{s.stop}]" for s in g) for g in groups if g)


def validate_plan(plan: Plan) -> None:
    """Check that a plan is a well-formed asymmetric partition.

    Args:
        plan: the plan to check.

    Raises:
        ValueError: naming the offending stage and its layer numbers (gap, overlap, empty stage, wrong
            kind or name, fused stage not ending at ``num_layers``, ...).
    """
    num_layers = plan.num_layers
    _check_int("num_layers", num_layers, minimum=2)
    fused = plan.fused
    if fused.stop != num_layers:
        raise ValueError(
            f"fused stage {fused.name}[{fused.start}:{fused.stop}] must end at num_layers={num_layers}"
        )
    expected = [("forward", f"F{i + 1}", s) for i, s in enumerate(plan.forward)]
    expected += [("backward", f"B{i + 2}", s) for i, s in enumerate(plan.backward)]
    for kind, name, s in [*expected, ("fused", "B1", fused)]:
        if s.kind != kind or s.name != name:
            raise ValueError(f"stage {s.name}[{s.start}:{s.stop}] should be kind {kind!r} named {name!r}")
        if not 0 <= s.start < s.stop <= num_layers:
            raise ValueError(
                f"stage {s.name}[{s.start}:{s.stop}] must hold at least one layer within [0, {num_layers})"
            )
    if fused.start == 0:
        if plan.forward or plan.backward:
            raise ValueError(
                f"fused stage covers all {num_layers} layers, so forward ({len(plan.forward)} stages) and "
                f"backward ({len(plan.backward)} stages) must be empty"
            )
        return
    for label, stages in (("forward", plan.forward), ("backward", plan.backward)):
        if not stages:
            raise ValueError(f"{label} stages must cover layers [0, {fused.start}) below the fused stage")
    # Forward stages run bottom-up from layer 0 to the fused stage.
    at = 0
    for s in plan.forward:
        if s.start != at:
            what = "gap" if s.start > at else "overlap"
            raise ValueError(f"{what} in forward stages: {s.name} starts at layer {s.start}, expected {at}")
        at = s.stop
    if at != fused.start:
        what = "gap" if at < fused.start else "overlap"
        raise ValueError(f"{what}: forward stages end at layer {at}, the fused stage starts at {fused.start}")
    # Backward stages run top-down from the fused stage to layer 0.
    at = fused.start
    for s in plan.backward:
        if s.stop != at:
            what = "gap" if s.stop < at else "overlap"
            raise ValueError(f"{what} in backward stages: {s.name} ends at layer {s.stop}, expected {at}")
        at = s.start
    if at != 0:
        raise ValueError(f"backward stages end at layer {at}, they must reach layer 0")


@dataclass(frozen=True)
class LayerCost:
    """Per-layer, per-micro-batch cost of one layer."""

    forward: float  # time (or proxy) of one micro-batch forward
    backward: float  # time of its backward, excluding recompute
    memory_forward: float  # bytes needed on a worker in a forward stage
    memory_backward: float  # bytes needed in a fused or backward stage


def stage_cost(stage: Stage, costs: Sequence[LayerCost]) -> float:
    """Time of one micro-batch through a stage.

    Args:
        stage: the stage.
        costs: one entry per layer of the model.

    Returns:
        Sum of forward times for a forward stage; sum of forward + backward for a fused stage (forward,
        loss, backward) and for a backward stage (recompute, backward).

    Raises:
        ValueError: the stage reaches past ``len(costs)``.
    """
    _check_stage_in(stage, costs)
    if stage.kind == "forward":
        return sum(costs[i].forward for i in stage.layers)
    return sum(costs[i].forward + costs[i].backward for i in stage.layers)


def stage_memory(stage: Stage, costs: Sequence[LayerCost]) -> float:
    """Bytes a worker needs to run a stage.

    Args:
        stage: the stage.
        costs: one entry per layer of the model.

    Returns:
        Sum of ``memory_forward`` for a forward stage, of ``memory_backward`` otherwise.

    Raises:
        ValueError: the stage reaches past ``len(costs)``.
    """
    _check_stage_in(stage, costs)
    if stage.kind == "forward":
        return sum(costs[i].memory_forward for i in stage.layers)
    return sum(costs[i].memory_backward for i in stage.layers)


def objective(plan: Plan, costs: Sequence[LayerCost], *, num_workers: int, num_microbatches: int) -> float:
    """Iteration time estimate ``(M·S + N(N−1))·t_max`` of a plan.

    Args:
        plan: the plan (S = ``plan.num_slots``).
        costs: one entry per layer.
        num_workers: N.
        num_microbatches: M, micro-batches per iteration.

    Returns:
        The objective, with ``t_max`` the largest stage cost of the plan.

    Raises:
        ValueError: ``num_workers`` or ``num_microbatches`` < 1, or ``costs`` does not match the plan.
    """
    _check_int("num_workers", num_workers, minimum=1)
    _check_int("num_microbatches", num_microbatches, minimum=1)
    if len(costs) != plan.num_layers:
        raise ValueError(f"len(costs)={len(costs)} does not match plan.num_layers={plan.num_layers}")
    t_max = max(stage_cost(s, costs) for s in plan.slots)
    return (num_microbatches * plan.num_slots + num_workers * (num_workers - 1)) * t_max


def auto_partition(
    costs: Sequence[LayerCost],
    *,
    num_workers: int,
    num_microbatches: int,
    memory_budget: float | None = None,
) -> Plan:
    """Find the plan minimising :func:`objective` with every stage within ``memory_budget``.

    Every candidate ``t_max`` (each contiguous sum of forward costs or of forward + backward costs) gets
    one greedy pass: the fused stage is packed first from the top, as deep as ``t_max`` and the budget
    allow, then backward stages downward, then forward stages upward, each as full as possible. For a
    given ``t_max`` that pass uses the fewest stages, so the best candidate is an optimal plan.

    Args:
        costs: one entry per layer (at least 2), all values finite and >= 0.
        num_workers: N >= 1.
        num_microbatches: M >= 1, micro-batches per iteration.
        memory_budget: bytes per worker; None means unlimited.

    Returns:
        The best plan; ties go to fewer stages, then to the smaller ``t_max``.

    Raises:
        ValueError: invalid inputs, or no plan fits the memory budget (names the blocking layer).
    """
    _check_int("num_workers", num_workers, minimum=1)
    _check_int("num_microbatches", num_microbatches, minimum=1)
    _check_costs(costs)
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r} must be a positive number or None")
    greedy = _Greedy(costs, memory_budget)
    loosest, _ = greedy.run(math.inf)
    if isinstance(loosest, _Blocked):  # no cost limit binds: memory alone blocks this layer
        field = "memory_forward" if loosest.kind == "forward" else "memory_backward"
        value = getattr(costs[loosest.layer], field)
        raise ValueError(
            f"no partition fits memory_budget={memory_budget!r}: layer {loosest.layer} needs "
            f"{field}={value!r} in a {loosest.kind} stage"
        )
    # Every t_max between two consecutive events gives the same greedy plan, so the walk visits
    # each distinct plan once, at its own t_max; a plan's slots never drop below the loosest
    # plan's, so once (M·S_min + N(N−1))·t_max exceeds the best objective nothing later can win.
    fixed = num_workers * (num_workers - 1)
    least = num_microbatches * _num_slots(loosest) + fixed
    best: tuple[float, int, float] | None = None
    best_counts: _Counts | None = None
    t_max: float | None = -math.inf
    while t_max is not None:
        packed, event = greedy.run(t_max)
        if not isinstance(packed, _Blocked):
            slots = _num_slots(packed)
            # the plan's largest stage costs t_max (it first appears there), up to rounding: one
            # that cannot win even so is not summed up
            if best is None or (num_microbatches * slots + fixed) * (t_max - greedy.slack) <= best[0]:
                t_actual = greedy.t_actual(packed)
                key = ((num_microbatches * slots + fixed) * t_actual, slots, t_actual)
                if best is None or key < best:
                    best, best_counts = key, packed
        if best is not None and event is not None and least * event > best[0]:
            break
        t_max = event
    if best_counts is None:
        raise RuntimeError("auto_partition: the loosest plan fits but no plan was selected")
    forward, fused, backward = best_counts
    return Plan.from_counts(len(costs), forward=forward, fused=fused, backward=backward)


def fewest_stages(costs: Sequence[LayerCost], *, memory_budget: float | None) -> Plan:
    """The greedy pass of :func:`auto_partition` with no time limit: every stage as full as the
    budget allows. No plan within the budget has a lower fused stage or fewer backward stages,
    so none keeps fewer stage inputs for recompute (``Plan.checkpoint_boundaries``).

    Raises:
        ValueError: no plan fits the memory budget.
    """
    _check_costs(costs)
    packed, _ = _Greedy(costs, memory_budget).run(math.inf)
    if isinstance(packed, _Blocked):
        raise ValueError(f"no partition fits memory_budget={memory_budget!r}: layer {packed.layer} does not")
    forward, fused, backward = packed
    return Plan.from_counts(len(costs), forward=forward, fused=fused, backward=backward)


def proxy_costs(
    param_bytes: Sequence[float], *, activation_bytes: Sequence[float] | None = None
) -> list[LayerCost]:
    """Costs estimated from parameter bytes, for use before anything is measured.

    Args:
        param_bytes: parameter bytes per layer (at least 2 layers).
        activation_bytes: activation bytes per layer held on a worker; zeros if None.

    Returns:
        Per layer: forward = param bytes (0 for layer 0, an embedding lookup), backward = 2 × forward,
        memory_forward = params + activations, memory_backward = 2 × params + activations.

    Raises:
        ValueError: fewer than 2 layers, mismatched lengths, or a negative or non-finite value.
    """
    if len(param_bytes) < 2:
        raise ValueError(
            f"param_bytes has {len(param_bytes)} layers, need at least 2 (input and output layer)"
        )
    acts = [0.0] * len(param_bytes) if activation_bytes is None else list(activation_bytes)
    if len(acts) != len(param_bytes):
        raise ValueError(
            f"len(activation_bytes)={len(acts)} does not match len(param_bytes)={len(param_bytes)}"
        )
    for label, values in (("param_bytes", param_bytes), ("activation_bytes", acts)):
        for i, v in enumerate(values):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{label}[{i}]={v!r} must be finite and >= 0")
    out = []
    for i, (p, a) in enumerate(zip(param_bytes, acts, strict=True)):
        f = 0.0 if i == 0 else float(p)
        out.append(LayerCost(forward=f, backward=2.0 * f, memory_forward=p + a, memory_backward=2.0 * p + a))
    return out


# --- internals ---


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_costs(costs: Sequence[LayerCost]) -> None:
    if len(costs) < 2:
        raise ValueError(f"costs has {len(costs)} layers, need at least 2 (input and output layer)")
    for i, c in enumerate(costs):
        for field in ("forward", "backward", "memory_forward", "memory_backward"):
            v = getattr(c, field)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"costs[{i}].{field}={v!r} must be finite and >= 0")


def _check_stage_in(stage: Stage, costs: Sequence[LayerCost]) -> None:
    if not 0 <= stage.start <= stage.stop <= len(costs):
        raise ValueError(
            f"stage {stage.name}[{stage.start}:{stage.stop}] is outside the {len(costs)} layers of costs"
        )


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


# (forward counts bottom-up, fused count, backward counts top-down)
_Counts = tuple[list[int], int, list[int]]


def _num_slots(counts: _Counts) -> int:
    return len(counts[0]) + 1 + len(counts[2])


@dataclass(frozen=True)
class _Blocked:
    layer: int
    kind: str


class _Greedy:
    """The greedy pass of :func:`auto_partition` for any ``t_max``, on prefix sums.

    Each stage grows as far as it fits; the largest fitting end is found by bisection, then fixed
    up with the layer-by-layer scan's own comparison (``prefix[b] - prefix[a] <= t_max``), which
    gives the scan's answer because the differences of a non-decreasing prefix sum (with one end
    fixed) never decrease as the stage grows, rounding included. A pass also reports its
    *event*: the smallest ``t_max`` at which one of its decisions would go the other way (a
    stage refused a layer by cost alone), None when no larger ``t_max`` changes anything.
    """

    def __init__(self, costs: Sequence[LayerCost], budget: float | None) -> None:
        self.num_layers = len(costs)
        self.budget = budget
        self.forward = [c.forward for c in costs]
        self.both = [c.forward + c.backward for c in costs]
        self.fwd = _prefix(self.forward)
        self.fb = _prefix(self.both)
        # a bound on how far a stage's cost summed layer by layer and a difference of prefix
        # sums may round apart
        self.slack = 8 * (self.num_layers + 1) * sys.float_info.epsilon * self.fb[-1]
        # how far memory alone lets a backward stage reach down from each top, a forward
        # stage up from each bottom (no t_max in it)
        self.low_mem = _reach_down(_prefix([c.memory_backward for c in costs]), budget)
        self.high_mem = _reach_up(_prefix([c.memory_forward for c in costs]), budget)

    def t_actual(self, counts: _Counts) -> float:
        """The largest stage cost of a plan, summed layer by layer as :func:`stage_cost` does."""
        forward, fused, backward = counts
        costs, at = [], 0
        for n in forward:
            costs.append(sum(self.forward[at : at + n]))
            at += n
        top = self.num_layers - fused
        costs.append(sum(self.both[top:]))
        for n in backward:
            costs.append(sum(self.both[top - n : top]))
            top -= n
        return max(costs)

    def run(self, t_max: float) -> tuple[_Counts | _Blocked, float | None]:
        """The plan (or the first layer that cannot fit) and the pass's event."""
        L = self.num_layers
        fb, fwd, low_mem, high_mem = self.fb, self.fwd, self.low_mem, self.high_mem
        event = math.inf
        # the fused stage, then the backward stages top-down: each from ``top`` down to the
        # lowest start within t_max (bisection, then the exact comparison) and the memory reach
        top = L
        backward: list[int] = []
        while top > 0:
            if low_mem[top] > top - 1:  # one layer over the budget: no t_max helps
                return _Blocked(top - 1, "fused" if top == L else "backward"), _finite(event)
            if fb[top] - fb[top - 1] > t_max:
                return _Blocked(top - 1, "fused" if top == L else "backward"), _finite(
                    min(event, fb[top] - fb[top - 1])
                )
            floor, head = low_mem[top], fb[top]
            start = max(bisect.bisect_left(fb, head - t_max, floor, top - 1), floor)
            while start > floor and head - fb[start - 1] <= t_max:
                start -= 1
            while head - fb[start] > t_max:
                start += 1
            if start > floor:  # the layer below was refused by its cost alone
                event = min(event, head - fb[start - 1])
            if top < L:
                backward.append(top - start)
            else:
                boundary = start
            top = start
        forward: list[int] = []
        bottom = 0
        while bottom < boundary:
            if high_mem[bottom] < bottom + 1:
                return _Blocked(bottom, "forward"), _finite(event)
            if fwd[bottom + 1] - fwd[bottom] > t_max:
                return _Blocked(bottom, "forward"), _finite(min(event, fwd[bottom + 1] - fwd[bottom]))
            ceiling, base = min(high_mem[bottom], boundary), fwd[bottom]
            stop = min(bisect.bisect_right(fwd, base + t_max, bottom + 1, ceiling + 1) - 1, ceiling)
            stop = max(stop, bottom + 1)
            while stop < ceiling and fwd[stop + 1] - base <= t_max:
                stop += 1
            while fwd[stop] - base > t_max:
                stop -= 1
            if stop < ceiling:  # refused by cost alone
                event = min(event, fwd[stop + 1] - base)
            forward.append(stop - bottom)
            bottom = stop
        return (forward, L - boundary, backward), _finite(event)


def _finite(value: float) -> float | None:
    return None if value == math.inf else value


def _reach_down(prefix: list[float], budget: float | None) -> list[int]:
    """For every ``top``: the lowest ``s`` with ``prefix[top] - prefix[s] <= budget`` (it never
    falls as ``top`` rises: two pointers)."""
    if budget is None:
        return [0] * len(prefix)
    out, s = [], 0
    for top in range(len(prefix)):
        while s < top and prefix[top] - prefix[s] > budget:
            s += 1
        out.append(s)
    return out


def _reach_up(prefix: list[float], budget: float | None) -> list[int]:
    """For every ``bottom``: the highest ``s`` with ``prefix[s] - prefix[bottom] <= budget``."""
    last = len(prefix) - 1
    if budget is None:
        return [last] * len(prefix)
    out, s = [], 0
    for bottom in range(len(prefix)):
        s = max(s, bottom)
        while s < last and prefix[s + 1] - prefix[bottom] <= budget:
            s += 1
        out.append(s)
    return out
