"""The Sink protocol: where the engine and the training loop report progress.

Keys are namespaced (``loss/train``, ``throughput/tokens_per_s``, ``time/step_s``). The engine
ships a null, a stdout and a list sink; the service supplies one that writes to its database.
Sinks may be called from the engine's optimizer thread; the engine serialises the calls.

A saved checkpoint is told by its own typed call, ``checkpoint_saved(step, path, kind, bytes)``,
not by an event: the service stores it and records its row from those fields.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from engine.kinds import EngineEvent
from engine.training.checkpoint_layout import CheckpointKind


@runtime_checkable
class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None: ...

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        """The run saved a complete checkpoint at ``step``: ``path`` is its folder, ``bytes`` the
        size of its files; the older ones its keep-last drops are gone from that folder already."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SavedCheckpoint:
    """One ``checkpoint_saved`` call, as a sink keeps it."""

    step: int
    path: Path
    kind: CheckpointKind
    bytes: int


def saved_message(saved: SavedCheckpoint) -> str:
    """The one line a sink shows for a saved checkpoint (``saved step_000006: adapter, 1.2 MB``)."""
    return f"saved {saved.path.name}: {saved.kind}, {saved.bytes / 1e6:.1f} MB"


class NullSink:
    """Drops everything."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        pass

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class ListSink:
    """Keeps everything in memory (tests, notebooks)."""

    records: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    checkpoints: list[SavedCheckpoint] = field(default_factory=list)
    closed: bool = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((kind, message, dict(data or {})))

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.checkpoints.append(SavedCheckpoint(step, Path(path), CheckpointKind(kind), bytes))

    def close(self) -> None:
        self.closed = True

    def series(self, key: str) -> list[float]:
        """Every logged value of one key, in step order."""
        return [m[key] for _, m in self.records if key in m]


class StdoutSink:
    """One line per step and per event on a text stream."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        self.stream.write(f"step {step}: {parts}\n")
        self.stream.flush()

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.stream.write(f"[{kind}] {message}\n")
        self.stream.flush()

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.event(EngineEvent.CHECKPOINT, saved_message(SavedCheckpoint(step, Path(path), kind, bytes)))

    def close(self) -> None:
        self.stream.flush()


class FanoutSink:
    """Hands every call to each of its sinks in order, one call at a time (``lock``: shared with
    anything else that writes to them from another thread, e.g. a tracker's warnings)."""

    def __init__(self, *sinks: Sink, lock: threading.Lock | None = None) -> None:
        self.sinks = sinks
        self.lock = lock or threading.Lock()

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self.lock:
            for sink in self.sinks:
                sink.log(metrics, step)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        with self.lock:
            for sink in self.sinks:
                sink.event(kind, message, data)

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        with self.lock:
            for sink in self.sinks:
                sink.checkpoint_saved(step, path, kind, bytes)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
