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
    """A worker or the optimizer failed; the message names the stage and the worker."""


class Cancelled(RuntimeError):
    """The cancel flag was set; the iteration stopped between micro-batches."""
