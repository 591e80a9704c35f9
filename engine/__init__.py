"""Roundhouse's RoundPipe training engine.

``from engine import RoundPipe, EngineConfig``. Importing ``engine`` loads nothing heavy and
touches no device: the names below are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.errors import Cancelled, ConfigError, EngineError
    from engine.roundpipe import RoundPipe

# name -> the module that defines it (imported on first use)
_HOMES = {
    "Cancelled": "engine.errors",
    "ConfigError": "engine.errors",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "RoundPipe": "engine.roundpipe",
}
__all__ = ["Cancelled", "ConfigError", "EngineConfig", "EngineError", "RoundPipe"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
