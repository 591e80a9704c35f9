"""Helpers of the several-boxes tests: free ports, a workspace of tiny models and data, configs,
and box processes (``box.py``) with homes of their own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from engine.config import TrainConfig
from engine.training.checkpoint import load_state
from tests.engine.methods.test_grpo_run import GRADER
from tests.engine.tiny import tiny_model_folder

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_workspace(d: Path) -> Path:
    """Tiny models (a dense Qwen3 and a Qwen3-MoE) and the rows of each method."""
    tiny_model_folder(d / "model", "qwen3")
    tiny_model_folder(d / "moe", "qwen3_moe")
    chat = [
        {
            "messages": [
                {"role": "user", "content": f"what is {a} plus {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a in range(6)
        for b in range(4)
    ]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    pairs = [
        {"prompt": f"what is {a} plus {b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(6)
        for b in range(4)
    ]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    prompts = [
        {"messages": [{"role": "user", "content": f"what is {a} plus {b}?"}], "reference_answer": str(a + b)}
        for a in range(6)
        for b in range(4)
    ]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    unpaired = [
        {
            "prompt": f"what is {a} plus {b}?",
            "completion": str(a + b + (a + b) % 2),
            "label": (a + b) % 2 == 0,
        }
        for a in range(6)
        for b in range(4)
    ]
    (d / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    return d


METHODS: dict[str, dict[str, Any]] = {
    "sft-lora": {"method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8}},
    "sft-full": {"method": {"kind": "full"}},
    "dpo": {"method": {"kind": "dpo", "beta": 0.5, "lora_r": 4, "lora_alpha": 8}, "data": "pairs.jsonl"},
    "grpo": {
        "method": {
            "objective": "grpo",
            "lora_r": 4,
            "lora_alpha": 8,
            "grader": GRADER,
            "group_size": 2,
            "max_completion_tokens": 4,
            "beta": 0.0,
        },
        "data": "prompts.jsonl",
        "max_length": 48,
    },
    "moe": {"method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8}, "model": "moe"},
    "kto": {
        "method": {"objective": "kto", "beta": 0.5, "lora_r": 4, "lora_alpha": 8, "undesirable_weight": 1.5},
        "data": "unpaired.jsonl",
    },
}


def job_config(d: Path, case: str, out: Path, **over: Any) -> dict[str, Any]:
    """A 3-step run of ``case`` (``METHODS``) on one CPU worker with SGD, as JSON (AdamW divides
    each gradient by its own running size, which turns the last bits of a near-zero gradient
    into a visible difference: the tests that compare summation orders use SGD, as the engine's
    equivalence tests do)."""
    spec = METHODS[case]
    raw: dict[str, Any] = {
        "model": {"path": str(d / spec.get("model", "model")), "name": "tiny"},
        "data": {"train": str(d / spec.get("data", "chat.jsonl")), "max_length": spec.get("max_length", 64)},
        "method": spec["method"],
        "hyper": {
            "max_steps": 3,
            "batch_size": 6,
            "optimizer": "sgd",
            "learning_rate": 0.2,
            "schedule": "constant",
            "seed": 3,
        },
        "engine": {"devices": ["cpu"], "num_microbatches": 2},
        "checkpoint": {"every_steps": 1, "keep_last": 5},
        "output_dir": str(out),
    }
    for key, value in over.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    TrainConfig.parse(raw)  # refused here rather than in a box
    return raw


def start_box(home: Path, jobs: list[dict[str, Any]]) -> subprocess.Popen[bytes]:
    """A box process in ``home`` running ``jobs`` in turn (one thread of torch: several boxes
    share this machine's cores)."""
    home.mkdir(parents=True, exist_ok=True)
    spec = home / f"jobs-{len(list(home.glob('jobs-*.json')))}.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(home / "box.log", "ab")  # noqa: SIM115  (the process writes it after we return)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engine.distributed.box", str(spec)],
        cwd=str(ROOT),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def boxes_field(k: int, rank: int, port: int, **over: Any) -> dict[str, Any]:
    return {"world_size": k, "rank": rank, "address": f"127.0.0.1:{port}", "host": f"box{rank}", **over}


def outcome(path: Path) -> dict[str, Any]:
    if not path.is_file():
        logs = "\n".join(p.read_text()[-3000:] for p in path.parent.parent.glob("*/box.log"))
        raise AssertionError(f"no outcome at {path}; the boxes' logs:\n{logs}")
    return dict(json.loads(path.read_text()))


def masters(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return dict(load_state(Path(checkpoint))[0]["masters"])
