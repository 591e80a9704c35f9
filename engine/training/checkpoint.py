"""Checkpoints: ``checkpoints/step_000123/`` = the export + ``state/`` (what a resume needs).

Writes are atomic: everything goes to a hidden temporary folder, files are fsynced, and the
folder is renamed into place; a crash leaves either the old set of checkpoints or the new one.
Only folders with ``state/trainer.json`` count as checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.training.folders import list_checkpoints, step_name


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(root: str | Path, step: int, fill: Callable[[Path], None], *, keep_last: int) -> Path:
    """Create ``root/step_NNNNNN`` atomically with ``fill(tmp_folder)``; keep the newest ``keep_last``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    tmp = root / f".{step_name(step)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    _fsync_tree(tmp)
    if final.exists():
        old = root / f".{step_name(step)}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def save_state(folder: Path, engine_state: dict[str, Any], trainer_state: dict[str, Any]) -> None:
    state = folder / "state"
    state.mkdir(parents=True, exist_ok=True)
    torch.save(engine_state, state / "engine.pt")
    (state / "trainer.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")


def load_state(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    state = Path(folder) / "state"
    engine_state = torch.load(state / "engine.pt", weights_only=True)
    trainer_state = json.loads((state / "trainer.json").read_text())
    return engine_state, trainer_state
