"""What the engine waits for: the calibration re-plan waits for no optimizer work, and
``synchronize()`` after the last iteration for one optimizer step at most.

The optimizer's step is slowed by a sleep far longer than the tiny model's iterations, so the
bounds hold on a loaded machine: a wait either includes the sleep or it does not.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

import engine.roundpipe as roundpipe
from engine import EngineConfig, RoundPipe
from engine.metrics import ListSink
from engine.parallel.board import Iteration
from engine.parallel.host import HostState
from engine.parallel.optimizer import OptimizerWorker, StepJob
from tests.engine.tiny import tiny_batch, tiny_model

SLEEP_S = 1.0  # added to the slowed optimizer step
MARGIN_S = 0.3  # for everything else a wait may include (tiny iterations, thread wake-ups)


@dataclass
class ClockSink(ListSink):
    """A ListSink that also notes when each step finished and each event arrived."""

    stepped_at: dict[int, float] = field(default_factory=dict)
    event_at: dict[str, float] = field(default_factory=dict)

    def log(self, metrics: dict[str, float], step: int) -> None:
        super().log(metrics, step)
        self.stepped_at[step] = time.perf_counter()

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        super().event(kind, message, data)
        self.event_at[kind] = time.perf_counter()


def slow_step(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """Step ``index`` sleeps ``SLEEP_S`` on the optimizer thread before it starts."""
    original = OptimizerWorker._step

    def slowed(self: OptimizerWorker, job: StepJob) -> None:
        if job.index == index:
            time.sleep(SLEEP_S)
        original(self, job)

    monkeypatch.setattr(OptimizerWorker, "_step", slowed)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_the_replan_waits_for_the_calibration_iterations_not_the_optimizer(
    monkeypatch: pytest.MonkeyPatch, async_optimizer: bool
) -> None:
    calibration = 2
    slow_step(monkeypatch, calibration)  # the step of the last calibration iteration
    measured: list[tuple[list[Iteration], list[int], Any]] = []
    chosen: list[tuple[bool, Any, Any]] = []
    real_measured, real_choose = roundpipe.measured_costs, roundpipe.choose_plan

    def measuring(iterations: list[Iteration], memory: Any) -> Any:
        costs = real_measured(iterations, memory)
        measured.append((list(iterations), [it.remaining for it in iterations], costs))
        return costs

    def choosing(costs: Any, **kwargs: Any) -> Any:
        plan = real_choose(costs, **kwargs)
        chosen.append((kwargs["measured"], costs, plan))
        return plan

    monkeypatch.setattr(roundpipe, "measured_costs", measuring)
    monkeypatch.setattr(roundpipe, "choose_plan", choosing)
    sink = ClockSink()
    config = EngineConfig(
        devices=["cpu"] * 3,
        num_microbatches=3,
        calibration_steps=calibration,
        async_optimizer=async_optimizer,
    )
    with RoundPipe(tiny_model("llama", blocks=4), config, sink=sink) as rp:
        for s in range(calibration):
            rp.forward_backward(**tiny_batch(seed=s))
            rp.step()
        calibrated = list(rp._calibration)
        started = time.perf_counter()
        rp.forward_backward(**tiny_batch(seed=calibration))
        returned = time.perf_counter()
        first = rp._inflight[-1]  # the first iteration on the new plan
        rp.step()
        rp.synchronize()
    step_done = sink.stepped_at[calibration]
    # the plan came from the calibration iterations' measured times, their workers done
    assert [kind for kind, _, _ in sink.events] == ["partition", "repartition"]
    assert len(measured) == 1 and measured[0][0] == calibrated and measured[0][1] == [0] * calibration
    assert [m for m, _, _ in chosen] == [False, True]
    assert chosen[1][1] is measured[0][2]
    # and the next iteration dispatched ran on it
    assert first.serial == calibration and first.plan is chosen[1][2] and rp.plan is chosen[1][2]
    assert first.version == calibration - int(async_optimizer)  # sync: after that step; async: before
    assert all(it.plan is chosen[0][2] for it in calibrated)
    # dispatched while the optimizer still slept in the calibration iterations' step
    assert sink.event_at["repartition"] < step_done - SLEEP_S / 2
    assert first.started < step_done - SLEEP_S / 2, (first.started - started, step_done - started)
    if async_optimizer:
        # it runs on the weights before that step, so it even returned before the step was done
        assert returned < step_done - SLEEP_S / 2, (returned - started, step_done - started)
    else:
        # sync: it runs on the weights after that step, so its loss waits for it
        assert returned - started > SLEEP_S / 2


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_synchronize_after_the_last_iteration_waits_for_one_step(
    monkeypatch: pytest.MonkeyPatch, async_optimizer: bool
) -> None:
    steps = 3
    slow_step(monkeypatch, steps)
    # zeroing gradient buffers is a pass over them, which on a large model costs about what a
    # step does: here it sleeps as long as the slowed step whenever there is anything to zero
    real_settle = HostState.settle_grads

    def costly_settle(self: HostState) -> None:
        if self.unset:
            time.sleep(SLEEP_S)
        real_settle(self)

    monkeypatch.setattr(HostState, "settle_grads", costly_settle)
    sink = ClockSink()
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, calibration_steps=0, async_optimizer=async_optimizer
    )
    model = tiny_model("qwen3")
    with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
        for s in range(steps):
            rp.forward_backward(**tiny_batch(seed=s))
            rp.step()
        last = rp._inflight[-1]
        started = time.perf_counter()
        rp.synchronize()
        took = time.perf_counter() - started
        assert sink.stepped_at[steps] <= started + took  # it did wait for the last step
        again = time.perf_counter()
        rp.synchronize()  # nothing left to wait for
        twice = time.perf_counter() - again
    step = SLEEP_S + sink.records[-1][1]["time/optimizer_s"]
    tail = max(last.finished - started, 0.0)  # of the last iteration, when it was still running
    assert took >= SLEEP_S
    assert took <= tail + step + MARGIN_S, (took, tail, step)
    assert twice < MARGIN_S
