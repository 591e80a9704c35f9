"""Tests for engine.scheduling.simulate (with its event core and the stage-bound orders)."""

import random
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from engine.scheduling.baselines import bound_orders
from engine.scheduling.partition import LayerCost, Plan
from engine.scheduling.simulate import (
    SCHEDULES,
    closed_form_bubble,
    layers_from_blocks,
    plan_from_blocks,
    simulate,
    timeline_svg,
    uniform_costs,
)
from engine.scheduling.timeline import Op, Timeline

# input (free), one block (forward 2, backward 3), output layer (forward 1, backward 2)
TWO_STAGE_COSTS = [LayerCost(0, 0, 0, 0), LayerCost(2, 3, 0, 0), LayerCost(1, 2, 0, 0)]
HOP = 0.5


def spans(result) -> dict:
    """{op key: (start, main start, end)} of the compute ops."""
    return {t.op.key: (t.start, t.main_start, t.end) for t in result.ops if t.op.lane == "compute"}


def random_plan(rng: random.Random, num_layers: int) -> Plan:
    fused = rng.randint(1, num_layers)
    rest = num_layers - fused

    def split(total: int) -> list[int]:
        out = []
        while total:
            part = rng.randint(1, total)
            out.append(part)
            total -= part
        return out

    return Plan.from_counts(num_layers, forward=split(rest), fused=fused, backward=split(rest))


def random_costs(rng: random.Random, num_layers: int) -> list[LayerCost]:
    return [LayerCost(rng.choice([0, 1, 2, 3]), rng.choice([0, 2, 4, 5]), 0, 0) for _ in range(num_layers)]


# --- exact timelines: 2 workers, 2 stages, hop 0.5 ---


def test_gpipe_two_stages_by_hand() -> None:
    # Stage 0 = input + block (forward 2, backward = recompute 2 + 3), stage 1 = output layer (1, 2).
    r = simulate(
        "gpipe", TWO_STAGE_COSTS, num_workers=2, num_microbatches=2, hop=HOP, stages=[2, 1], mode="paper"
    )
    assert spans(r) == {
        ("F", 0, 0): (0, 0, 2),
        ("F", 0, 1): (2, 2, 4),
        ("F", 1, 0): (2.5, 2.5, 3.5),
        ("F", 1, 1): (4.5, 4.5, 5.5),
        ("B", 1, 0): (5.5, 5.5, 7.5),
        ("B", 1, 1): (7.5, 7.5, 9.5),
        ("B", 0, 0): (8, 8, 13),
        ("B", 0, 1): (13, 13, 18),
    }
    assert r.makespan == 18
    assert r.busy == (14, 6)
    assert r.idle == (4, 12)
    assert r.bubble == pytest.approx(16 / 36)
    assert r.fill == (0, 2.5)
    assert r.drain == (0, 8.5)


def test_1f1b_two_stages_by_hand() -> None:
    r = simulate("1f1b", TWO_STAGE_COSTS, num_workers=2, num_microbatches=2, hop=HOP, stages=[2, 1])
    assert spans(r) == {
        ("F", 0, 0): (0, 0, 2),
        ("F", 0, 1): (2, 2, 4),
        ("B", 0, 0): (6, 6, 11),
        ("B", 0, 1): (11, 11, 16),
        ("F", 1, 0): (2.5, 2.5, 3.5),
        ("B", 1, 0): (3.5, 3.5, 5.5),
        ("F", 1, 1): (5.5, 5.5, 6.5),
        ("B", 1, 1): (6.5, 6.5, 8.5),
    }
    assert r.makespan == 16
    assert r.bubble == pytest.approx((32 - 20) / 32)


