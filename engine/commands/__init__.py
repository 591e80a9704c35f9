"""The ``roundhouse`` command line of the engine (``cli``: ``build_parser``, ``main``), with its
``chat`` and ``demo`` commands; the service's own command line adds its commands around it.

The names below are this package's public face, loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.commands.cli import build_parser, main

# name -> the module that defines it (imported on first use)
_HOMES = {
    "build_parser": "engine.commands.cli",
    "main": "engine.commands.cli",
}
__all__ = ["build_parser", "main"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
