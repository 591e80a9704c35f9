"""A box that dies or goes silent mid-job: the others stop within a bounded time with
``BoxLost`` naming it, rank 0's checkpoints are each written once, and the job resumes from the
last one on the boxes left (here one), equal to a run never interrupted."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from engine.config import TrainConfig
from engine.metrics import ListSink
from engine.training.checkpoint_layout import list_checkpoints
from engine.training.run import train
from tests.engine.distributed.boxes import (
    boxes_field,
    free_port,
    job_config,
    make_workspace,
    masters,
    outcome,
    start_box,
)
from tests.engine.tiny import max_diff

STEPS = 10
TIMEOUT_S = 3.0  # Boxes.timeout_s: a heartbeat this old is a lost box
BOUND_S = 45.0
KEEP = {
    "every_steps": 1,
    "keep_last": STEPS,
}  # the survivor's stop: the heartbeat timeout, the step in flight, a loaded machine


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_lost_box_stops_the_others_and_the_job_resumes_on_fewer(tmp_path: Path) -> None:
    d = make_workspace(tmp_path / "work")
    # two jobs of two boxes at once: in one the second box goes silent (stopped, its connections
    # open: a lost network), in the other rank 0, the rendezvous, is killed
    scenarios = {"silent": (1, signal.SIGSTOP), "killed": (0, signal.SIGKILL)}
    procs, outs = {}, {}
    for name in scenarios:
        port = free_port()
        for r in range(2):
            home = tmp_path / name / f"box{r}"
            out = home / "out"
            config = job_config(d, "sft-lora", out, hyper={"max_steps": STEPS}, checkpoint=KEEP)
            job = {
                "config": config,
                "boxes": boxes_field(2, r, port, timeout_s=TIMEOUT_S),
                "result": str(home / "result.json"),
                "pause_s": 0.6,
            }
            procs[(name, r)] = start_box(home, [job])
            outs[(name, r)] = out
    try:
        for name in scenarios:  # both mid-job: rank 0 has written its second checkpoint
            checkpoints = outs[(name, 0)] / "checkpoints"
            wait_for(
                lambda c=checkpoints: c.is_dir() and len(list_checkpoints(c)) >= 2,
                240,
                f"{name}'s checkpoints",
            )
        lost_at = {}
        for name, (victim, sig) in scenarios.items():
            os.kill(procs[(name, victim)].pid, sig)
            lost_at[name] = time.monotonic()
        for name, (victim, _) in scenarios.items():
            survivor = 1 - victim
            procs[(name, survivor)].wait(timeout=BOUND_S + 30)
            took = time.monotonic() - lost_at[name]
            assert took < BOUND_S, f"{name}: box{survivor} stopped {took:.1f} s after box{victim} was lost"
            said = outcome(tmp_path / name / f"box{survivor}" / "result.json")
            assert said["error"] == "BoxLost", said
            assert said["host"] == f"box{victim}" and said["rank"] == victim, said
            assert f"box box{victim} (rank {victim}" in said["message"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    # rank 0's checkpoints, each once; the other box wrote none
    checkpoints = outs[("silent", 0)] / "checkpoints"
    steps = [s for s, _ in list_checkpoints(checkpoints)]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < STEPS
    assert not (outs[("silent", 1)] / "checkpoints").exists()
    # the job resumes from the last one on the box left, the batch the same, to the end
    sink = ListSink()
    config = TrainConfig.parse(
        job_config(d, "sft-lora", outs[("silent", 0)], hyper={"max_steps": STEPS}, checkpoint=KEEP)
    )
    resumed = train(config, sink)
    assert resumed.step == STEPS
    assert ("resume", f"resumed from step_{steps[-1]:06d}") in [e[:2] for e in sink.events]
    assert [c.step for c in sink.checkpoints] == list(range(steps[-1] + 1, STEPS + 1))
    assert [s for s, _ in list_checkpoints(checkpoints)] == list(range(1, STEPS + 1))
    straight = train(
        TrainConfig.parse(job_config(d, "sft-lora", tmp_path / "straight", hyper={"max_steps": STEPS}))
    )
    diff = max_diff(masters(resumed.checkpoint), masters(straight.checkpoint))
    assert diff <= 1e-6, f"resumed on one box after a lost one: max |diff| {diff:.3g}"