def test_looped_bfs_and_interleaved_two_gpus_four_stages_by_hand() -> None:
    # Four stages of one layer each (forward 1, backward 1 + 1), M = 2, no hop: stage s on GPU s mod 2.
    costs = [LayerCost(1, 1, 0, 0)] * 3 + [LayerCost(1, 2, 0, 0)]
    looped = simulate("looped-bfs", costs, num_workers=2, num_microbatches=2, stages=[1, 1, 1, 1])
    assert [(t.op.worker, t.op.key, t.start, t.end) for t in looped.ops if t.op.worker == 0] == [
        (0, ("F", 0, 0), 0, 1),
        (0, ("F", 0, 1), 1, 2),
        (0, ("F", 2, 0), 2, 3),
        (0, ("F", 2, 1), 3, 4),
        (0, ("B", 2, 1), 7, 9),
        (0, ("B", 2, 0), 9, 11),
        (0, ("B", 0, 1), 11, 13),
        (0, ("B", 0, 0), 13, 15),
    ]
    assert looped.makespan == 15
    assert bound_orders("interleaved-1f1b", num_workers=2, num_microbatches=2, stages_per_worker=2) == [
        [
            ("F", 0, 0),
            ("F", 0, 1),
            ("F", 2, 0),
            ("F", 2, 1),
            ("B", 2, 0),
            ("B", 2, 1),
            ("B", 0, 0),
            ("B", 0, 1),
        ],
        [
            ("F", 1, 0),
            ("F", 1, 1),
            ("F", 3, 0),
            ("B", 3, 0),
            ("F", 3, 1),
            ("B", 3, 1),
            ("B", 1, 0),
            ("B", 1, 1),
        ],
    ]


def test_bound_orders_1f1b_and_interleaved_literally() -> None:
    assert bound_orders("1f1b", num_workers=2, num_microbatches=3, stages_per_worker=1) == [
        [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)],
        [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)],
    ]
    # N=2, M=4: R=2 rounds of P=2; W_1 = min((2-1)*2 + 0, 8) = 2
    order = bound_orders("interleaved-1f1b", num_workers=2, num_microbatches=4, stages_per_worker=2)[1]
    assert order[:6] == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1)]
    assert len(order) == 16


ROUNDPIPE_COSTS = [LayerCost(0, 0, 0, 0), LayerCost(1, 2, 0, 0), LayerCost(1, 2, 0, 0), LayerCost(1, 1, 0, 0)]
# F1 = input + block 1 (forward 1) | B1 = block 2 + output layer |
# B2 = block 1 + input (recompute 1, backward 2)
ROUNDPIPE_PLAN = Plan.from_counts(4, forward=[2], fused=2, backward=[2])


def test_roundpipe_sync_paper_mode_by_hand() -> None:
    # Fused: pre = head forward 1, main = block 2 forward + backward 3 + head backward 1 = 4.
    r = simulate(
        "roundpipe-sync", ROUNDPIPE_COSTS, num_workers=2, num_microbatches=2, hop=HOP, plan=ROUNDPIPE_PLAN
    )
    assert spans(r) == {
        (0, 0, 0, 0): (0, 0, 1),
        (0, 0, 0, 1): (1, 1, 2),
        # the head forward runs before F1's output arrives (at 1.5): paper pre-work
        (0, 0, 1, 0): (0.5, 1.5, 5.5),
        (0, 0, 1, 1): (5.5, 6.5, 10.5),
        # recompute placed to end when the gradient arrives (5.5 + hop)
        (0, 0, 2, 0): (5, 6, 8),
        (0, 0, 2, 1): (10, 11, 13),
    }
    assert {t.op.key: t.op.worker for t in r.ops} == {
        (0, 0, 0, 0): 0,
        (0, 0, 0, 1): 0,
        (0, 0, 1, 0): 1,
        (0, 0, 1, 1): 1,
        (0, 0, 2, 0): 0,
        (0, 0, 2, 1): 0,
    }
    assert r.makespan == 13
    assert r.busy == (8, 10)
    assert r.bubble == pytest.approx(8 / 26)
    assert r.fill == (0, 0.5)
    assert r.drain == (0, 2.5)
    asynchronous = simulate(
        "roundpipe-async", ROUNDPIPE_COSTS, num_workers=2, num_microbatches=2, hop=HOP, plan=ROUNDPIPE_PLAN
    )
    assert asynchronous.makespan == 13
    assert asynchronous.bubble == pytest.approx((8 - 0.5 - 2.5) / 26)


def test_roundpipe_sync_physical_mode_by_hand() -> None:
    # The head forward now waits for F1's output: 1 + hop.
    r = simulate(
        "roundpipe-sync",
        ROUNDPIPE_COSTS,
        num_workers=2,
        num_microbatches=2,
        hop=HOP,
        plan=ROUNDPIPE_PLAN,
        mode="physical",
    )
    assert spans(r) == {
        (0, 0, 0, 0): (0, 0, 1),
        (0, 0, 0, 1): (1, 1, 2),
        (0, 0, 1, 0): (1.5, 2.5, 6.5),
        (0, 0, 1, 1): (6.5, 7.5, 11.5),
        (0, 0, 2, 0): (6, 7, 9),
        (0, 0, 2, 1): (11, 12, 14),
    }
    assert r.makespan == 14


