"""Round-robin dispatch of RoundPipe slots onto workers, as plain data.

Pure Python: nothing here imports torch. A schedule is a list of :class:`SlotRun`; a unit-time
timeline and a step × worker grid make it readable in tests and in ``roundhouse plan``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# Key of one (slot, micro-batch) op in a timeline: (iteration, round, slot, microbatch).
OpKey = tuple[int, int, int, int]


@dataclass(frozen=True)
class SlotRun:
    """One slot of one round, run by one worker over the round's micro-batches."""

    iteration: int
    round: int  # round index within the iteration
    slot: int  # index into plan.slots
    worker: int
    microbatches: tuple[int, ...]  # micro-batch indices within the iteration, ascending


def split_rounds(num_microbatches: int, round_size: int) -> list[tuple[int, ...]]:
    """Cut micro-batches ``0..M-1`` into consecutive rounds.

    Args:
        num_microbatches: M >= 1.
        round_size: micro-batches per round (>= 1); the last round is shorter when it does not divide M.

    Returns:
        The rounds, each a tuple of ascending micro-batch indices.

    Raises:
        ValueError: an argument is not a positive integer.
    """
    _check_int("num_microbatches", num_microbatches, minimum=1)
    _check_int("round_size", round_size, minimum=1)
    return [
        tuple(range(lo, min(lo + round_size, num_microbatches)))
        for lo in range(0, num_microbatches, round_size)
    ]


def build_schedule(
    *,
    num_slots: int,
    num_workers: int,
    num_microbatches: int,
    round_size: int | None,
    iteration: int,
    start_worker: int,
) -> tuple[list[SlotRun], int]:
    """Dispatch one iteration: slot ``i`` of a round runs on worker ``(g0 + i) mod N``.

    Each round (and the next iteration) starts at ``(g0 + S) mod N``, continuing the rotation without a
    flush.

    Args:
        num_slots: S, slots per round (forward stages + fused + backward stages).
        num_workers: N.
        num_microbatches: M, micro-batches in this iteration.
        round_size: micro-batches per round, >= N unless it covers all M; None means one round of all M.
        iteration: iteration number recorded in the runs (>= 0).
        start_worker: g0 of the first round, in ``[0, N)``.

    Returns:
        The runs ordered by (round, slot), and the start worker of the next round/iteration.

    Raises:
        ValueError: an argument is out of range, or ``round_size < num_workers`` with more than one round.
    """
    _check_int("num_slots", num_slots, minimum=1)
    _check_int("num_workers", num_workers, minimum=1)
    _check_int("num_microbatches", num_microbatches, minimum=1)
    _check_int("iteration", iteration, minimum=0)
    _check_int("start_worker", start_worker, minimum=0)
    if start_worker >= num_workers:
        raise ValueError(f"start_worker={start_worker} must be < num_workers={num_workers}")
    if round_size is None:
        round_size = num_microbatches
    _check_int("round_size", round_size, minimum=1)
    if round_size < num_workers and round_size < num_microbatches:
        raise ValueError(
            f"round_size={round_size} must be >= num_workers={num_workers} "
            f"(or cover all num_microbatches={num_microbatches} in one round)"
        )
    runs: list[SlotRun] = []
    g0 = start_worker
    for r, mbs in enumerate(split_rounds(num_microbatches, round_size)):
        for slot in range(num_slots):
            runs.append(SlotRun(iteration, r, slot, (g0 + slot) % num_workers, mbs))
        g0 = (g0 + num_slots) % num_workers
    return runs, g0


def worker_queues(runs: Sequence[SlotRun], num_workers: int) -> list[list[SlotRun]]:
    """Split runs by worker, keeping their order.

    Args:
        runs: the runs, in dispatch order.
        num_workers: N.

    Returns:
        ``queues[w]`` is the list of runs of worker ``w``.

    Raises:
        ValueError: a run names a worker outside ``[0, N)``.
    """
    _check_int("num_workers", num_workers, minimum=1)
    queues: list[list[SlotRun]] = [[] for _ in range(num_workers)]
    for run in runs:
        if not 0 <= run.worker < num_workers:
            raise ValueError(f"run {run} has worker={run.worker}, outside [0, num_workers={num_workers})")
        queues[run.worker].append(run)
    return queues


