"""What the engine's commands share: the progress line of a training run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from engine.kinds import EngineEvent
from engine.metrics import SavedCheckpoint, saved_message
from engine.training.checkpoint_layout import CheckpointKind


class ProgressSink:
    """One status line per step: a live bar on a terminal, a plain line otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.latest: dict[str, float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.latest.update(metrics)
        if "progress/step" not in metrics:
            return
        m = self.latest
        done, total = int(m["progress/step"]), int(m["progress/total_steps"])
        width = 24
        bar = "#" * (width * done // max(total, 1))
        eta = int(m.get("time/eta_s", 0))
        # the engine logs a step's loss once its optimizer step is done, which may be after the
        # run logged the step's progress: the line shows the latest loss known ("-" before any)
        loss = f"{m['loss/train']:.4f}" if "loss/train" in m else "-"
        line = (
            f"[{bar:<{width}}] step {done}/{total} loss {loss} "
            f"{m.get('throughput/tokens_per_s', 0):.0f} tok/s ETA {eta // 60}:{eta % 60:02d}"
        )
        if "loss/val" in m:
            line += f" val {m['loss/val']:.4f}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.stream.write(("\n" if self.tty else "") + f"[{kind}] {message}\n")
        self.stream.flush()

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.event(EngineEvent.CHECKPOINT, saved_message(SavedCheckpoint(step, Path(path), kind, bytes)))

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
