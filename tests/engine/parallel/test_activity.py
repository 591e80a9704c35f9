"""The step metrics of where time goes besides compute, on CPU workers: the optimizer's phases,
the workers' idle time between iterations, their waits for weights and activations, the bytes
and GB/s of the copies, the prefetch hit rate. Delays put in on purpose must show up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.metrics import ListSink
from engine.parallel.activity import Activity, IdleGaps, activity_metrics, covered
from engine.parallel.executor import Worker
from tests.engine.tiny import SPLIT_PLAN, tiny_batch, tiny_model

PHASES = [f"time/optimizer/{p}_s" for p in ("fold", "norm", "update", "copy")]
NEW_KEYS = [
    *PHASES,
    "time/period_s",
    "pipeline/idle_between_s",
    "pipeline/idle_between_ratio",
    "time/wait/weights_s",
    "time/wait/activations_s",
    "transfer/h2d_bytes",
    "transfer/d2h_bytes",
    "transfer/h2d_gbps",
    "transfer/d2h_gbps",
    "pipeline/prefetch_hit_rate",
]
TOLERANCE_S = 0.005


def run(
    steps: int,
    *,
    workers: int = 2,
    pause_s: float = 0.0,
    settle: bool = False,
    hook: Callable[[RoundPipe], None] | None = None,
    **config: Any,
) -> tuple[list[dict[str, float]], dict[str, int]]:
    """Train ``steps`` steps of the tiny Llama on the split plan (5 stages, one round).

    Args:
        pause_s: sleep between a step and the next iteration.
        settle: wait for each step before the next iteration.
        hook: called with the engine before the first step.

    Returns:
        The metrics of each step, and ``bytes`` (the weights one training iteration uploads: every
        stage run its layers' compute copy) and ``units`` (optimizer units).
    """
    sink = ListSink()
    cfg = EngineConfig(
        devices=["cpu"] * workers, num_microbatches=4, partition=SPLIT_PLAN, optimizer="sgd", lr=0.1, **config
    )
    with RoundPipe(tiny_model("llama"), cfg, sink=sink) as rp:
        if hook is not None:
            hook(rp)
        for s in range(steps):
            if s and pause_s:
                time.sleep(pause_s)
            rp.forward_backward(**tiny_batch(batch=8, seed=s))
            rp.step()
            if settle:
                rp.synchronize()
        rp.synchronize()
        assert rp.plan is not None and len(rp.plan.slots) == 5
        info = {
            "bytes": sum(rp.host.param_bytes(i) for stage in rp.plan.slots for i in stage.layers),
            "units": len(rp.optimizer.optimizers),
        }
    assert [step for step, _ in sink.records] == list(range(1, steps + 1))
    return [m for _, m in sink.records], info


def test_every_step_reports_the_new_metrics_non_negative_and_consistent() -> None:
    records, info = run(3)
    per_iteration = info["bytes"]
    assert per_iteration > 0
    for m in records:
        missing = [k for k in NEW_KEYS if k not in m]
        assert not missing, missing
        assert all(isinstance(m[k], float) and m[k] >= 0 for k in NEW_KEYS), {k: m[k] for k in NEW_KEYS}
        # the step's own phases fit in the step; the fold ran while the iteration did
        assert sum(m[k] for k in PHASES[1:]) <= m["time/optimizer_s"] + TOLERANCE_S
        assert 0 < m["time/optimizer/fold_s"] <= m["time/step_s"]
        assert m["time/optimizer/update_s"] > 0 and m["time/optimizer/copy_s"] > 0
        # sync mode: nothing is prefetched across iterations, so each step moved exactly its
        # stages' weights; CPU workers hand activations and gradients over without a copy
        assert m["transfer/h2d_bytes"] == per_iteration
        assert m["transfer/d2h_bytes"] == 0 and m["transfer/d2h_gbps"] == 0
        assert m["transfer/h2d_gbps"] > 0
        assert 0 <= m["pipeline/prefetch_hit_rate"] <= 1
        assert m["pipeline/idle_between_ratio"] == pytest.approx(
            m["pipeline/idle_between_s"] / m["time/period_s"]
        )
    assert records[0]["pipeline/idle_between_s"] == 0  # no worker computed before the first iteration
    assert records[0]["time/period_s"] == records[0]["time/step_s"]
    assert all(m["pipeline/idle_between_s"] > 0 for m in records[1:])


def test_async_steps_move_every_stage_weights_once_in_all() -> None:
    records, info = run(4, async_optimizer=True)
    # a prefetch of the next iteration's first stage counts in the step it was queued in
    assert sum(m["transfer/h2d_bytes"] for m in records) == 4 * info["bytes"]


def test_a_pause_between_iterations_is_idle_time_of_every_worker() -> None:
    pause = 0.3
    records, _ = run(3, pause_s=pause)
    for m in records[1:]:
        # every worker computed in the iteration before: each one's gap holds the whole pause
        assert m["pipeline/idle_between_s"] >= pause
        assert m["time/wait/weights_s"] < pause  # the pause came before the iteration was launched


def test_one_worker_prefetches_every_stage_but_an_iterations_first() -> None:
    # each step published before the next iteration: every next stage's weights are ready
    records, _ = run(3, workers=1, settle=True)
    assert [m["pipeline/prefetch_hit_rate"] for m in records] == [4 / 5] * 3  # 5 stages


def test_a_slow_weights_copy_is_waited_for_and_counted_as_the_copy_phase() -> None:
    delay = 0.2

    def slow_copies(rp: RoundPipe) -> None:
        refresh = rp.host.refresh_compute

        def slow(owner: int, version: int) -> None:
            time.sleep(delay)
            refresh(owner, version)

        rp.host.refresh_compute = slow  # type: ignore[method-assign]

    records, info = run(2, hook=slow_copies)
    for m in records:
        assert m["time/optimizer/copy_s"] >= info["units"] * delay
        assert m["time/optimizer_s"] >= m["time/optimizer/copy_s"]
    # sync mode: the second iteration's first stage waits for the step's first copy at least
    assert records[1]["time/wait/weights_s"] * 2 >= delay  # the mean of 2 workers
    assert records[0]["time/wait/weights_s"] < records[1]["time/wait/weights_s"]  # weights ready


def test_a_slow_first_stage_makes_the_next_one_wait_for_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    delay = 0.1
    forward = Worker._forward

    def slow(self: Worker, it: Any, stage: Any, mb: int, params: Any, x: torch.Tensor) -> None:
        if stage.start == 0:
            time.sleep(delay)
        forward(self, it, stage, mb, params, x)

    monkeypatch.setattr(Worker, "_forward", slow)
    records, _ = run(2)
    # the second forward stage (on the other worker) waits about ``delay`` for each of the 4
    # micro-batches: at least 2 x ``delay`` in all, the mean of 2 workers at least ``delay``
    for m in records:
        assert m["time/wait/activations_s"] >= delay


def test_copies_overlapping_on_one_worker_count_once_per_direction() -> None:
    assert covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.4)]) == pytest.approx(3.0)
    assert covered([]) == 0.0
    a = Activity(
        copies=[(0, "h2d", 100, 0.0, 1.0), (0, "h2d", 100, 0.5, 1.5), (1, "h2d", 200, 10.0, 11.0)],
        waits=[("weights", 1.0, 1.25), ("activations", 2.0, 2.5), ("activations", 3.0, 2.0)],
        gaps=[(0, 5.0, 6.0)],
        prefetched=[True, False, True, True],
    )
    m = activity_metrics([a], num_workers=2, period=4.0)
    # 400 bytes over 1.5 s (worker 0: two copies overlapping) + 1 s (worker 1)
    assert m["transfer/h2d_gbps"] == pytest.approx(400 / 1e9 / 2.5)
    assert m["transfer/h2d_bytes"] == 400 and m["transfer/d2h_bytes"] == 0
    assert m["time/wait/weights_s"] == pytest.approx(0.125)  # per worker
    assert m["time/wait/activations_s"] == pytest.approx(0.25)  # a reversed span counts as none
    assert m["pipeline/idle_between_s"] == pytest.approx(0.5)
    assert m["pipeline/idle_between_ratio"] == pytest.approx(0.125)
    assert m["pipeline/prefetch_hit_rate"] == 0.75
    assert activity_metrics([a], num_workers=2, period=4.0) == m  # settled once: read again alike


def test_a_worker_has_one_gap_per_training_iteration() -> None:
    idle = IdleGaps(3)
    assert idle.gap(0, [(0.0, 1.0)], train=True) is None  # its first compute ever
    assert idle.gap(0, [(1.5, 2.0)], train=True) is None  # a second stage of the same iteration
    assert idle.gap(-1, [(2.5, 3.0)], train=False) is None  # an evaluation: no step reads it
    assert idle.gap(1, [], train=True) is None  # a stage that computed nothing
    assert idle.gap(1, [(4.0, 5.0), (5.0, 6.0)], train=True) == (3, 3.0, 4.0)
