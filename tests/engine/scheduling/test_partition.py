"""Tests for engine.scheduling.partition: plans, validation, costs and the automatic partitioner."""

import itertools
import random
from collections.abc import Iterator

import pytest

from engine.scheduling.partition import (
    LayerCost,
    Plan,
    Stage,
    auto_partition,
    fewest_stages,
    objective,
    proxy_costs,
    stage_cost,
    stage_memory,
    validate_plan,
)


def uniform(num_layers: int, f: float = 1.0, b: float = 2.0, mem: float = 1.0) -> list[LayerCost]:
    return [LayerCost(f, b, mem, mem) for _ in range(num_layers)]


def compositions(total: int) -> Iterator[list[int]]:
    """All ordered lists of positive integers summing to ``total`` (one empty list for 0)."""
    if total == 0:
        yield []
        return
    for cuts in itertools.product([False, True], repeat=total - 1):
        parts, run = [], 1
        for cut in cuts:
            if cut:
                parts.append(run)
                run = 1
            else:
                run += 1
        yield [*parts, run]


def all_plans(num_layers: int) -> Iterator[Plan]:
    for fused in range(1, num_layers + 1):
        rest = num_layers - fused
        for fwd in compositions(rest):
            for bwd in compositions(rest):
                yield Plan.from_counts(num_layers, forward=fwd, fused=fused, backward=bwd)


def fits(plan: Plan, costs: list[LayerCost], budget: float | None) -> bool:
    return budget is None or all(stage_memory(s, costs) <= budget for s in plan.slots)


def key(plan: Plan, costs: list[LayerCost], n: int, m: int) -> tuple[float, int, float]:
    t_max = max(stage_cost(s, costs) for s in plan.slots)
    return objective(plan, costs, num_workers=n, num_microbatches=m), plan.num_slots, t_max


# --- Plan ---


def test_from_counts_builds_named_stages() -> None:
    plan = Plan.from_counts(8, forward=[3, 2], fused=3, backward=[2, 3])
    assert plan.forward == (Stage("forward", 0, 3, "F1"), Stage("forward", 3, 5, "F2"))
    assert plan.fused == Stage("fused", 5, 8, "B1")
    assert plan.backward == (Stage("backward", 3, 5, "B2"), Stage("backward", 0, 3, "B3"))
    assert [s.name for s in plan.slots] == ["F1", "F2", "B1", "B2", "B3"]
    assert plan.num_slots == 5
    assert plan.fused.layers == range(5, 8)
    assert plan.to_counts() == {"forward": [3, 2], "fused": 3, "backward": [2, 3]}
    assert plan.describe() == "F1[0:3] F2[3:5] | B1[5:8] | B2[3:5] B3[0:3]"
    assert plan.checkpoint_boundaries() == (3, 5)


def test_checkpoint_boundaries_include_unaligned_backward_starts() -> None:
    plan = Plan.from_counts(9, forward=[4, 3], fused=2, backward=[1, 2, 2, 2])
    assert plan.describe() == "F1[0:4] F2[4:7] | B1[7:9] | B2[6:7] B3[4:6] B4[2:4] B5[0:2]"
    assert plan.checkpoint_boundaries() == (2, 4, 6, 7)


def test_fused_stage_may_hold_every_layer() -> None:
    plan = Plan.from_counts(4, forward=[], fused=4, backward=[])
    assert plan.slots == (Stage("fused", 0, 4, "B1"),)
    assert plan.num_slots == 1
    assert plan.describe() == "B1[0:4]"
    assert plan.checkpoint_boundaries() == ()


