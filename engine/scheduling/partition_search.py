"""A partitioner that minimises the simulated iteration time instead of the closed-form estimate.

Pure Python: nothing here imports torch. :func:`auto_partition` minimises ``(M·S + N(N−1))·t_max``, which
assumes equal slots, no hop and no weight traffic. :func:`search_partition` starts from that plan and
searches for a plan with a shorter simulated makespan under :func:`engine.scheduling.simulate.simulate`'s
rules, so hops, uneven slots, the round rotation and (in physical mode, given bytes and bandwidth) weight
uploads all count, while every stage stays within the memory budget:

1. seeds: the closed-form plan and any plans passed in;
2. a scan of *balanced* plans, described by the number of forward stages, the number of backward stages
   and the size of the fused stage (each stage aiming at an equal share of the cost still left, larger
   stages first or last);
3. a local search that moves one stage boundary by one layer, or grows or shrinks the fused stage, while
   that shortens the simulated time.

Every candidate costs one simulation, and ``max_evaluations`` bounds them. The result is never worse
than the seeds under the same rules.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from engine.scheduling.partition import LayerCost, Plan, auto_partition, stage_memory, validate_plan
from engine.scheduling.simulate import simulate

OBJECTIVES = {"sync": "roundpipe-sync", "steady": "roundpipe-async-steady"}
# the fused stage sizes (in layers beyond the starting plan's) tried with stages of matching cost
FUSED_EXTRA = 2
# half-width of the (forward stages, backward stages) window scanned around the best balanced plan
WINDOW = 4
_TOL = 1e-9

# (forward counts, fused count, backward counts)
Counts = tuple[tuple[int, ...], int, tuple[int, ...]]


def search_partition(
    costs: Sequence[LayerCost],
    *,
    num_workers: int,
    num_microbatches: int,
    hop: float = 0.0,
    mode: str = "physical",
    memory_budget: float | None = None,
    param_bytes: Sequence[float] | None = None,
    bandwidth: float | None = None,
    round_size: int | None = None,
    rotation: str | None = None,
    seeds: Sequence[Plan] = (),
    objective: str = "sync",
    max_evaluations: int = 400,
) -> Plan:
    """Find a plan with a short simulated iteration time, every stage within the memory budget.

    Args:
        costs: one entry per layer; ``forward``/``backward`` are times per micro-batch in the unit of
            ``hop`` (and of ``param_bytes / bandwidth``); memory fields in the unit of ``memory_budget``.
        num_workers: N >= 1.
        num_microbatches: M >= 1.
        hop: latency between two workers, as in :func:`simulate`.
        mode: "physical" (default: what the engine runs) or "paper".
        memory_budget: bytes per worker for one stage; None means unlimited.
        param_bytes: per-layer parameter bytes, for upload times (physical mode, with ``bandwidth``).
        bandwidth: bytes per time unit of a worker's upload link.
        round_size: micro-batches per round, as in :func:`simulate`.
        rotation: round rotation, as in :func:`simulate`.
        seeds: extra starting plans (e.g. the plan in use); those over the budget are skipped.
        objective: "sync" minimises the makespan of one iteration (``roundpipe-sync``, sync training);
            "steady" the period of iterations chained without a flush (``roundpipe-async-steady``,
            async training; each evaluation simulates several iterations).
        max_evaluations: simulations allowed (>= 1); each costs one simulated iteration.

    Returns:
        The best plan found; ties go to fewer slots. It is never worse than the closed-form plan of
        :func:`auto_partition`, nor than any seed within the budget (those are simulated first, so
        all of them are when ``max_evaluations > len(seeds)``).

    Raises:
        ValueError: invalid inputs (as for :func:`auto_partition` and :func:`simulate`), a seed that does
            not match ``costs``, or no plan fits the memory budget.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} must be one of {OBJECTIVES}")
    if isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int) or max_evaluations < 1:
        raise ValueError(f"max_evaluations={max_evaluations!r} must be an integer >= 1")
    start = auto_partition(
        costs, num_workers=num_workers, num_microbatches=num_microbatches, memory_budget=memory_budget
    )
    for i, seed in enumerate(seeds):
        validate_plan(seed)
        if seed.num_layers != len(costs):
            raise ValueError(
                f"seeds[{i}].num_layers={seed.num_layers} does not match len(costs)={len(costs)}"
            )

    def makespan(plan: Plan) -> float:
        return simulate(
            OBJECTIVES[objective],
            costs,
            num_workers=num_workers,
            num_microbatches=num_microbatches,
            hop=hop,
            plan=plan,
            mode=mode,
            param_bytes=param_bytes,
            bandwidth=bandwidth,
            round_size=round_size,
            rotation=rotation,
        ).makespan

    search = _Search(costs, makespan, memory_budget, max_evaluations)
    for plan in (start, *seeds):
        search.evaluate(_counts(plan))
    search.balanced()
    search.local()
    counts = search.best
    return Plan.from_counts(len(costs), forward=counts[0], fused=counts[1], backward=counts[2])