def unit_timeline(
    runs: Sequence[SlotRun], *, kinds: Sequence[str], num_workers: int
) -> dict[OpKey, tuple[int, int]]:
    """As-soon-as-possible start times when every (slot, micro-batch) takes one time unit.

    Each worker runs its runs in list order, micro-batches ascending. Within one iteration and round, a
    forward or fused slot's micro-batch ``m`` waits for slot ``i-1``'s ``m``; a backward slot's ``m``
    waits for slot ``i-1``'s ``m`` and for the last forward slot's ``m``.

    Args:
        runs: the runs (e.g. from :func:`build_schedule`, possibly several iterations concatenated).
        kinds: ``kinds[slot]`` is "forward", "fused" or "backward"; forward*, one fused, backward*.
        num_workers: N.

    Returns:
        ``{(iteration, round, slot, microbatch): (worker, start_time)}``.

    Raises:
        ValueError: bad ``kinds``, a slot index outside ``kinds``, a missing or duplicate op, or an order
            in which the workers would wait on each other forever.
    """
    fused = _check_kinds(kinds)
    queues = worker_queues(runs, num_workers)
    ops: list[list[OpKey]] = []
    known: set[OpKey] = set()
    for queue in queues:
        ops.append([])
        for run in queue:
            if not 0 <= run.slot < len(kinds):
                raise ValueError(f"run {run} has slot={run.slot}, outside the {len(kinds)} kinds")
            for m in run.microbatches:
                key = (run.iteration, run.round, run.slot, m)
                if key in known:
                    raise ValueError(f"op (iteration, round, slot, microbatch)={key} appears twice")
                known.add(key)
                ops[-1].append(key)

    def deps(key: OpKey) -> list[OpKey]:
        it, r, slot, m = key
        out = [(it, r, slot - 1, m)] if slot > 0 else []
        if kinds[slot] == "backward" and fused > 0:  # the last forward slot's output
            out.append((it, r, fused - 1, m))
        return out

    for key in itertools.chain.from_iterable(ops):
        for dep in deps(key):
            if dep not in known:
                raise ValueError(f"op {key} depends on {dep}, which no run provides")
    end: dict[OpKey, int] = {}
    result: dict[OpKey, tuple[int, int]] = {}
    heads = [0] * num_workers
    free = [0] * num_workers
    progress = True
    while progress:
        progress = False
        for w in range(num_workers):
            while heads[w] < len(ops[w]):
                key = ops[w][heads[w]]
                needs = deps(key)
                if any(d not in end for d in needs):
                    break
                start = max([free[w], *(end[d] for d in needs)])
                result[key] = (w, start)
                end[key] = free[w] = start + 1
                heads[w] += 1
                progress = True
    if len(result) != len(known):
        stuck = [ops[w][heads[w]] for w in range(num_workers) if heads[w] < len(ops[w])]
        raise ValueError(f"deadlock: workers wait forever at ops {stuck}")
    return dict(sorted(result.items()))


def render_grid(
    runs: Sequence[SlotRun], *, slot_names: Sequence[str], kinds: Sequence[str], num_workers: int
) -> str:
    """Render the unit timeline as a step × worker table.

    Args:
        runs: the runs.
        slot_names: ``slot_names[slot]``, e.g. "F1", "B1", "B2".
        kinds: ``kinds[slot]``, as for :func:`unit_timeline`.
        num_workers: N.

    Returns:
        One row per time step, one column per worker; a cell reads "F1.m0" ("1:F1.m0" when the runs
        span several iterations) or "." when the worker is idle. No trailing newline.

    Raises:
        ValueError: ``slot_names`` and ``kinds`` differ in length, or as :func:`unit_timeline`.
    """
    if len(slot_names) != len(kinds):
        raise ValueError(f"len(slot_names)={len(slot_names)} differs from len(kinds)={len(kinds)}")
    timeline = unit_timeline(runs, kinds=kinds, num_workers=num_workers)
    steps = 1 + max((start for _, start in timeline.values()), default=-1)
    cells = [["."] * num_workers for _ in range(steps)]
    prefix = len({run.iteration for run in runs}) > 1
    for (it, _, slot, m), (w, start) in timeline.items():
        cells[start][w] = (f"{it}:" if prefix else "") + f"{slot_names[slot]}.m{m}"
    table = [["step", *(f"w{w}" for w in range(num_workers))]]
    table += [[str(t), *row] for t, row in enumerate(cells)]
    widths = [max(len(row[c]) for row in table) for c in range(num_workers + 1)]
    return "\n".join(
        "  ".join(cell.ljust(wd) for cell, wd in zip(row, widths, strict=True)).rstrip() for row in table
    )


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_kinds(kinds: Sequence[str]) -> int:
    """Check kinds is forward*, fused, backward*; return the fused slot index."""
    if list(kinds).count("fused") != 1:
        raise ValueError(f"kinds={list(kinds)} must hold exactly one 'fused' slot")
    fused = list(kinds).index("fused")
    expected = ["forward"] * fused + ["fused"] + ["backward"] * (len(kinds) - fused - 1)
    if list(kinds) != expected:
        raise ValueError(f"kinds={list(kinds)} must be forward slots, one fused slot, then backward slots")
    return fused
