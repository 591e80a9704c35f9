"""Per-layer costs (the proxy before measuring, averages of measured times), the memory budget,
the partition chosen from them and its grid."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.board import Iteration, MicroBatch
from engine.parallel.stages import choose_plan, measured_costs, memory_budget, plan_grid
from engine.scheduling.partition import LayerCost, Plan, auto_partition


def iteration(plan: Plan, fwd: dict[int, float], bwd: dict[int, float], m: int) -> Iteration:
    mbs = [MicroBatch(None, None, None) for _ in range(m)]
    it = Iteration(
        serial=0,
        version=0,
        plan=plan,
        runs=[],
        microbatches=mbs,
        total_tokens=1,
        rounds=[],
        seed=0,
        checkpoints=frozenset(),
    )
    it.layer_fwd_s, it.layer_bwd_s = dict(fwd), dict(bwd)
    return it


def test_measured_costs_average_per_microbatch_and_count_the_recompute() -> None:
    plan = Plan.from_counts(4, forward=[2], fused=2, backward=[2])
    memory = [LayerCost(0, 0, 10.0 * i, 20.0 * i) for i in range(4)]
    # layers 0-1 ran forward twice per micro-batch (forward stage + recompute), layers 2-3 once
    a = iteration(plan, {0: 0.8, 1: 1.6, 2: 2.0, 3: 4.0}, {0: 0.4, 1: 4.0, 2: 4.0, 3: 8.0}, m=2)
    b = iteration(plan, {0: 0.4, 1: 0.8, 2: 1.0, 3: 2.0}, {0: 0.2, 1: 2.0, 2: 2.0, 3: 4.0}, m=2)
    costs = measured_costs([a, b], memory)
    assert [c.forward for c in costs] == pytest.approx([0.15, 0.3, 0.75, 1.5])
    assert [c.backward for c in costs] == pytest.approx([0.15, 1.5, 1.5, 3.0])
    assert [c.memory_backward for c in costs] == [0.0, 20.0, 40.0, 60.0]


class TimedEvent:
    """Stands in for a CUDA timing event (none runs here): ``at`` ms on the stream's clock."""

    def __init__(self, at: float) -> None:
        self.at, self.waited = at, 0

    def synchronize(self) -> None:
        self.waited += 1

    def elapsed_time(self, end: TimedEvent) -> float:
        return end.at - self.at


def test_gpu_event_pairs_are_read_once_when_the_costs_are_measured() -> None:
    # a GPU worker records an event pair around each layer and never waits; the pairs are read
    # (their end awaited) only when the calibration reads the iteration
    plan = Plan.from_counts(2, forward=[], fused=2, backward=[])
    it = iteration(plan, {}, {}, m=1)
    ends = [TimedEvent(30.0), TimedEvent(80.0), TimedEvent(40.0), TimedEvent(100.0)]
    it.layer_events = [
        (it.layer_fwd_s, 0, TimedEvent(10.0), ends[0]),
        (it.layer_fwd_s, 1, TimedEvent(30.0), ends[1]),
        (it.layer_bwd_s, 0, TimedEvent(20.0), ends[2]),
        (it.layer_bwd_s, 1, TimedEvent(80.0), ends[3]),
    ]
    costs = measured_costs([it], [LayerCost(0, 0, 0, 0)] * 2)
    assert [c.forward for c in costs] == pytest.approx([0.020, 0.050])
    assert [c.backward for c in costs] == pytest.approx([0.020, 0.020])
    assert it.layer_events == [] and [e.waited for e in ends] == [1, 1, 1, 1]
    measured_costs([it], [LayerCost(0, 0, 0, 0)] * 2)  # read once: the times do not double
    assert it.layer_fwd_s == pytest.approx({0: 0.020, 1: 0.050})


def test_a_layer_without_measurement_is_an_error() -> None:
    plan = Plan.from_counts(2, forward=[], fused=2, backward=[])
    it = iteration(plan, {0: 1.0}, {0: 1.0, 1: 1.0}, m=1)
    with pytest.raises(ValueError, match="no time measured for layer 1"):
        measured_costs([it], [LayerCost(0, 0, 0, 0)] * 2)


def test_memory_budget_is_unlimited_on_cpu_workers_unless_given() -> None:
    cpu = [torch.device("cpu")] * 2
    assert memory_budget(cpu, None) is None
    assert memory_budget(cpu, 1000) == 1000.0


def test_choose_plan_from_proxy_costs_is_the_closed_form_partition() -> None:
    costs = [LayerCost(1.0, 2.0, 0.0, 0.0)] * 6
    plan = choose_plan(
        costs,
        measured=False,
        num_workers=2,
        num_microbatches=4,
        memory_budget=None,
        round_size=None,
        async_optimizer=False,
        previous=None,
    )
    assert plan == auto_partition(costs, num_workers=2, num_microbatches=4)


def test_plan_grid_shows_every_slot_of_one_iteration() -> None:
    plan = Plan.from_counts(4, forward=[2], fused=2, backward=[2])
    grid = plan_grid(plan, num_workers=2, num_microbatches=2, round_size=None)
    assert all(s.name in grid for s in plan.slots)
