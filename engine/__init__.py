"""Roundhouse's RoundPipe training engine.

``from engine import RoundPipe, EngineConfig``. Importing ``engine`` loads nothing heavy and
touches no device: the names below are resolved on first use.

This package and its subpackages' ``__init__`` modules are the engine's public face: each lists
its names in ``__all__``, and the service imports from nothing deeper (a test checks). Here: a
run's configuration (``TrainConfig`` and its sections, ``MAX_SEED``), the errors, the progress
``Sink`` with its events, and ``train``, which runs a configured job. Beside it: ``engine.data``
(datasets), ``engine.model`` (loading, families, merging), ``engine.training`` (the checkpoint
folder), ``engine.inference``, ``engine.export``, ``engine.methods``, ``engine.planner``,
``engine.graders``, ``engine.tracking``, ``engine.commands`` (the command line), ``engine.demo``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import (
        MAX_SEED,
        CheckpointSpec,
        DataSpec,
        EngineConfig,
        EngineSpec,
        EvalSpec,
        HyperSpec,
        MethodSpec,
        MlflowSpec,
        ModelSpec,
        TrackingSpec,
        TrainConfig,
        WandbSpec,
    )
    from engine.errors import Cancelled, ConfigError, DiskFull, EngineError
    from engine.kinds import EngineEvent
    from engine.metrics import SavedCheckpoint, Sink, saved_message
    from engine.roundpipe import RoundPipe
    from engine.training.run import train

# name -> the module that defines it (imported on first use)
_HOMES = {
    "MAX_SEED": "engine.config",
    "Cancelled": "engine.errors",
    "CheckpointSpec": "engine.config",
    "ConfigError": "engine.errors",
    "DataSpec": "engine.config",
    "DiskFull": "engine.errors",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "EngineEvent": "engine.kinds",
    "EngineSpec": "engine.config",
    "EvalSpec": "engine.config",
    "HyperSpec": "engine.config",
    "MethodSpec": "engine.config",
    "MlflowSpec": "engine.config",
    "ModelSpec": "engine.config",
    "RoundPipe": "engine.roundpipe",
    "SavedCheckpoint": "engine.metrics",
    "Sink": "engine.metrics",
    "TrackingSpec": "engine.config",
    "TrainConfig": "engine.config",
    "WandbSpec": "engine.config",
    "saved_message": "engine.metrics",
    "train": "engine.training.run",
}
__all__ = [
    "MAX_SEED",
    "Cancelled",
    "CheckpointSpec",
    "ConfigError",
    "DataSpec",
    "DiskFull",
    "EngineConfig",
    "EngineError",
    "EngineEvent",
    "EngineSpec",
    "EvalSpec",
    "HyperSpec",
    "MethodSpec",
    "MlflowSpec",
    "ModelSpec",
    "RoundPipe",
    "SavedCheckpoint",
    "Sink",
    "TrackingSpec",
    "TrainConfig",
    "WandbSpec",
    "saved_message",
    "train",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
