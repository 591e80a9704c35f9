"""Tests for engine.scheduling.schedule: round-robin dispatch, unit timelines and the grid."""

import itertools
from fractions import Fraction

import pytest

from engine.scheduling.schedule import (
    SlotRun,
    build_schedule,
    render_grid,
    split_rounds,
    unit_timeline,
    worker_queues,
)

KINDS_3 = ["forward", "fused", "backward"]


def kinds_for(num_slots: int, fused: int) -> list[str]:
    return ["forward"] * fused + ["fused"] + ["backward"] * (num_slots - fused - 1)


def test_split_rounds() -> None:
    assert split_rounds(5, 2) == [(0, 1), (2, 3), (4,)]
    assert split_rounds(4, 4) == [(0, 1, 2, 3)]
    assert split_rounds(3, 8) == [(0, 1, 2)]
    with pytest.raises(ValueError, match="round_size=0 must be an integer >= 1"):
        split_rounds(4, 0)
    with pytest.raises(ValueError, match="num_microbatches=0 must be an integer >= 1"):
        split_rounds(0, 2)


def test_build_schedule_small_case_literally() -> None:
    runs, next_worker = build_schedule(
        num_slots=3, num_workers=2, num_microbatches=4, round_size=2, iteration=0, start_worker=0
    )
    assert runs == [
        SlotRun(iteration=0, round=0, slot=0, worker=0, microbatches=(0, 1)),
        SlotRun(iteration=0, round=0, slot=1, worker=1, microbatches=(0, 1)),
        SlotRun(iteration=0, round=0, slot=2, worker=0, microbatches=(0, 1)),
        # round 1 starts at (0 + 3) mod 2 = 1
        SlotRun(iteration=0, round=1, slot=0, worker=1, microbatches=(2, 3)),
        SlotRun(iteration=0, round=1, slot=1, worker=0, microbatches=(2, 3)),
        SlotRun(iteration=0, round=1, slot=2, worker=1, microbatches=(2, 3)),
    ]
    assert next_worker == 0  # (1 + 3) mod 2


def test_build_schedule_last_round_shorter_and_start_worker() -> None:
    runs, next_worker = build_schedule(
        num_slots=2, num_workers=3, num_microbatches=5, round_size=3, iteration=4, start_worker=2
    )
    assert runs == [
        SlotRun(4, 0, 0, 2, (0, 1, 2)),
        SlotRun(4, 0, 1, 0, (0, 1, 2)),
        SlotRun(4, 1, 0, 1, (3, 4)),
        SlotRun(4, 1, 1, 2, (3, 4)),
    ]
    assert next_worker == 0


def test_rotation_continues_across_rounds_and_iterations() -> None:
    # S=3, N=4: each round advances the start worker by 3 (mod 4): 0, 3, 2, 1, 0, ...
    first, g1 = build_schedule(
        num_slots=3, num_workers=4, num_microbatches=8, round_size=4, iteration=0, start_worker=0
    )
    second, g2 = build_schedule(
        num_slots=3, num_workers=4, num_microbatches=8, round_size=4, iteration=1, start_worker=g1
    )
    assert (g1, g2) == (2, 0)
    assert [r.worker for r in first] == [0, 1, 2, 3, 0, 1]
    assert [r.worker for r in second] == [2, 3, 0, 1, 2, 3]
    assert [(r.iteration, r.round) for r in second] == [(1, 0)] * 3 + [(1, 1)] * 3
    # No flush: two iterations dispatch onto exactly the workers one long iteration would.
    one, g_one = build_schedule(
        num_slots=3, num_workers=4, num_microbatches=16, round_size=4, iteration=0, start_worker=0
    )
    assert [r.worker for r in one] == [r.worker for r in first + second]
    assert g_one == g2


def test_slot_worker_rule_holds_generally() -> None:
    for num_slots, num_workers, num_microbatches in itertools.product(range(1, 7), range(1, 5), range(1, 9)):
        round_size = num_workers if num_microbatches >= num_workers else None
        g0 = num_workers - 1
        runs, nxt = build_schedule(
            num_slots=num_slots,
            num_workers=num_workers,
            num_microbatches=num_microbatches,
            round_size=round_size,
            iteration=0,
            start_worker=g0,
        )
        rounds = split_rounds(num_microbatches, round_size or num_microbatches)
        assert [(r.round, r.slot) for r in runs] == [
            (k, i) for k in range(len(rounds)) for i in range(num_slots)
        ]
        for run in runs:
            assert run.microbatches == rounds[run.round]
            assert run.worker == (g0 + run.round * num_slots + run.slot) % num_workers
        assert nxt == (g0 + len(rounds) * num_slots) % num_workers


