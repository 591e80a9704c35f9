"""The Sink protocol: where the engine and the training loop report progress.

Keys are namespaced (``loss/train``, ``throughput/tokens_per_s``, ``time/step_s``). The engine
ships a null, a stdout and a list sink; the service supplies one that writes to its database.
Sinks may be called from the engine's optimizer thread; the engine serialises the calls.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops everything."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class ListSink:
    """Keeps everything in memory (tests, notebooks)."""

    records: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    closed: bool = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((kind, message, dict(data or {})))

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

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
