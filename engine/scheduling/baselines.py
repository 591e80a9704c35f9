"""Per-GPU op orders of the stage-bound pipeline schedules RoundPipe is compared with.

Pure Python: nothing here imports torch. In these schedules stage ``s`` of ``v·N`` (virtual) stages
lives on GPU ``s mod N`` for the whole iteration. An action is ``("F" | "B", stage, microbatch)``;
:func:`bound_orders` lists the actions of every GPU in the order that GPU runs them, and
:func:`bound_ops` turns them into timed work for the simulator.

- **GPipe**: all forwards, micro-batches ascending, then all backwards.
- **1F1B** (the order of PyTorch's ``Schedule1F1B``, the same per-rank sequence as Megatron's):
  ``min(M, N − r)`` warm-up forwards, then one backward and one forward alternately until every forward
  is issued, then the remaining backwards.
- **Interleaved-1F1B** (the per-rank order of PyTorch's ``ScheduleInterleaved1F1B``): rounds
  ``R = max(1, ⌊M/N⌋)`` of ``P = M/R`` micro-batches; ``W_r = min((v−1)·P + 2·(N−1−r), v·M)`` warm-up
  forwards, then (forward, backward) pairs, then the remaining backwards. Forward step ``k`` runs local
  stage ``⌊k/P⌋ mod v``, backward step ``k`` local stage ``v−1−(⌊k/P⌋ mod v)``, each on that stage's next
  micro-batch.
- **Looped-BFS**: forwards of the local stages ascending, each over all micro-batches ascending, then
  backwards of the local stages descending, micro-batches descending.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.scheduling.partition import LayerCost
from engine.scheduling.timeline import Op

BOUND_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")

# ("F" or "B", stage, microbatch)
Action = tuple[str, int, int]


def bound_orders(
    schedule: str, *, num_workers: int, num_microbatches: int, stages_per_worker: int
) -> list[list[Action]]:
    """The per-GPU action order of a stage-bound schedule.

    Args:
        schedule: one of ``BOUND_SCHEDULES``.
        num_workers: N >= 1 GPUs.
        num_microbatches: M >= 1 micro-batches.
        stages_per_worker: v >= 1 (virtual) stages per GPU; 1 for GPipe and 1F1B.

    Returns:
        ``orders[r]`` lists GPU ``r``'s actions; every (stage, micro-batch) appears once as "F" and
        once as "B" over all GPUs.

    Raises:
        ValueError: an unknown schedule, a count that is not a positive integer, ``v != 1`` for GPipe or
            1F1B, ``M < N`` for 1F1B, or ``M`` not divisible by ``max(1, ⌊M/N⌋)`` for Interleaved-1F1B.
    """
    if schedule not in BOUND_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {BOUND_SCHEDULES}")
    _check_int("num_workers", num_workers)
    _check_int("num_microbatches", num_microbatches)
    _check_int("stages_per_worker", stages_per_worker)
    n, m, v = num_workers, num_microbatches, stages_per_worker
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"stages_per_worker={v} must be 1 for {schedule} (one stage per GPU)")
    if schedule == "1f1b" and m < n:
        raise ValueError(f"num_microbatches={m} must be >= num_workers={n} for 1f1b")
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // n)
        if m % rounds:
            raise ValueError(
                f"num_microbatches={m} must be divisible by max(1, num_microbatches // num_workers)={rounds} "
                "for interleaved-1f1b"
            )
    build = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
        "interleaved-1f1b": _interleaved,
        "looped-bfs": _looped_bfs,
    }[schedule]
    return [build(r, n, m, v) for r in range(n)]


def bound_ops(
    schedule: str,
    costs: Sequence[LayerCost],
    stages: Sequence[int],
    *,
    num_workers: int,
    num_microbatches: int,
) -> list[Op]:
    """The ops of one iteration of a stage-bound schedule, each GPU's in its order.

    A forward of stage ``s`` costs the forward of its layers (the output layer's included) and waits for
    stage ``s−1``'s forward. A backward recomputes the stage's layers (not the output layer) and runs
    their backward; it waits for its own forward and for stage ``s+1``'s backward.

    Args:
        schedule: one of ``BOUND_SCHEDULES``.
        costs: per layer, input layer first, output layer last.
        stages: layers per stage, bottom-up, a multiple of N entries summing to ``len(costs)``; 0 is an
            empty stage; stage ``s`` runs on GPU ``s mod N``.
        num_workers: N.
        num_microbatches: M.

    Returns:
        Ops keyed ``("F" | "B", stage, microbatch)``.

    Raises:
        ValueError: bad stage counts, or as :func:`bound_orders`.
    """
    _check_int("num_workers", num_workers)
    _check_int("num_microbatches", num_microbatches)
    n, m = num_workers, num_microbatches
    for i, count in enumerate(stages):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"stages[{i}]={count!r} must be an integer >= 0")
    if not stages or len(stages) % n:
        raise ValueError(f"len(stages)={len(stages)} must be a positive multiple of num_workers={n}")
    if sum(stages) != len(costs):
        raise ValueError(f"stages {list(stages)} sum to {sum(stages)}, expected len(costs)={len(costs)}")
    out_layer = len(costs) - 1
    fwd: list[float] = []
    bwd: list[float] = []
    at = 0
    for count in stages:
        layers = range(at, at + count)
        fwd.append(sum(costs[i].forward for i in layers))
        # recompute, then backward; the output layer is not recomputed
        bwd.append(sum(costs[i].backward + (costs[i].forward if i != out_layer else 0.0) for i in layers))
        at += count
    last = len(stages) - 1
    orders = bound_orders(schedule, num_workers=n, num_microbatches=m, stages_per_worker=len(stages) // n)
    ops = []
    for r, order in enumerate(orders):
        for action, s, mb in order:
            if action == "F":
                deps: tuple[Hashable, ...] = (("F", s - 1, mb),) if s > 0 else ()
                ops.append(Op(("F", s, mb), r, fwd[s], deps=deps, kind="forward", label=f"F{s}.m{mb}"))
            else:
                deps = (("F", s, mb),) + ((("B", s + 1, mb),) if s < last else ())
                ops.append(Op(("B", s, mb), r, bwd[s], deps=deps, kind="backward", label=f"B{s}.m{mb}"))
    return ops


def _gpipe(r: int, n: int, m: int, v: int) -> list[Action]:
    return [("F", r, mb) for mb in range(m)] + [("B", r, mb) for mb in range(m)]


def _one_f_one_b(r: int, n: int, m: int, v: int) -> list[Action]:
    warmup = min(m, n - r)
    out: list[Action] = [("F", r, mb) for mb in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(("B", r, bwd))
        bwd += 1
        if fwd == m:
            break
        out.append(("F", r, fwd))
        fwd += 1
    out += [("B", r, mb) for mb in range(bwd, m)]
    return out


def _interleaved(r: int, n: int, m: int, v: int) -> list[Action]:
    per_round = m // max(1, m // n)
    total = v * m
    warmup = min((v - 1) * per_round + 2 * (n - 1 - r), total)
    next_f = [0] * v
    next_b = [0] * v

    def forward(k: int) -> Action:
        local = (k // per_round) % v
        mb = next_f[local]
        next_f[local] += 1
        return ("F", local * n + r, mb)

    def backward(k: int) -> Action:
        local = v - 1 - (k // per_round) % v
        mb = next_b[local]
        next_b[local] += 1
        return ("B", local * n + r, mb)

    out = [forward(k) for k in range(warmup)]
    k_b = 0
    for k_f in range(warmup, total):
        out.append(forward(k_f))
        out.append(backward(k_b))
        k_b += 1
    out += [backward(k) for k in range(k_b, total)]
    return out


def _looped_bfs(r: int, n: int, m: int, v: int) -> list[Action]:
    local = [i * n + r for i in range(v)]
    out: list[Action] = [("F", s, mb) for s in local for mb in range(m)]
    out += [("B", s, mb) for s in reversed(local) for mb in reversed(range(m))]
    return out


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