def test_round_size_none_is_one_round_even_below_num_workers() -> None:
    runs, nxt = build_schedule(
        num_slots=3, num_workers=4, num_microbatches=2, round_size=None, iteration=0, start_worker=1
    )
    assert runs == [SlotRun(0, 0, 0, 1, (0, 1)), SlotRun(0, 0, 1, 2, (0, 1)), SlotRun(0, 0, 2, 3, (0, 1))]
    assert nxt == 0
    # An explicit round size covering all micro-batches is allowed too.
    same, _ = build_schedule(
        num_slots=3, num_workers=4, num_microbatches=2, round_size=2, iteration=0, start_worker=1
    )
    assert same == runs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_slots": 3, "num_workers": 4, "num_microbatches": 8, "round_size": 2},
            "round_size=2 must be >= num_workers=4 (or cover all num_microbatches=8 in one round)",
        ),
        ({"num_slots": 0, "num_workers": 2, "num_microbatches": 2, "round_size": 2}, "num_slots=0"),
        ({"num_slots": 1, "num_workers": 0, "num_microbatches": 2, "round_size": 2}, "num_workers=0"),
        ({"num_slots": 1, "num_workers": 2, "num_microbatches": 0, "round_size": 2}, "num_microbatches=0"),
        ({"num_slots": 1, "num_workers": 2, "num_microbatches": 2, "round_size": 0}, "round_size=0"),
        (
            {"num_slots": 1, "num_workers": 2, "num_microbatches": 2, "round_size": 2, "start_worker": 2},
            "start_worker=2 must be < num_workers=2",
        ),
        (
            {"num_slots": 1, "num_workers": 2, "num_microbatches": 2, "round_size": 2, "iteration": -1},
            "iteration=-1 must be an integer >= 0",
        ),
    ],
)
def test_build_schedule_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"iteration": 0, "start_worker": 0, **kwargs}
    with pytest.raises(ValueError) as info:
        build_schedule(**args)
    assert message in str(info.value)


def test_worker_queues() -> None:
    runs, _ = build_schedule(
        num_slots=3, num_workers=2, num_microbatches=4, round_size=2, iteration=0, start_worker=0
    )
    queues = worker_queues(runs, 2)
    assert [(r.round, r.slot) for r in queues[0]] == [(0, 0), (0, 2), (1, 1)]
    assert [(r.round, r.slot) for r in queues[1]] == [(0, 1), (1, 0), (1, 2)]
    with pytest.raises(ValueError, match="worker=1, outside \\[0, num_workers=1\\)"):
        worker_queues(runs, 1)


def test_unit_timeline_small_case() -> None:
    runs, _ = build_schedule(
        num_slots=3, num_workers=2, num_microbatches=4, round_size=2, iteration=0, start_worker=0
    )
    timeline = unit_timeline(runs, kinds=KINDS_3, num_workers=2)
    assert timeline == {
        (0, 0, 0, 0): (0, 0),
        (0, 0, 0, 1): (0, 1),
        (0, 0, 1, 0): (1, 1),
        (0, 0, 1, 1): (1, 2),
        (0, 0, 2, 0): (0, 2),
        (0, 0, 2, 1): (0, 3),
        (0, 1, 0, 2): (1, 3),
        (0, 1, 0, 3): (1, 4),
        (0, 1, 1, 2): (0, 4),
        (0, 1, 1, 3): (0, 5),
        (0, 1, 2, 2): (1, 5),
        (0, 1, 2, 3): (1, 6),
    }


def test_unit_timeline_without_forward_slots() -> None:
    # Fused slot first: the backward slot only follows the fused one, micro-batch by micro-batch.
    runs = [SlotRun(0, 0, 0, 0, (0, 1)), SlotRun(0, 0, 1, 1, (0, 1))]
    assert unit_timeline(runs, kinds=["fused", "backward"], num_workers=2) == {
        (0, 0, 0, 0): (0, 0),
        (0, 0, 0, 1): (0, 1),
        (0, 0, 1, 0): (1, 1),
        (0, 0, 1, 1): (1, 2),
    }


