"""The engine's exceptions: what a caller (the CLI, the service) can catch and report.

``ConfigError`` is a user mistake in a configuration value; it is a ``ValueError`` and carries
the dotted name of the field at fault (``field``), so the service can name it in its error
answer without reading the message.
"""

from __future__ import annotations

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
