"""Checkpoints written and read: the export + ``state/`` (what a resume needs), in the folder
layout of ``engine.training.checkpoint_layout`` (names, steps, keep-last).

Writes are atomic: everything goes to a hidden temporary folder, files and folders are fsynced,
and the folder is renamed into place (and its parent fsynced); a crash leaves either the old set
of checkpoints or the new one, and what a killed write left behind is cleared by the next one.
Only folders with ``state/trainer.json`` count as checkpoints.

Before a write the free space is checked against the checkpoint's size and a reserve; a write
that still runs out of space removes its partial folder. Both raise ``DiskFull``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.errors import DiskFull
from engine.training.checkpoint_layout import (
    ENGINE_FILE,
    METHOD_FILE,
    STATE_DIR,
    Hidden,
    clear_leftovers,
    hidden_name,
    prune,
    step_name,
    trainer_file,
)

FULL = (errno.ENOSPC, errno.EDQUOT)
SLACK_BYTES = 1 << 20  # a checkpoint's files beside its tensors (tokenizer, configs, JSON)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):  # a folder after what is in it
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (nested dicts, lists and tuples): what saving it takes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def check_space(root: Path, path: Path, *, needed_bytes: int, reserve_bytes: int) -> None:
    """Raise ``DiskFull`` unless writing ``needed_bytes`` under ``root`` leaves ``reserve_bytes`` free."""
    free = shutil.disk_usage(root).free
    if free < needed_bytes + reserve_bytes:
        raise DiskFull(str(path), needed_bytes=needed_bytes + reserve_bytes, free_bytes=free)


def write_checkpoint(
    root: str | Path,
    step: int,
    fill: Callable[[Path], None],
    *,
    keep_last: int,
    needed_bytes: int | None = None,
    reserve_bytes: int = 0,
) -> Path:
    """Create ``root/step_NNNNNN`` atomically with ``fill(tmp_folder)``; keep the newest ``keep_last``.

    Args:
        needed_bytes: what the checkpoint will take; with it, the free space is checked first.
        reserve_bytes: the space the write must leave free on the disk.

    Raises:
        DiskFull: the free space is short of ``needed_bytes + reserve_bytes``, or the disk filled
            up while writing (the partial folder is removed; the checkpoints before stay).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clear_leftovers(root)
    final = root / step_name(step)
    tmp = root / hidden_name(step, Hidden.TMP)
    if needed_bytes is not None:
        check_space(root, final, needed_bytes=needed_bytes + SLACK_BYTES, reserve_bytes=reserve_bytes)
    tmp.mkdir()
    try:
        fill(tmp)
        _fsync_tree(tmp)
    except BaseException as exc:
        # torch.save reports a full disk as a RuntimeError of its writer: the space left tells
        full = (isinstance(exc, OSError) and exc.errno in FULL) or (
            isinstance(exc, Exception) and shutil.disk_usage(root).free < SLACK_BYTES
        )
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            free = shutil.disk_usage(root).free
            needed = max(needed_bytes or 0, free + 1) + reserve_bytes
            raise DiskFull(str(final), needed_bytes=needed, free_bytes=free) from exc
        raise
    if final.exists():
        old = root / hidden_name(step, Hidden.OLD)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    prune(root, keep_last)
    return final


def save_state(
    folder: Path,
    engine_state: dict[str, Any],
    trainer_state: dict[str, Any],
    method_state: dict[str, Any] | None = None,
) -> None:
    """Write ``state/``: the engine's tensors, the trainer's JSON, and the method's own state when
    it has some (``state/method.pt``: e.g. a GRPO batch the next steps train on)."""
    state = folder / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    torch.save(engine_state, state / ENGINE_FILE)
    if method_state:
        torch.save(method_state, state / METHOD_FILE)
    trainer_file(folder).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")


def load_state(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    engine_state = torch.load(Path(folder) / STATE_DIR / ENGINE_FILE, weights_only=True)
    trainer_state = json.loads(trainer_file(folder).read_text())
    return engine_state, trainer_state


def load_method_state(folder: str | Path) -> dict[str, Any]:
    """The method's state a checkpoint holds (``save_state``'s ``method_state``); empty if none."""
    path = Path(folder) / STATE_DIR / METHOD_FILE
    if not path.is_file():
        return {}
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state