def test_unit_timeline_rejects_missing_inputs_and_deadlocks() -> None:
    with pytest.raises(
        ValueError, match=r"op \(0, 0, 1, 0\) depends on \(0, 0, 0, 0\), which no run provides"
    ):
        unit_timeline([SlotRun(0, 0, 1, 0, (0,))], kinds=["forward", "fused"], num_workers=1)
    # One worker told to run the fused slot before the forward slot it needs.
    backwards = [SlotRun(0, 0, 1, 0, (0,)), SlotRun(0, 0, 0, 0, (0,))]
    with pytest.raises(ValueError, match=r"deadlock: workers wait forever at ops \[\(0, 0, 1, 0\)\]"):
        unit_timeline(backwards, kinds=["forward", "fused"], num_workers=1)
    with pytest.raises(ValueError, match="appears twice"):
        unit_timeline([SlotRun(0, 0, 0, 0, (0,)), SlotRun(0, 0, 0, 0, (0,))], kinds=["fused"], num_workers=1)
    with pytest.raises(ValueError, match="must hold exactly one 'fused' slot"):
        unit_timeline([], kinds=["forward", "backward"], num_workers=1)
    with pytest.raises(ValueError, match="must be forward slots, one fused slot, then backward slots"):
        unit_timeline([], kinds=["backward", "fused"], num_workers=1)
    with pytest.raises(ValueError, match="slot=2, outside the 2 kinds"):
        unit_timeline([SlotRun(0, 0, 2, 0, (0,))], kinds=["forward", "fused"], num_workers=1)


def test_unit_timeline_never_deadlocks_and_respects_dependencies() -> None:
    for num_workers, num_microbatches, num_slots in itertools.product(range(1, 5), range(1, 9), range(1, 7)):
        for fused in sorted({0, num_slots // 2, num_slots - 1}):
            kinds = kinds_for(num_slots, fused)
            for round_size in (None, num_workers, num_workers + 1):
                runs: list[SlotRun] = []
                g = 0
                for iteration in range(2):
                    more, g = build_schedule(
                        num_slots=num_slots,
                        num_workers=num_workers,
                        num_microbatches=num_microbatches,
                        round_size=round_size if num_microbatches >= num_workers else None,
                        iteration=iteration,
                        start_worker=g,
                    )
                    runs += more
                timeline = unit_timeline(runs, kinds=kinds, num_workers=num_workers)
                assert len(timeline) == 2 * num_slots * num_microbatches
                busy = {(w, t) for w, t in timeline.values()}
                assert len(busy) == len(timeline)  # one op per worker per step
                for (it, r, slot, m), (_, start) in timeline.items():
                    if slot > 0:
                        assert start >= timeline[(it, r, slot - 1, m)][1] + 1
                    if kinds[slot] == "backward" and fused > 0:
                        assert start >= timeline[(it, r, fused - 1, m)][1] + 1


def test_balanced_unit_timeline_matches_closed_form_bubble() -> None:
    # With equal slots, rounds of exactly N and N | M, the makespan is (M·S + N(N−1)) / N, i.e. the
    # bubble is N(N−1) / (M·S + N(N−1)).
    for num_workers, num_microbatches, num_slots in [(2, 2, 3), (2, 4, 5), (4, 4, 17), (4, 8, 17), (3, 6, 4)]:
        runs, _ = build_schedule(
            num_slots=num_slots,
            num_workers=num_workers,
            num_microbatches=num_microbatches,
            round_size=num_workers,
            iteration=0,
            start_worker=0,
        )
        timeline = unit_timeline(runs, kinds=kinds_for(num_slots, num_slots // 2), num_workers=num_workers)
        makespan = 1 + max(start for _, start in timeline.values())
        expected = Fraction(num_microbatches * num_slots + num_workers * (num_workers - 1), num_workers)
        assert makespan == expected


def test_render_grid_literal() -> None:
    runs, _ = build_schedule(
        num_slots=3, num_workers=2, num_microbatches=4, round_size=2, iteration=0, start_worker=0
    )
    grid = render_grid(runs, slot_names=["F1", "B1", "B2"], kinds=KINDS_3, num_workers=2)
    assert grid == "\n".join(
        [
            "step  w0     w1",
            "0     F1.m0  .",
            "1     F1.m1  B1.m0",
            "2     B2.m0  B1.m1",
            "3     B2.m1  F1.m2",
            "4     B1.m2  F1.m3",
            "5     B1.m3  B2.m2",
            "6     .      B2.m3",
        ]
    )


def test_render_grid_prefixes_iterations() -> None:
    first, g = build_schedule(
        num_slots=2, num_workers=2, num_microbatches=2, round_size=2, iteration=0, start_worker=0
    )
    second, _ = build_schedule(
        num_slots=2, num_workers=2, num_microbatches=2, round_size=2, iteration=1, start_worker=g
    )
    grid = render_grid(first + second, slot_names=["F1", "B1"], kinds=["forward", "fused"], num_workers=2)
    assert grid == "\n".join(
        [
            "step  w0       w1",
            "0     0:F1.m0  .",
            "1     0:F1.m1  0:B1.m0",
            "2     1:F1.m0  0:B1.m1",
            "3     1:F1.m1  1:B1.m0",
            "4     .        1:B1.m1",
        ]
    )
    with pytest.raises(ValueError, match=r"len\(slot_names\)=1 differs from len\(kinds\)=2"):
        render_grid(first, slot_names=["F1"], kinds=["forward", "fused"], num_workers=2)
