"""The engine's exceptions: what a caller (the CLI, the service) can catch and report.

``ConfigError`` is a user mistake in a configuration value; it is a ``ValueError`` and carries
the dotted name of the field at fault (``field``), so the service can name it in its error
answer without reading the message.
"""

from __future__ import annotations

import errno
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid.

    Args:
        field: the dotted field name, e.g. ``"hyper.batch_size"`` or ``"EngineConfig.devices"``.
        message: the whole message; it names the field and the value given.
        value: the value at fault, when there is one.
    """

    def __init__(self, field: str, message: str, *, value: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class EngineError(RuntimeError):
    """A worker or the optimizer failed.

    The message names where; the fields say it for a program (None where they do not apply).

    Args:
        message: what failed, with the stage and the worker.
        stage: the stage's name (``"B3"``), or ``"optimizer"``.
        stage_kind: ``"forward"``, ``"fused"`` or ``"backward"`` (``engine.kinds.StageKind``).
        worker: the worker's device (``"cuda:1"``, ``"cpu"``).
        iteration: the engine's iteration serial (``forward_backward`` calls, from 0).
        step: the run's step that failed (1-based), set by the training loop.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        stage_kind: str | None = None,
        worker: str | None = None,
        iteration: int | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.stage_kind = stage_kind
        self.worker = worker
        self.iteration = iteration
        self.step = step

    def where(self) -> str:
        """``"in backward stage B3 on cuda:1 at step 120"``: the parts that are known."""
        parts = []
        if self.stage is not None:
            parts.append(f"in {self.stage_kind + ' stage ' if self.stage_kind else ''}{self.stage}")
        if self.worker is not None:
            parts.append(f"on {self.worker}")
        if self.step is not None:
            parts.append(f"at step {self.step}")
        elif self.iteration is not None:
            parts.append(f"at iteration {self.iteration}")
        return " ".join(parts)

    def fields(self) -> dict[str, Any]:
        """The fields as JSON."""
        return {
            "stage": self.stage,
            "stage_kind": self.stage_kind,
            "worker": self.worker,
            "iteration": self.iteration,
            "step": self.step,
        }


class Cancelled(RuntimeError):
    """The cancel flag was set; the iteration stopped between micro-batches."""


class DiskFull(OSError):
    """A write did not fit on its disk (or would leave less than the reserve free).

    Args:
        path: what was being written (a checkpoint's folder).
        needed_bytes: the bytes it needs, with the reserve.
        free_bytes: the bytes free on that disk when it was refused.
    """

    def __init__(self, path: str, *, needed_bytes: int, free_bytes: int) -> None:
        message = (
            f"disk full: {path} needs {needed_bytes} bytes ({needed_bytes / 2**20:.1f} MiB), "
            f"{free_bytes} bytes ({free_bytes / 2**20:.1f} MiB) free"
        )
        super().__init__(errno.ENOSPC, message)
        self.path, self.needed_bytes, self.free_bytes = path, needed_bytes, free_bytes

    def __str__(self) -> str:
        return str(self.strerror)

    def fields(self) -> dict[str, Any]:
        """The fields as JSON."""
        return {"path": self.path, "needed_bytes": self.needed_bytes, "free_bytes": self.free_bytes}
