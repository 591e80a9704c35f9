"""Roundhouse's RoundPipe training engine.

``from engine import RoundPipe, EngineConfig``. Importing ``engine`` loads nothing heavy and
touches no device: the names below are resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.roundpipe import Cancelled, EngineConfig, EngineError, RoundPipe

__all__ = ["Cancelled", "EngineConfig", "EngineError", "RoundPipe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from engine import roundpipe

        return getattr(roundpipe, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