def test_physical_prework_waits_for_its_inputs() -> None:
    # forward [F1 = layers 0-1, F2 = layer 2], fused = output layer, backward [B2 = layer 2, B3 = 0-1]
    costs = [LayerCost(0, 0, 0, 0), LayerCost(1, 1, 0, 0), LayerCost(1, 1, 0, 0), LayerCost(1, 1, 0, 0)]
    plan = Plan.from_counts(4, forward=[2, 1], fused=1, backward=[1, 2])
    runs = {
        mode: simulate(
            "roundpipe-sync", costs, num_workers=2, num_microbatches=1, hop=10.0, plan=plan, mode=mode
        )
        for mode in ("paper", "physical")
    }
    pre_deps = {mode: {t.op.key: t.op.pre_deps for t in r.ops} for mode, r in runs.items()}
    assert all(deps == () for deps in pre_deps["paper"].values())
    # the head forward waits for F2's output, B2's recompute for its input (F1's output);
    # B3's input is the batch itself
    assert pre_deps["physical"] == {
        (0, 0, 0, 0): (),
        (0, 0, 1, 0): (),
        (0, 0, 2, 0): ((0, 0, 1, 0),),
        (0, 0, 3, 0): ((0, 0, 0, 0),),
        (0, 0, 4, 0): (),
    }
    assert runs["physical"].makespan >= runs["paper"].makespan


def test_timeline_pre_part_and_hops() -> None:
    tl = Timeline(num_workers=2, hop=1.0)
    tl.add(
        [
            Op("a", 0, main=2.0),
            Op("b", 1, main=1.0, pre=3.0, deps=("a",)),  # pre-work runs before a's output arrives
            Op("c", 1, main=1.0, pre=1.0, pre_deps=("a",)),  # pre-part gated: a ends 2, +hop, +pre
            Op("d", 0, main=1.0, deps=("c",)),
        ]
    )
    got = {k: (t.start, t.main_start, t.end) for k, t in tl.times.items()}
    assert got == {"a": (0, 0, 2), "b": (0, 3, 4), "c": (4, 5, 6), "d": (7, 7, 8)}


def test_timeline_deadlock_and_bad_ops() -> None:
    tl = Timeline(num_workers=2, hop=0.0)
    with pytest.raises(ValueError, match=r"deadlock: workers wait forever at ops \['x', 'y'\]"):
        tl.add([Op("x", 0, 1.0, deps=("y",)), Op("y", 1, 1.0, deps=("x",))])
    with pytest.raises(ValueError, match="op 'z' depends on 'w', which no op provides"):
        Timeline(num_workers=1, hop=0.0).add([Op("z", 0, 1.0, deps=("w",))])
    with pytest.raises(ValueError, match="op key 'k' appears twice"):
        Timeline(num_workers=1, hop=0.0).add([Op("k", 0, 1.0), Op("k", 0, 1.0)])
    with pytest.raises(ValueError, match=r"op 'k' has worker=3, outside \[0, 2\)"):
        Timeline(num_workers=2, hop=0.0).add([Op("k", 3, 1.0)])
    with pytest.raises(ValueError, match=r"op 'k' has main=-1\.0, must be finite and >= 0"):
        Timeline(num_workers=2, hop=0.0).add([Op("k", 0, -1.0)])
    with pytest.raises(ValueError, match="hop=-1 must be a finite number >= 0"):
        Timeline(num_workers=2, hop=-1)


# --- closed form ---


@pytest.mark.parametrize(("n", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)])
def test_balanced_slots_without_hop_match_the_closed_form(n: int, m: int) -> None:
    # 12 blocks (forward 1, backward 2) and an output layer costing 1 + 2: four forward stages of three
    # blocks, the fused stage holding the output layer and twelve one-block backward stages all cost 3.
    costs = uniform_costs(12, fwd=1.0, bwd=2.0, head_fwd=1.0, head_bwd=2.0)
    plan = plan_from_blocks(12, forward=[3, 3, 3, 3], backward=[0] + [1] * 12)
    assert plan.num_slots == 17
    r = simulate("roundpipe-sync", costs, num_workers=n, num_microbatches=m, plan=plan)
    assert r.bubble == pytest.approx(
        closed_form_bubble(num_workers=n, num_microbatches=m, num_slots=17), abs=1e-12
    )
    asynchronous = simulate("roundpipe-async", costs, num_workers=n, num_microbatches=m, plan=plan)
    assert 0 <= asynchronous.bubble < r.bubble
    if (n, m) == (8, 16):  # a one-unit gap on four workers at the round boundary
        assert asynchronous.bubble == pytest.approx(4 / (8 * r.makespan))
    steady = simulate("roundpipe-async-steady", costs, num_workers=n, num_microbatches=m, plan=plan)
    assert steady.makespan < r.makespan
    assert 0 <= steady.bubble < r.bubble


