"""One "box" of a job that spans several, as its own process: ``python -m
tests.engine.distributed.box JOBS.json`` runs ``train`` for each job of the file in turn (so a
process's start is paid once for several jobs) and writes each job's outcome as JSON beside it.

A job: {"config": TrainConfig as JSON, "boxes": Boxes' fields or null, "result": a path,
"pause_s": seconds each step's metrics take (optional)}. The
outcome: {"status", "step", "checkpoint", "events"} or {"error", "message", "host", "rank",
"field"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from engine.config import TrainConfig
from engine.distributed import Boxes, BoxLost
from engine.errors import ConfigError
from engine.metrics import ListSink
from engine.training.run import train


class SlowSink(ListSink):
    """A ListSink that takes ``pause_s`` over each step's metrics (a slower box, for the fault
    tests to act mid-job)."""

    pause_s: float = 0.0

    def log(self, metrics: dict[str, float], step: int) -> None:
        super().log(metrics, step)
        if "loss/train" in metrics:
            time.sleep(self.pause_s)


def run(job: dict[str, Any]) -> dict[str, Any]:
    sink = SlowSink()
    sink.pause_s = float(job.get("pause_s", 0.0))
    boxes = None if job.get("boxes") is None else Boxes(**job["boxes"])
    try:
        result = train(TrainConfig.parse(job["config"]), sink, boxes=boxes)
    except BoxLost as exc:
        return {"error": "BoxLost", "message": str(exc), "host": exc.host, "rank": exc.rank}
    except ConfigError as exc:
        return {"error": "ConfigError", "message": str(exc), "field": exc.field}
    return {
        "status": str(result.status),
        "step": result.step,
        "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
        "events": [[kind, message, data] for kind, message, data in sink.events],
        "metrics": [[step, metrics] for step, metrics in sink.records],
        "checkpoints": [c.step for c in sink.checkpoints],
    }


def main(path: str) -> int:
    for job in json.loads(Path(path).read_text()):
        outcome = run(job)
        Path(job["result"]).write_text(json.dumps(outcome, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