def test_from_counts_round_trips_to_counts() -> None:
    for plan in all_plans(5):
        counts = plan.to_counts()
        assert isinstance(counts["forward"], list) and isinstance(counts["backward"], list)
        assert isinstance(counts["fused"], int)
        again = Plan.from_counts(
            5, forward=counts["forward"], fused=counts["fused"], backward=counts["backward"]
        )
        assert again == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_layers": 8, "forward": [3, 3], "fused": 3, "backward": [2, 3]},
            "forward counts [3, 3] (sum 6) plus fused=3 make 9 layers, expected num_layers=8",
        ),
        (
            {"num_layers": 8, "forward": [3, 2], "fused": 3, "backward": [4]},
            "backward counts [4] (sum 4) plus fused=3 make 7 layers, expected num_layers=8",
        ),
        (
            {"num_layers": 8, "forward": [5, 0], "fused": 3, "backward": [5]},
            "forward[1]=0 must be an integer >= 1",
        ),
        ({"num_layers": 8, "forward": [8], "fused": 0, "backward": [8]}, "fused=0 must be an integer >= 1"),
        (
            {"num_layers": 1, "forward": [], "fused": 1, "backward": []},
            "num_layers=1 must be an integer >= 2",
        ),
        (
            {"num_layers": 4, "forward": [], "fused": 3, "backward": [1]},
            "forward counts [] (sum 0) plus fused=3",
        ),
    ],
)
def test_from_counts_rejects_bad_counts(kwargs: dict, message: str) -> None:
    num_layers = kwargs.pop("num_layers")
    with pytest.raises(ValueError) as info:
        Plan.from_counts(num_layers, **kwargs)
    assert message in str(info.value)


