"""A job on k boxes equals the same job on one box with the whole batch.

The boxes are processes of their own (homes of their own, nothing shared but the rendezvous on
localhost), each with one CPU worker; every case runs 3 steps in fp32 and its masters after them
are compared with a single box's run of the same configuration in this process: within 1e-6,
for SFT with LoRA and in full, DPO, KTO, GRPO (each box samples its share of the prompts), a
mixture-of-experts family, and the asynchronous optimizer; a case run twice is bitwise the same.
One process per box runs every case in turn, so each box's start is paid once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import TrainConfig
from engine.distributed import Boxes
from engine.errors import ConfigError
from engine.kinds import EngineEvent
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
from tests.engine.tiny import bitwise_equal, max_diff

# (name, method case, boxes, config overrides)
CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("sft-lora", "sft-lora", 2, {}),
    ("sft-full", "sft-full", 3, {}),
    ("dpo", "dpo", 2, {}),
    ("grpo", "grpo", 2, {}),
    ("moe", "moe", 3, {}),
    ("kto", "kto", 2, {}),
    ("async", "sft-lora", 2, {"engine": {"async_optimizer": True}}),
    # AdamW: its update divides by each gradient's running size, so float rounding in a
    # near-zero gradient shows (a looser bound, measured 2.6e-6 after 3 steps)
    ("sft-lora-adamw", "sft-lora", 2, {"hyper": {"optimizer": "adamw", "learning_rate": 2e-2}}),
    ("sft-lora-again", "sft-lora", 2, {}),  # the first case again: bitwise the same
    # stopped after 2 steps, then resumed on the boxes: rank 0 sends its checkpoint's state
    ("resumed", "sft-lora", 2, {}),
]
# a case that first runs this many steps alone, then again to the end (a resume)
STOPPED_AT = {"resumed": 2}
# compared with a single box's run of their own (the others with a case's here)
COMPARED = [c for c in CASES if c[0] not in ("sft-lora-again", "resumed")]
TOLERANCE = 1e-6
ADAMW_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("boxes")
    d = make_workspace(root / "work")
    homes = [root / f"box{r}" for r in range(3)]
    jobs: list[list[dict[str, Any]]] = [[], [], []]
    # two boxes given other settings: both refuse, naming the field, before loading anything
    port = free_port()
    for r, rate in enumerate((2e-2, 3e-2)):
        config = job_config(d, "sft-lora", homes[r] / "out-mismatch", hyper={"learning_rate": rate})
        jobs[r].append(
            {"config": config, "boxes": boxes_field(2, r, port), "result": str(homes[r] / "mismatch.json")}
        )
    for name, case, k, over in CASES:
        port, before = free_port(), free_port()
        for r in range(k):
            out = homes[r] / f"out-{name}"
            if name in STOPPED_AT:
                stopped = job_config(d, case, out, hyper={"max_steps": STOPPED_AT[name]})
                result = str(homes[r] / f"{name}-stopped.json")
                jobs[r].append({"config": stopped, "boxes": boxes_field(k, r, before), "result": result})
            config = job_config(d, case, out, **over)
            jobs[r].append(
                {"config": config, "boxes": boxes_field(k, r, port), "result": str(homes[r] / f"{name}.json")}
            )
    started = time.monotonic()
    boxes = [start_box(home, j) for home, j in zip(homes, jobs, strict=True)]
    one: dict[str, Any] = {}
    try:
        for name, case, _, over in COMPARED:  # the single box's runs, meanwhile
            sink = ListSink()
            result = train(TrainConfig.parse(job_config(d, case, root / "one" / name, **over)), sink)
            one[name] = {"result": result, "sink": sink}
        for box in boxes:
            box.wait(timeout=900)
    finally:
        for box in boxes:
            if box.poll() is None:
                box.kill()
    return {"root": root, "homes": homes, "one": one, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("name,case,k,over", COMPARED, ids=[c[0] for c in COMPARED])
def test_k_boxes_equal_one_box_with_the_whole_batch(runs, name, case, k, over) -> None:
    homes: list[Path] = runs["homes"]
    first = outcome(homes[0] / f"{name}.json")
    assert first.get("status") == "succeeded", first
    assert first["step"] == 3
    single = runs["one"][name]
    diff = max_diff(masters(first["checkpoint"]), masters(single["result"].checkpoint))
    bound = ADAMW_TOLERANCE if name.endswith("adamw") else TOLERANCE
    assert diff <= bound, f"{name} on {k} boxes: max |diff| {diff:.3g} from one box"
    # the job's loss each step (every box's share summed) is the single box's
    losses = [m["loss/train"] for _, m in first["metrics"] if "loss/train" in m]
    assert len(losses) == 3
    assert losses == pytest.approx(single["sink"].series("loss/train"), abs=TOLERANCE)
    # rank 0 writes every checkpoint, once; the others write none and report no metric
    assert first["checkpoints"] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(Path(first["checkpoint"]).parent)] == [1, 2, 3]
    joined = [e for e in first["events"] if e[0] == EngineEvent.BOXES]
    assert len(joined) == 1 and joined[0][2]["hosts"] == [f"box{r}" for r in range(k)]
    assert joined[0][2]["link_gbps"] > 0 and joined[0][2]["gradient_bytes"] > 0
    if case == "grpo":  # the rewards of every box's completions: the whole batch's
        rewards = [m["reward/mean"] for _, m in first["metrics"] if "reward/mean" in m]
        assert rewards == pytest.approx(single["sink"].series("reward/mean"), abs=TOLERANCE)
    exchanged = [m for _, m in first["metrics"] if "exchange/bytes" in m]
    assert len(exchanged) == 3 and exchanged[0]["exchange/bytes"] > 0
    for r in range(1, k):
        other = outcome(homes[r] / f"{name}.json")
        assert other["status"] == "succeeded" and other["step"] == 3 and other["checkpoint"] is None
        assert other["metrics"] == [] and other["checkpoints"] == []
        assert not (homes[r] / f"out-{name}" / "checkpoints").exists() or not list_checkpoints(
            homes[r] / f"out-{name}" / "checkpoints"
        )


def test_a_job_on_boxes_is_bitwise_the_same_from_run_to_run(runs) -> None:
    home = runs["homes"][0]
    a, b = outcome(home / "sft-lora.json"), outcome(home / "sft-lora-again.json")
    assert bitwise_equal(masters(a["checkpoint"]), masters(b["checkpoint"]))


def test_boxes_resume_from_rank_0s_checkpoint_as_one_box_would(runs) -> None:
    homes: list[Path] = runs["homes"]
    first = outcome(homes[0] / "resumed.json")
    assert ["resume", "resumed from step_000002"] in [e[:2] for e in first["events"]]
    assert first["checkpoints"] == [3]  # steps 1 and 2 written once, by the first run
    other = outcome(homes[1] / "resumed.json")  # it has no checkpoint: rank 0 sent the state
    assert other["status"] == "succeeded" and other["step"] == 3
    assert ["resume", "resumed from step_000002"] in [e[:2] for e in other["events"]]
    single = runs["one"]["sft-lora"]["result"].checkpoint
    diff = max_diff(masters(first["checkpoint"]), masters(single))
    assert diff <= TOLERANCE, f"resumed on 2 boxes: max |diff| {diff:.3g} from one box"


def test_boxes_given_other_settings_refuse_naming_the_field(runs) -> None:
    for home in runs["homes"][:2]:
        refused = outcome(home / "mismatch.json")
        assert refused["error"] == "ConfigError" and refused["field"] == "hyper", refused
        assert "box box1 (rank 1) was given another hyper than box box0" in refused["message"]


def test_a_batch_too_small_for_the_boxes_is_refused_before_joining(tmp_path) -> None:
    d = make_workspace(tmp_path)
    config = TrainConfig.parse(job_config(d, "sft-lora", tmp_path / "out", hyper={"batch_size": 5}))
    # nobody listens at the address: the refusal comes before any rendezvous
    with pytest.raises(ConfigError) as refused:
        train(config, boxes=Boxes(3, 1, f"127.0.0.1:{free_port()}", join_timeout_s=1))
    assert refused.value.field == "hyper.batch_size"
    assert "3 boxes with engine.num_microbatches=2 each need a batch of at least 6" in str(refused.value)