class _Search:
    def __init__(
        self,
        costs: Sequence[LayerCost],
        makespan: Callable[[Plan], float],
        budget: float | None,
        limit: int,
    ) -> None:
        self.costs = costs
        self.makespan = makespan
        self.budget = budget
        self.limit = limit
        self.seen: dict[Counts, float | None] = {}
        self.best: Counts = ((), len(costs), ())
        self.best_key: tuple[float, int] | None = None
        self.fwd = _prefix([c.forward for c in costs])
        self.fb = _prefix([c.forward + c.backward for c in costs])

    def evaluate(self, counts: Counts) -> float | None:
        """Simulated makespan of a plan (None over the budget, or once the evaluations are spent)."""
        if counts in self.seen:
            return self.seen[counts]
        if len(self.seen) >= self.limit:
            return None
        plan = Plan.from_counts(len(self.costs), forward=counts[0], fused=counts[1], backward=counts[2])
        value = None
        if self.budget is None or all(stage_memory(s, self.costs) <= self.budget for s in plan.slots):
            value = self.makespan(plan)
            key = (value, plan.num_slots)
            if self.best_key is None or key < self.best_key:
                self.best, self.best_key = counts, key
        self.seen[counts] = value
        return value

    def balanced(self) -> None:
        """Scan balanced plans by (forward stages k, backward stages j) and the size of the fused stage.

        Plans whose stages cost about as much as the slowest unavoidable slot, and their neighbours in
        (k, j), join the seeds. The makespan depends on k and j jointly (through ``S mod N`` and the
        slowest slot), so a window of both is scanned around the best plan, then j and k are swept over
        their useful ranges and the window is scanned again around the new best. Slightly larger fused
        stages get the same treatment when one of them leads. Finally the other ways of rounding stage
        sizes are tried at the best (k, j).
        """
        first = self.best[1]
        self._seed(first)
        self._scan(first)
        for fused in range(first + 1, min(first + FUSED_EXTRA, len(self.costs) - 1) + 1):
            self._seed(fused)
        if self.best[1] != first:
            self._scan(self.best[1])
        k, j = self._shape()
        for rules in ((True, False), (False, True), (False, False)):
            self._try(k, j, self.best[1], rules)

    def _seed(self, fused: int) -> None:
        pace = self._pace(fused)
        if pace > 0:  # stages as large as the slowest unavoidable slot
            k = _count(self.fwd, len(self.costs) - fused, pace)
            j = _count(self.fb, len(self.costs) - fused, pace)
            self._window(k, j, fused, WINDOW // 2)

    def _scan(self, fused: int) -> None:
        k_range, j_range = self._ranges(fused)
        self._window(*self._shape(), fused, WINDOW)
        for axis in ("j", "k"):
            k, j = self._shape()
            for v in j_range if axis == "j" else k_range:
                self._try(v if axis == "k" else k, v if axis == "j" else j, fused, (True, True))
        self._window(*self._shape(), fused, WINDOW)

    def _window(self, k0: int, j0: int, fused: int, half: int) -> None:
        for dk in range(-half, half + 1):
            for dj in range(-half, half + 1):
                self._try(k0 + dk, j0 + dj, fused, (True, True))

    def _shape(self) -> tuple[int, int]:
        return max(len(self.best[0]), 1), max(len(self.best[2]), 1)

    def _pace(self, fused: int) -> float:
        """The slowest slot no plan with this fused stage avoids: the fused stage or the costliest layer."""
        below = len(self.costs) - fused
        top = self.fb[len(self.costs)] - self.fb[below]
        return max([top, *(self.fb[i + 1] - self.fb[i] for i in range(below))])

    def _ranges(self, fused: int) -> tuple[range, range]:
        """Stage counts whose stages cost between a quarter (forward) or half (backward) and twice the
        pace."""
        below = len(self.costs) - fused
        pace = self._pace(fused)
        if below < 1 or pace <= 0:
            return range(1, 2), range(1, 2)
        f_total, b_total = self.fwd[below], self.fb[below]
        k_lo = max(1, int(f_total / (2 * pace)))
        k_hi = min(below, int(4 * f_total / pace) + 1)
        j_lo = max(1, int(b_total / (2 * pace)))
        j_hi = min(below, int(2 * b_total / pace) + 1)
        return range(k_lo, k_hi + 1), range(j_lo, j_hi + 1)

    def _try(self, k: int, j: int, fused: int, rules: tuple[bool, bool]) -> None:
        below = len(self.costs) - fused
        if not (1 <= k <= below and 1 <= j <= below):
            return
        forward = _split(self.fwd, 0, below, k, large_first=rules[0])
        backward = _split(self.fb, below, 0, j, large_first=rules[1])
        self.evaluate((tuple(forward), fused, tuple(backward)))

    def local(self) -> None:
        """First-improvement local search over one-layer boundary moves, in a fixed pseudo-random order."""
        rng = random.Random(0)
        improved = True
        while improved and len(self.seen) < self.limit:
            improved = False
            current = self.best_key
            moves = _neighbours(self.best)
            rng.shuffle(moves)
            for counts in moves:
                self.evaluate(counts)
                if self.best_key != current:
                    improved = True
                    break


def _counts(plan: Plan) -> Counts:
    c = plan.to_counts()
    forward, fused, backward = c["forward"], c["fused"], c["backward"]
    if not isinstance(forward, list) or not isinstance(backward, list) or not isinstance(fused, int):
        raise TypeError("Plan.to_counts returned an unexpected shape")
    return tuple(forward), fused, tuple(backward)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _split(prefix: Sequence[float], start: int, stop: int, parts: int, *, large_first: bool) -> list[int]:
    """Sizes of ``parts`` non-empty stages walking from layer ``start`` towards ``stop`` (either way).

    Each stage aims at an equal share of the cost still left. ``large_first`` takes the layer that
    crosses the share (earlier stages come out larger), otherwise stops short of it; a stage takes at
    least one layer and leaves one for each stage after it.
    """
    step = 1 if stop >= start else -1
    sizes: list[int] = []
    at = start
    for i in range(parts):
        left = parts - i
        if left == 1:
            sizes.append(abs(stop - at))
            break
        remaining = abs(prefix[stop] - prefix[at])
        share = remaining / left
        size = 1
        room = abs(stop - at) - (left - 1)
        while size < room:
            cost = abs(prefix[at + step * size] - prefix[at])
            nxt = abs(prefix[at + step * (size + 1)] - prefix[at])
            if large_first:
                if cost >= share * (1 - _TOL) and cost > 0:
                    break
            elif nxt > share * (1 + _TOL):
                break
            size += 1
        sizes.append(size)
        at += step * size
    return sizes


def _count(prefix: Sequence[float], stop: int, cap: float) -> int:
    """Stages a greedy bottom-up packing of layers ``[0, stop)`` needs when none may cost over ``cap``
    (a layer costlier than ``cap`` gets a stage of its own)."""
    count, at = 0, 0
    while at < stop:
        end = at + 1
        while end < stop and prefix[end + 1] - prefix[at] <= cap * (1 + _TOL):
            end += 1
        count += 1
        at = end
    return max(count, 1)


def _neighbours(counts: Counts) -> list[Counts]:
    """Plans one boundary move away: a layer between adjacent stages, or into or out of the fused stage."""
    forward, fused, backward = list(counts[0]), counts[1], list(counts[2])
    out: list[Counts] = []
    for which, stages in ((0, forward), (1, backward)):
        for i in range(len(stages) - 1):
            for d in (1, -1):
                moved = list(stages)
                moved[i] += d
                moved[i + 1] -= d
                if moved[i] >= 1 and moved[i + 1] >= 1:
                    out.append(
                        (tuple(moved), fused, tuple(backward))
                        if which == 0
                        else (tuple(forward), fused, tuple(moved))
                    )
    if forward:
        # the fused stage takes the top layer of the last forward and of the first backward stage
        grown_f = [*forward[:-1], forward[-1] - 1]
        grown_b = [backward[0] - 1, *backward[1:]]
        grown = (tuple(x for x in grown_f if x), fused + 1, tuple(x for x in grown_b if x))
        if bool(grown[0]) == bool(grown[2]):
            out.append(grown)
    if forward and fused > 1:
        out.append(((*forward[:-1], forward[-1] + 1), fused - 1, (backward[0] + 1, *backward[1:])))
    elif fused > 1:
        out.append(((fused - 1,), 1, (fused - 1,)))
    return out