def test_validate_plan_accepts_from_counts_plans() -> None:
    for plan in all_plans(6):
        validate_plan(plan)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            Plan(
                6,
                (Stage("forward", 0, 2, "F1"), Stage("forward", 3, 4, "F2")),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "gap in forward stages: F2 starts at layer 3, expected 2",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 3, "F1"), Stage("forward", 2, 4, "F2")),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "overlap in forward stages: F2 starts at layer 2, expected 3",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 3, "F1"),),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "gap: forward stages end at layer 3, the fused stage starts at 4",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 4, "F1"),),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 2, 4, "B2"), Stage("backward", 0, 1, "B3")),
            ),
            "gap in backward stages: B3 ends at layer 1, expected 2",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 4, "F1"),),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 1, 4, "B2"),),
            ),
            "backward stages end at layer 1, they must reach layer 0",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 4, "F1"),),
                Stage("fused", 4, 5, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "fused stage B1[4:5] must end at num_layers=6",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 4, "F1"), Stage("forward", 4, 4, "F2")),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "stage F2[4:4] must hold at least one layer within [0, 6)",
        ),
        (
            Plan(
                6,
                (Stage("forward", 0, 4, "F2"),),
                Stage("fused", 4, 6, "B1"),
                (Stage("backward", 0, 4, "B2"),),
            ),
            "stage F2[0:4] should be kind 'forward' named 'F1'",
        ),
        (
            Plan(6, (), Stage("fused", 4, 6, "B1"), (Stage("backward", 0, 4, "B2"),)),
            "forward stages must cover layers [0, 4) below the fused stage",
        ),
        (
            Plan(3, (Stage("forward", 0, 1, "F1"),), Stage("fused", 0, 3, "B1"), ()),
            "fused stage covers all 3 layers, so forward (1 stages) and backward (0 stages) must be empty",
        ),
    ],
)
def test_validate_plan_names_the_problem(plan: Plan, message: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_plan(plan)
    assert message in str(info.value)


def test_stage_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind='sideways'"):
        Stage("sideways", 0, 1, "X1")


# --- costs ---


def test_stage_cost_memory_and_objective_by_hand() -> None:
    costs = [LayerCost(1, 10, 100, 1000), LayerCost(2, 20, 200, 2000), LayerCost(3, 30, 300, 3000)]
    plan = Plan.from_counts(3, forward=[2], fused=1, backward=[2])
    f1, b1, b2 = plan.slots
    assert stage_cost(f1, costs) == 3  # forward only
    assert stage_cost(b1, costs) == 33  # forward + loss + backward
    assert stage_cost(b2, costs) == 33  # recompute + backward
    assert stage_memory(f1, costs) == 300
    assert stage_memory(b1, costs) == 3000
    assert stage_memory(b2, costs) == 3000
    # (M·S + N(N−1))·t_max = (4·3 + 2·1)·33
    assert objective(plan, costs, num_workers=2, num_microbatches=4) == 14 * 33
    with pytest.raises(ValueError, match=r"len\(costs\)=2 does not match plan.num_layers=3"):
        objective(plan, costs[:2], num_workers=2, num_microbatches=4)
    with pytest.raises(ValueError, match="stage B1\\[2:3\\] is outside the 2 layers"):
        stage_cost(b1, costs[:2])


def test_proxy_costs() -> None:
    costs = proxy_costs([10.0, 4.0, 6.0], activation_bytes=[1.0, 2.0, 3.0])
    assert costs == [
        LayerCost(forward=0.0, backward=0.0, memory_forward=11.0, memory_backward=21.0),
        LayerCost(forward=4.0, backward=8.0, memory_forward=6.0, memory_backward=10.0),
        LayerCost(forward=6.0, backward=12.0, memory_forward=9.0, memory_backward=15.0),
    ]
    assert proxy_costs([1.0, 2.0])[1] == LayerCost(2.0, 4.0, 2.0, 4.0)
    with pytest.raises(ValueError, match=r"len\(activation_bytes\)=1 does not match len\(param_bytes\)=2"):
        proxy_costs([1.0, 2.0], activation_bytes=[1.0])
    with pytest.raises(ValueError, match=r"param_bytes\[1\]=-3.0 must be finite and >= 0"):
        proxy_costs([1.0, -3.0])
    with pytest.raises(ValueError, match="param_bytes has 1 layers, need at least 2"):
        proxy_costs([1.0])


# --- auto_partition ---


def test_auto_partition_uniform_by_hand() -> None:
    # 6 layers, f=1, b=2 (a fused/backward layer costs 3), N=2, M=4, so N(N-1)=2. Candidates:
    #   t=3: fused 1 layer, 5 one-layer backward stages, forward [3, 2] -> S=8: (4*8+2)*3 = 102
    #   t=4: forward [4, 1] instead -> (34)*4 = 136;  t=5: forward [5] -> S=7: (30)*5 = 150
    #   t=6: fused 2, backward [2, 2], forward [4] -> S=4: (18)*6 = 108
    #   t=9: S=3: 14*9 = 126;  t=18 (everything fused): S=1: 6*18 = 108
    costs = uniform(6)
    plan = auto_partition(costs, num_workers=2, num_microbatches=4)
    assert plan.describe() == "F1[0:3] F2[3:5] | B1[5:6] | B2[4:5] B3[3:4] B4[2:3] B5[1:2] B6[0:1]"
    assert objective(plan, costs, num_workers=2, num_microbatches=4) == 102


def test_auto_partition_single_worker_fuses_everything() -> None:
    # N=1, M=1: the objective is S·t_max, and one fused stage (1·18) beats every split (t=3 -> 8·3).
    plan = auto_partition(uniform(6), num_workers=1, num_microbatches=1)
    assert plan.to_counts() == {"forward": [], "fused": 6, "backward": []}


def test_auto_partition_tie_prefers_fewer_stages() -> None:
    # All costs zero: every plan scores 0, so the fewest stages (one fused stage) wins.
    plan = auto_partition(uniform(5, f=0.0, b=0.0), num_workers=3, num_microbatches=4)
    assert plan.num_slots == 1


def test_auto_partition_matches_brute_force() -> None:
    """Guarantee: the returned plan minimises (objective, num_slots, t_max) over all valid plans.

    For a fixed t_max the greedy pass covers [0, fused.start) with the fewest stages and pushes
    fused.start as low as it can, and the optimum's t_max is one of the candidates, so the search is
    exact. Integer costs make ties (and the tie-break) common and compared without rounding.
    """
    rng = random.Random(1234)
    for trial in range(120):
        num_layers = rng.randint(2, 7)
        costs = [
            LayerCost(rng.randint(0, 3), rng.randint(0, 6), rng.randint(1, 5), rng.randint(1, 8))
            for _ in range(num_layers)
        ]
        n, m = rng.randint(1, 4), rng.randint(1, 8)
        budget = None if trial % 3 == 0 else float(rng.randint(6, 24))
        feasible = [p for p in all_plans(num_layers) if fits(p, costs, budget)]
        if not feasible:
            with pytest.raises(ValueError, match="no partition fits"):
                auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
            continue
        best = min(key(p, costs, n, m) for p in feasible)
        plan = auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
        assert fits(plan, costs, budget)
        assert key(plan, costs, n, m) == best, (trial, costs, n, m, budget, plan.describe())


def test_auto_partition_matches_brute_force_objective_with_float_costs() -> None:
    rng = random.Random(99)
    for _ in range(60):
        num_layers = rng.randint(2, 7)
        costs = [LayerCost(rng.random(), 2 * rng.random(), 1.0, 1.0) for _ in range(num_layers)]
        n, m = rng.randint(1, 4), rng.randint(1, 8)
        best = min(objective(p, costs, num_workers=n, num_microbatches=m) for p in all_plans(num_layers))
        plan = auto_partition(costs, num_workers=n, num_microbatches=m)
        assert objective(plan, costs, num_workers=n, num_microbatches=m) == pytest.approx(best, rel=1e-12)


def scan_partition(costs: list[LayerCost], n: int, m: int, budget: float | None) -> Plan | None:
    """The partitioner by its definition: one greedy pass, layer by layer, for every contiguous
    sum of forward or forward + backward costs; the least (objective, slots, t_max) wins."""
    fwd = [0.0]
    fb = [0.0]
    mem_f = [0.0]
    mem_b = [0.0]
    for c in costs:
        fwd.append(fwd[-1] + c.forward)
        fb.append(fb[-1] + (c.forward + c.backward))
        mem_f.append(mem_f[-1] + c.memory_forward)
        mem_b.append(mem_b[-1] + c.memory_backward)
    L = len(costs)

    def ok(forward: bool, lo: int, hi: int, t_max: float) -> bool:
        cost, mem = (fwd, mem_f) if forward else (fb, mem_b)
        return cost[hi] - cost[lo] <= t_max and (budget is None or mem[hi] - mem[lo] <= budget)

    best = None
    for t_max in sorted({p[j] - p[i] for p in (fwd, fb) for i in range(L) for j in range(i + 1, L + 1)}):
        if not ok(False, L - 1, L, t_max):
            continue
        boundary = L - 1
        while boundary > 0 and ok(False, boundary - 1, L, t_max):
            boundary -= 1
        backward, forward, top, bottom, blocked = [], [], boundary, 0, False
        while top > 0 and not blocked:
            start = top - 1
            blocked = not ok(False, start, top, t_max)
            while not blocked and start > 0 and ok(False, start - 1, top, t_max):
                start -= 1
            backward.append(top - start)
            top = start
        while bottom < boundary and not blocked:
            stop = bottom + 1
            blocked = not ok(True, bottom, stop, t_max)
            while not blocked and stop < boundary and ok(True, bottom, stop + 1, t_max):
                stop += 1
            forward.append(stop - bottom)
            bottom = stop
        if not blocked:
            plan = Plan.from_counts(L, forward=forward, fused=L - boundary, backward=backward)
            if best is None or key(plan, costs, n, m) < key(best, costs, n, m):
                best = plan
    return best


def test_auto_partition_is_the_scan_of_every_candidate_t_max() -> None:
    """Deep models, float costs, budgets that bind: the event walk finds the same plan as one
    greedy pass per candidate (or the same error)."""
    rng = random.Random(2024)
    for trial in range(40):
        num_layers = rng.randint(8, 40)
        if trial % 2:
            costs = [
                LayerCost(rng.random(), 2 * rng.random(), rng.random(), 3 * rng.random())
                for _ in range(num_layers)
            ]
        else:  # a model: embeddings, equal blocks, a heavy head
            f = rng.random()
            blocks = uniform(num_layers - 2, f, 2 * f, 1.5)
            costs = [LayerCost(0.0, 0.0, 2.0, 2.0), *blocks, LayerCost(3 * f, 6 * f, 4.0, 9.0)]
        n, m = rng.randint(1, 8), rng.randint(1, 32)
        budget = None if trial % 3 == 0 else rng.uniform(2.0, 30.0)
        expected = scan_partition(costs, n, m, budget)
        if expected is None:
            with pytest.raises(ValueError, match="no partition fits"):
                auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
            continue
        plan = auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
        assert plan == expected, (trial, plan.describe(), expected.describe())
        # no plan keeps fewer stage inputs than the one of the fewest stages
        fewest = fewest_stages(costs, memory_budget=budget)
        assert len(fewest.checkpoint_boundaries()) <= len(plan.checkpoint_boundaries())


def test_auto_partition_covers_every_layer_twice_within_budget() -> None:
    rng = random.Random(7)
    for num_layers in range(2, 13):
        for n in range(1, 5):
            for m in range(1, 9):
                costs = [
                    LayerCost(rng.uniform(0, 2), rng.uniform(0, 4), rng.uniform(1, 3), rng.uniform(2, 6))
                    for _ in range(num_layers)
                ]
                budget = rng.choice([None, 8.0, 12.0, 30.0])
                plan = auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
                validate_plan(plan)
                down = [layer for s in (*plan.forward, plan.fused) for layer in s.layers]
                up = [layer for s in (plan.fused, *plan.backward) for layer in s.layers]
                assert sorted(down) == list(range(num_layers))
                assert sorted(up) == list(range(num_layers))
                assert plan.fused.stop == num_layers
                if budget is not None:
                    assert all(stage_memory(s, costs) <= budget for s in plan.slots)


def test_auto_partition_respects_memory_budget() -> None:
    # 6 layers, f=1, b=2, 1 byte each, N=1, M=1: the objective is S·t_max. Unlimited memory: one fused
    # stage (1·18) wins. A budget of 2.5 bytes allows at most 2 layers per stage, leaving
    #   t=3: fused 1, backward 5×1, forward [2, 2, 1] -> 9·3 = 27
    #   t>=6: fused 2, backward [2, 2], forward [2, 2] -> 5·6 = 30
    costs = uniform(6)
    assert auto_partition(costs, num_workers=1, num_microbatches=1).num_slots == 1
    plan = auto_partition(costs, num_workers=1, num_microbatches=1, memory_budget=2.5)
    assert plan.to_counts() == {"forward": [2, 2, 1], "fused": 1, "backward": [1, 1, 1, 1, 1]}
    assert all(stage_memory(s, costs) <= 2.5 for s in plan.slots)


def test_auto_partition_infeasible_budget_names_layer_and_numbers() -> None:
    costs = [
        LayerCost(1, 2, 10, 20),
        LayerCost(1, 2, 10, 20),
        LayerCost(1, 2, 10, 500),
        LayerCost(1, 2, 10, 20),
    ]
    with pytest.raises(ValueError) as info:
        auto_partition(costs, num_workers=2, num_microbatches=4, memory_budget=400.0)
    assert str(info.value) == (
        "no partition fits memory_budget=400.0: layer 2 needs memory_backward=500 in a backward stage"
    )


def test_auto_partition_infeasible_output_layer() -> None:
    costs = [LayerCost(0, 0, 1, 1), LayerCost(1, 2, 1, 1), LayerCost(4, 8, 90.0, 95.5)]
    with pytest.raises(
        ValueError, match=r"memory_budget=64.0: layer 2 needs memory_backward=95.5 in a fused stage"
    ):
        auto_partition(costs, num_workers=1, num_microbatches=1, memory_budget=64.0)


def test_auto_partition_forward_memory_can_block() -> None:
    # Layer 1 fits a backward stage (50) but not a forward one (100), and cannot join the fused stage.
    costs = [LayerCost(1, 1, 1, 1), LayerCost(1, 1, 100, 40), LayerCost(1, 1, 1, 50)]
    with pytest.raises(ValueError, match=r"layer 1 needs memory_forward=100 in a forward stage"):
        auto_partition(costs, num_workers=2, num_microbatches=2, memory_budget=60)
    # At 95 the fused stage can take layer 1 (40 + 50), which is then the only place it fits.
    plan = auto_partition(costs, num_workers=2, num_microbatches=2, memory_budget=95)
    assert plan.fused.start <= 1


@pytest.mark.parametrize(
    ("costs", "kwargs", "message"),
    [
        (uniform(3), {"num_workers": 0, "num_microbatches": 1}, "num_workers=0 must be an integer >= 1"),
        (uniform(3), {"num_workers": 1, "num_microbatches": 0}, "num_microbatches=0 must be an integer >= 1"),
        (uniform(1), {"num_workers": 1, "num_microbatches": 1}, "costs has 1 layers, need at least 2"),
        (
            [LayerCost(1, 1, 1, 1), LayerCost(1, -2.5, 1, 1)],
            {"num_workers": 1, "num_microbatches": 1},
            "costs[1].backward=-2.5 must be finite and >= 0",
        ),
        (
            [LayerCost(float("nan"), 1, 1, 1), LayerCost(1, 1, 1, 1)],
            {"num_workers": 1, "num_microbatches": 1},
            "costs[0].forward=nan must be finite and >= 0",
        ),
        (
            [LayerCost(1, 1, 1, 1), LayerCost(1, 1, float("inf"), 1)],
            {"num_workers": 1, "num_microbatches": 1},
            "costs[1].memory_forward=inf must be finite and >= 0",
        ),
        (
            uniform(3),
            {"num_workers": 1, "num_microbatches": 1, "memory_budget": 0.0},
            "memory_budget=0.0 must be a positive number or None",
        ),
    ],
)
def test_auto_partition_rejects_bad_inputs(costs: list[LayerCost], kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        auto_partition(costs, **kwargs)
    assert message in str(info.value)


# --- search_partition: the simulated makespan as objective ---


def simulated(plan: Plan, costs: list[LayerCost], **kwargs: object) -> float:
    from engine.scheduling.simulate import simulate

    return simulate("roundpipe-sync", costs, plan=plan, **kwargs).makespan  # type: ignore[arg-type]


def test_search_partition_never_loses_to_the_closed_form_plan_or_a_seed() -> None:
    from engine.scheduling.partition_search import search_partition

    rng = random.Random(21)
    for trial in range(40):
        num_layers = rng.randint(2, 8)
        costs = [LayerCost(rng.randint(0, 3), rng.randint(0, 6), 1.0, 1.0) for _ in range(num_layers)]
        n, m = rng.randint(1, 4), rng.randint(1, 8)
        mode = rng.choice(["paper", "physical"])
        kw = {"num_workers": n, "num_microbatches": m, "hop": rng.choice([0.0, 0.5, 3.0]), "mode": mode}
        seed = next(p for p in all_plans(num_layers) if p.num_slots == min(3, 2 * num_layers - 1))
        plan = search_partition(costs, seeds=[seed], max_evaluations=60, **kw)
        validate_plan(plan)
        closed = auto_partition(costs, num_workers=n, num_microbatches=m)
        best = simulated(plan, costs, **kw)
        assert best <= simulated(closed, costs, **kw) + 1e-9, trial
        assert best <= simulated(seed, costs, **kw) + 1e-9, trial


def test_search_partition_beats_the_closed_form_when_hops_are_slow() -> None:
    from engine.scheduling.partition_search import search_partition
    from engine.scheduling.simulate import uniform_costs

    # 8 blocks (forward 1, backward 2), N=4, M=8: the closed form picks 12 slots, blind to the hop.
    costs = uniform_costs(8, fwd=1.0, bwd=2.0, head_fwd=1.0, head_bwd=2.0)
    kw = {"num_workers": 4, "num_microbatches": 8, "mode": "physical"}
    closed = auto_partition(costs, num_workers=4, num_microbatches=8)
    assert closed.num_slots == 12
    plan = search_partition(costs, hop=5.0, **kw)
    assert plan.num_slots < closed.num_slots
    assert simulated(plan, costs, hop=5.0, **kw) < 0.7 * simulated(closed, costs, hop=5.0, **kw)
    # without a hop the closed-form plan is already as good as anything the search finds
    assert simulated(search_partition(costs, **kw), costs, **kw) == simulated(closed, costs, **kw)


def test_search_partition_accounts_for_weight_uploads() -> None:
    from engine.scheduling.partition_search import search_partition
    from engine.scheduling.simulate import uniform_costs

    costs = uniform_costs(8, fwd=1.0, bwd=2.0, head_fwd=1.0, head_bwd=2.0)
    param_bytes = [0.0] + [10.0] * 8 + [20.0]
    kw = {"num_workers": 4, "num_microbatches": 8, "hop": 0.5, "mode": "physical"}
    blind = search_partition(costs, **kw)
    aware = search_partition(costs, param_bytes=param_bytes, bandwidth=1.0, **kw)
    uploads = {"param_bytes": param_bytes, "bandwidth": 1.0}
    assert simulated(aware, costs, **uploads, **kw) < simulated(blind, costs, **uploads, **kw)


def test_search_partition_respects_the_memory_budget() -> None:
    from engine.scheduling.partition_search import search_partition

    rng = random.Random(8)
    for _ in range(15):
        num_layers = rng.randint(3, 9)
        costs = [
            LayerCost(rng.uniform(0, 2), rng.uniform(0, 4), rng.uniform(1, 3), rng.uniform(2, 6))
            for _ in range(num_layers)
        ]
        budget = rng.choice([8.0, 12.0])
        plan = search_partition(
            costs, num_workers=2, num_microbatches=4, hop=0.1, memory_budget=budget, max_evaluations=80
        )
        assert all(stage_memory(s, costs) <= budget for s in plan.slots)
    with pytest.raises(ValueError, match=r"no partition fits memory_budget=1\.0"):
        search_partition(uniform(4, mem=2.0), num_workers=2, num_microbatches=2, memory_budget=1.0)


def test_search_partition_is_deterministic_and_bounded() -> None:
    from engine.scheduling.partition_search import search_partition
    from engine.scheduling.simulate import uniform_costs

    costs = uniform_costs(12, fwd=1.0, bwd=2.5, head_fwd=2.0, head_bwd=3.0)
    kw = {"num_workers": 4, "num_microbatches": 8, "hop": 0.3}
    assert search_partition(costs, **kw) == search_partition(costs, **kw)
    # one evaluation: the closed-form plan itself
    assert search_partition(costs, max_evaluations=1, **kw) == auto_partition(
        costs, num_workers=4, num_microbatches=8
    )
    steady = search_partition(costs, objective="steady", max_evaluations=40, **kw)
    validate_plan(steady)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "fastest"}, "objective='fastest' must be one of"),
        ({"max_evaluations": 0}, "max_evaluations=0 must be an integer >= 1"),
        (
            {"seeds": [Plan.from_counts(3, forward=[2], fused=1, backward=[2])]},
            "seeds[0].num_layers=3 does not match",
        ),
        ({"mode": "dream"}, "mode='dream' must be one of"),
        ({"num_workers": 0}, "num_workers=0 must be an integer >= 1"),
    ],
)
def test_search_partition_rejects_bad_inputs(kwargs: dict, message: str) -> None:
    from engine.scheduling.partition_search import search_partition

    args = {"num_workers": 2, "num_microbatches": 2, **kwargs}
    with pytest.raises(ValueError) as info:
        search_partition(uniform(4), **args)
    assert message in str(info.value)
