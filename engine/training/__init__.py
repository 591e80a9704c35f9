"""Training runs: the run loop (``run``: ``engine.train`` runs a configured job), checkpoints
written and read (``checkpoint``), and the checkpoint folder's layout (``checkpoint_layout``: folder
and step names, what a checkpoint holds, store keys, keep-last pruning), which the service reads.

The names below, the layout's, are this package's public face, each loaded on first use: importing
``engine.training`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.training.checkpoint_layout import (
        ADAPTER_CONFIG,
        CHECKPOINTS_DIR,
        EXPORTS_DIR,
        LEFT_OUT_OF_DOWNLOADS,
        STATE_DIR,
        CheckpointKind,
        checkpoint_key,
        checkpoints_dir,
        checkpoints_key,
        export_files,
        folder_bytes,
        in_download,
        is_complete,
        kind_of,
        latest,
        list_checkpoints,
        parse_step,
        prune,
        pruned_steps,
        read_trainer_state,
        run_of_key,
        step_name,
    )

# name -> the module that defines it (imported on first use)
_HOMES = {
    "ADAPTER_CONFIG": "engine.training.checkpoint_layout",
    "CHECKPOINTS_DIR": "engine.training.checkpoint_layout",
    "EXPORTS_DIR": "engine.training.checkpoint_layout",
    "LEFT_OUT_OF_DOWNLOADS": "engine.training.checkpoint_layout",
    "STATE_DIR": "engine.training.checkpoint_layout",
    "CheckpointKind": "engine.training.checkpoint_layout",
    "checkpoint_key": "engine.training.checkpoint_layout",
    "checkpoints_dir": "engine.training.checkpoint_layout",
    "checkpoints_key": "engine.training.checkpoint_layout",
    "export_files": "engine.training.checkpoint_layout",
    "folder_bytes": "engine.training.checkpoint_layout",
    "in_download": "engine.training.checkpoint_layout",
    "is_complete": "engine.training.checkpoint_layout",
    "kind_of": "engine.training.checkpoint_layout",
    "latest": "engine.training.checkpoint_layout",
    "list_checkpoints": "engine.training.checkpoint_layout",
    "parse_step": "engine.training.checkpoint_layout",
    "prune": "engine.training.checkpoint_layout",
    "pruned_steps": "engine.training.checkpoint_layout",
    "read_trainer_state": "engine.training.checkpoint_layout",
    "run_of_key": "engine.training.checkpoint_layout",
    "step_name": "engine.training.checkpoint_layout",
}
__all__ = [
    "ADAPTER_CONFIG",
    "CHECKPOINTS_DIR",
    "EXPORTS_DIR",
    "LEFT_OUT_OF_DOWNLOADS",
    "STATE_DIR",
    "CheckpointKind",
    "checkpoint_key",
    "checkpoints_dir",
    "checkpoints_key",
    "export_files",
    "folder_bytes",
    "in_download",
    "is_complete",
    "kind_of",
    "latest",
    "list_checkpoints",
    "parse_step",
    "prune",
    "pruned_steps",
    "read_trainer_state",
    "run_of_key",
    "step_name",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