def test_closed_form_values_and_validation() -> None:
    assert closed_form_bubble(num_workers=8, num_microbatches=16, num_slots=15) == pytest.approx(56 / 296)
    assert closed_form_bubble(num_workers=1, num_microbatches=4, num_slots=3) == 0
    with pytest.raises(ValueError, match="num_slots=0 must be an integer >= 1"):
        closed_form_bubble(num_workers=2, num_microbatches=2, num_slots=0)


# --- every schedule finishes ---


def test_no_schedule_deadlocks_for_n_up_to_8_and_m_up_to_32() -> None:
    rng = random.Random(5)
    for n in range(1, 9):
        for m in range(1, 33):
            num_layers = rng.randint(2, 7)
            costs = random_costs(rng, num_layers)
            hop = rng.choice([0.0, 0.5])
            for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
                v = 1 if schedule in ("gpipe", "1f1b") else rng.randint(1, 3)
                stages = [0] * (v * n)
                for layer in range(num_layers):
                    stages[min(layer * v * n // num_layers, v * n - 1)] += 1
                rounds = max(1, m // n)
                invalid = (schedule == "1f1b" and m < n) or (schedule == "interleaved-1f1b" and m % rounds)
                if invalid:
                    with pytest.raises(ValueError, match=f"num_microbatches={m}"):
                        simulate(schedule, costs, num_workers=n, num_microbatches=m, stages=stages, hop=hop)
                    continue
                r = simulate(schedule, costs, num_workers=n, num_microbatches=m, stages=stages, hop=hop)
                assert len(r.ops) == 2 * v * n * m, (schedule, n, m)
                assert r.makespan >= 0 and all(i >= -1e-9 for i in r.idle)
            plan = random_plan(rng, num_layers)
            for mode in ("paper", "physical"):
                r = simulate(
                    "roundpipe-sync", costs, num_workers=n, num_microbatches=m, plan=plan, hop=hop, mode=mode
                )
                assert len(r.ops) == plan.num_slots * m, (n, m, mode)
                assert r.bubble <= 1


def test_steady_state_chains_iterations() -> None:
    rng = random.Random(11)
    for _ in range(20):
        n, m = rng.randint(1, 8), rng.randint(1, 32)
        costs = random_costs(rng, 5)
        plan = random_plan(rng, 5)
        r = simulate("roundpipe-async-steady", costs, num_workers=n, num_microbatches=m, plan=plan, hop=0.25)
        assert len(r.ops) == 8 * plan.num_slots * m
        assert 0 <= r.bubble <= 1
        assert r.fill == r.drain == (0.0,) * n


def test_physical_is_never_faster_than_paper_with_the_same_rotation() -> None:
    rng = random.Random(3)
    for _ in range(150):
        n, m = rng.randint(1, 6), rng.randint(1, 12)
        num_layers = rng.randint(2, 7)
        costs = random_costs(rng, num_layers)
        plan = random_plan(rng, num_layers)
        hop = rng.choice([0.0, 0.5, 2.0])
        kw = {"num_workers": n, "num_microbatches": m, "plan": plan, "hop": hop, "rotation": "fixed"}
        paper = simulate("roundpipe-sync", costs, mode="paper", **kw)
        physical = simulate("roundpipe-sync", costs, mode="physical", **kw)
        assert physical.makespan >= paper.makespan - 1e-9
        uploads = simulate(
            "roundpipe-sync",
            costs,
            mode="physical",
            param_bytes=[rng.choice([0.0, 4.0, 40.0]) for _ in range(num_layers)],
            bandwidth=2.0,
            **kw,
        )
        assert uploads.makespan >= physical.makespan - 1e-9
        assert len([t for t in uploads.ops if t.op.lane == "upload"]) == plan.num_slots * len(range(0, m, n))


def test_bound_schedules_are_the_same_in_both_modes() -> None:
    costs = uniform_costs(6, fwd=1.0, bwd=2.0, head_fwd=3.0, head_bwd=4.0)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        stages = layers_from_blocks([3, 3] if schedule in ("gpipe", "1f1b") else [1, 2, 2, 1])
        a, b = (
            simulate(schedule, costs, num_workers=2, num_microbatches=4, stages=stages, hop=0.5, mode=mode)
            for mode in ("paper", "physical")
        )
        assert (a.makespan, a.busy) == (b.makespan, b.busy)


def test_slow_uploads_stretch_the_iteration() -> None:
    costs = uniform_costs(4, fwd=1.0, bwd=2.0, head_fwd=1.0, head_bwd=1.0)
    plan = plan_from_blocks(4, forward=[2, 2], backward=[0, 2, 2])
    kw = {"num_workers": 2, "num_microbatches": 2, "plan": plan, "mode": "physical"}
    base = simulate("roundpipe-sync", costs, **kw)
    # one byte per layer, one byte per time unit: each stage's upload takes as long as its layers
    slow = simulate("roundpipe-sync", costs, param_bytes=[1.0] * 6, bandwidth=1.0, **kw)
    first = {t.op.key: t for t in slow.ops if t.op.lane == "upload"}
    assert first[("upload", 0, 0, 0)].end == 3  # F1 holds the input layer and two blocks
    assert min(t.start for t in slow.ops if t.op.key == (0, 0, 0, 0)) == 3
    assert slow.makespan > base.makespan


def test_empty_stage_forwards_its_hop_but_adds_no_time() -> None:
    costs = uniform_costs(2, fwd=1.0, bwd=1.0, head_fwd=1.0, head_bwd=1.0)
    # Stage 0 holds only the (free) input layer: its forward is empty but stage 1 still waits a hop.
    r = simulate("gpipe", costs, num_workers=2, num_microbatches=1, stages=[1, 3], hop=5.0)
    times = spans(r)
    assert times[("F", 1, 0)][0] == 5
    assert r.busy[0] == 0 and r.fill[0] == r.makespan
    # the empty backward of stage 0 ends a hop after stage 1's: it does not extend the makespan
    assert r.makespan == times[("B", 1, 0)][2]


# --- conversions and pictures ---


def test_plan_and_stage_conversions_from_blocks() -> None:
    plan = plan_from_blocks(6, forward=[3, 3], backward=[0, 2, 2, 2])
    assert plan.to_counts() == {"forward": [4, 3], "fused": 1, "backward": [2, 2, 3]}
    assert plan_from_blocks(6, forward=[2, 3], backward=[1, 2, 3]).to_counts() == {
        "forward": [3, 3],
        "fused": 2,
        "backward": [2, 4],
    }
    assert plan_from_blocks(3, forward=[], backward=[3]).to_counts() == {
        "forward": [],
        "fused": 5,
        "backward": [],
    }
    assert layers_from_blocks([2, 0, 3]) == [3, 0, 4]
    with pytest.raises(ValueError, match="blocks\\[1\\]=-1 must be an integer >= 0"):
        layers_from_blocks([1, -1])
    with pytest.raises(ValueError, match="backward=\\[2\\] must be \\[3\\]"):
        plan_from_blocks(3, forward=[], backward=[2])


def test_timeline_svg_is_well_formed() -> None:
    r = simulate(
        "roundpipe-sync", ROUNDPIPE_COSTS, num_workers=2, num_microbatches=2, hop=HOP, plan=ROUNDPIPE_PLAN
    )
    svg = timeline_svg(r, title="small <case>")
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    titles = [el.text for el in root.iter() if el.tag.endswith("title")]
    # F1 x2, fused pre + main x2, B2 recompute + backward x2
    assert len(titles) == 10
    assert "small &lt;case&gt;" in svg
    with pytest.raises(ValueError, match="width=10 must be an integer >= 200"):
        timeline_svg(r, width=10)


# --- validation ---

COSTS = uniform_costs(2, fwd=1.0, bwd=1.0, head_fwd=1.0, head_bwd=1.0)
PLAN = plan_from_blocks(2, forward=[1, 1], backward=[0, 1, 1])


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        ("zigzag", {"plan": PLAN}, "schedule='zigzag' must be one of"),
        (
            "roundpipe-sync",
            {"plan": PLAN, "mode": "fast"},
            "mode='fast' must be one of ('paper', 'physical')",
        ),
        ("roundpipe-sync", {"plan": PLAN, "num_workers": 0}, "num_workers=0 must be an integer >= 1"),
        (
            "roundpipe-sync",
            {"plan": PLAN, "num_microbatches": 0},
            "num_microbatches=0 must be an integer >= 1",
        ),
        ("roundpipe-sync", {"plan": PLAN, "hop": -1.0}, "hop=-1.0 must be a finite number >= 0"),
        ("roundpipe-sync", {}, "plan (a RoundPipe partition) is required for 'roundpipe-sync'"),
        ("roundpipe-sync", {"plan": PLAN, "stages": [4]}, "stages apply to stage-bound schedules"),
        ("gpipe", {"plan": PLAN}, "plan applies to RoundPipe schedules, not to 'gpipe'"),
        ("gpipe", {}, "stages (layers per stage) are required for 'gpipe'"),
        ("gpipe", {"stages": [1, 2]}, "stages [1, 2] sum to 3, expected len(costs)=4"),
        ("gpipe", {"stages": [4]}, "len(stages)=1 must be a positive multiple of num_workers=2"),
        ("gpipe", {"stages": [5, -1]}, "stages[1]=-1 must be an integer >= 0"),
        ("gpipe", {"stages": [2, 2, 0, 0]}, "stages_per_worker=2 must be 1 for gpipe"),
        ("1f1b", {"stages": [2, 2], "num_microbatches": 1}, "num_microbatches=1 must be >= num_workers=2"),
        (
            "interleaved-1f1b",
            {"stages": [1, 1, 1, 1], "num_microbatches": 5},
            "num_microbatches=5 must be divisible by max(1, num_microbatches // num_workers)=2",
        ),
        (
            "roundpipe-sync",
            {"plan": PLAN, "round_size": 3},
            "round_size=3: paper mode runs rounds of exactly",
        ),
        (
            "roundpipe-sync",
            {"plan": PLAN, "mode": "physical", "round_size": 1},
            "round_size=1 must be >= num_workers=2",
        ),
        ("roundpipe-sync", {"plan": PLAN, "rotation": "random"}, "rotation='random' must be one of"),
        ("roundpipe-sync", {"plan": PLAN, "bandwidth": 1.0}, "param_bytes and bandwidth go together"),
        (
            "roundpipe-sync",
            {"plan": PLAN, "param_bytes": [1.0] * 4, "bandwidth": 1.0},
            "paper mode models no weight traffic",
        ),
        (
            "roundpipe-sync",
            {"plan": PLAN, "mode": "physical", "param_bytes": [1.0] * 4, "bandwidth": 0.0},
            "bandwidth=0.0 must be a finite number > 0",
        ),
        (
            "roundpipe-sync",
            {"plan": PLAN, "mode": "physical", "param_bytes": [1.0] * 3, "bandwidth": 1.0},
            "len(param_bytes)=3 does not match len(costs)=4",
        ),
        (
            "roundpipe-sync",
            {"plan": PLAN, "mode": "physical", "param_bytes": [1.0, -1.0, 1.0, 1.0], "bandwidth": 1.0},
            "param_bytes[1]=-1.0 must be finite and >= 0",
        ),
        (
            "roundpipe-sync",
            {"plan": Plan.from_counts(3, forward=[2], fused=1, backward=[2])},
            "plan.num_layers=3 does not match len(costs)=4",
        ),
    ],
)
def test_simulate_rejects_bad_inputs(schedule: str, kwargs: dict, message: str) -> None:
    args = {"num_workers": 2, "num_microbatches": 2, **kwargs}
    with pytest.raises(ValueError) as info:
        simulate(schedule, COSTS, **args)
    assert message in str(info.value)


def test_simulate_rejects_bad_costs() -> None:
    with pytest.raises(ValueError, match="costs has 1 layers, need at least 2"):
        simulate("roundpipe-sync", COSTS[:1], num_workers=1, num_microbatches=1, plan=PLAN)
    bad = [*COSTS[:3], LayerCost(1.0, float("nan"), 0, 0)]
    with pytest.raises(ValueError, match=r"costs\[3\].backward=nan must be finite and >= 0"):
        simulate("roundpipe-sync", bad, num_workers=1, num_microbatches=1, plan=PLAN)
    with pytest.raises(ValueError, match=r"fwd=-1\.0 must be finite and >= 0"):
        uniform_costs(2, fwd=-1.0, bwd=1.0, head_fwd=1.0, head_bwd=1.0)


def test_simulator_imports_no_torch() -> None:
    code = "import sys, engine.scheduling.simulate, engine.scheduling.partition_search; "
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_schedules_listed() -> None:
    assert SCHEDULES == (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "roundpipe-sync",
        "roundpipe-async",
        "roundpipe-async-steady",
    )
