"""Where a run's checkpoints lie and what they are named: the one owner of the folder layout.

    <output_dir>/
        checkpoints/                  CHECKPOINTS_DIR
            step_000123/              step_name(123): the export (adapter or model folder) ...
                state/                ... and what a resume needs (STATE_DIR), never downloaded:
                    trainer.json      the step, the batcher, the config; a checkpoint is complete
                    engine.pt         once this file is in place
                    method.pt
            .step_000124.tmp          a write in progress (renamed into place when complete)
            .step_000120.old          a checkpoint moved aside while it is replaced
            .step_000119.pruned       a checkpoint being removed by keep-last
        exports/                      EXPORTS_DIR: the service's built downloads

The same names make the store's keys (``runs/<job id>/checkpoints/step_000123``). Keep-last
pruning is decided here (``pruned_steps``) for a local folder (``prune``) and for a store alike.
No torch here: the worker's supervisor, the service and the CLI read it too.
"""

from __future__ import annotations

import json
import re
import shutil
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
EXPORTS_DIR = "exports"
STATE_DIR = "state"
TRAINER_FILE = "trainer.json"
ENGINE_FILE = "engine.pt"
METHOD_FILE = "method.pt"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a checkpoint's export a LoRA adapter
# the top-level entries of a checkpoint folder that a download of it (and an export) leaves out
LEFT_OUT_OF_DOWNLOADS = (STATE_DIR,)

_STEP = re.compile(r"^step_(\d{6,})$")
_HIDDEN = re.compile(r"^\.(step_\d{6,})\.(tmp|old|pruned)$")


class CheckpointKind(StrEnum):
    """What a checkpoint's export is: a LoRA adapter, or a full model folder."""

    ADAPTER = "adapter"
    FULL = "full"


class Hidden(StrEnum):
    """The suffix of a checkpoint's hidden folder while it is written, replaced or pruned."""

    TMP = "tmp"
    OLD = "old"
    PRUNED = "pruned"


def step_name(step: int) -> str:
    """The folder name of the checkpoint at ``step`` (``step_000123``).

    Raises:
        ValueError: a negative step.
    """
    if step < 0:
        raise ValueError(f"step: a checkpoint's step is 0 or more (got {step})")
    return f"step_{step:06d}"


def parse_step(name: str) -> int | None:
    """The step a checkpoint folder's name (or a key or path ending in one) stands for; None for
    any other name."""
    found = _STEP.match(PurePosixPath(name).name)
    return int(found[1]) if found else None


def hidden_name(step: int, suffix: Hidden) -> str:
    """The hidden folder of the checkpoint at ``step`` while it is written, replaced or pruned."""
    return f".{step_name(step)}.{suffix}"


def parse_hidden(name: str) -> tuple[str, Hidden] | None:
    """(the checkpoint's folder name, the suffix) of a hidden folder's name; None for any other."""
    found = _HIDDEN.match(name)
    return (found[1], Hidden(found[2])) if found else None


def checkpoints_dir(output_dir: str | Path) -> Path:
    """A run's checkpoints folder."""
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoints_key(output_dir: str) -> str:
    """The store's prefix of a job's checkpoints (``runs/<job id>/checkpoints``), from its key."""
    return f"{output_dir.rstrip('/')}/{CHECKPOINTS_DIR}"


def checkpoint_key(output_dir: str, step: int) -> str:
    """The store's key of a job's checkpoint at ``step`` (``runs/<job id>/checkpoints/step_000123``)."""
    return f"{checkpoints_key(output_dir)}/{step_name(step)}"


def run_of_key(key: str) -> tuple[str, int] | None:
    """(the run's folder, the step) of a checkpoint's key or path (``.../checkpoints/step_N``); None
    when it is not one."""
    path = PurePosixPath(key)
    step = parse_step(path.name)
    if step is None or path.parent.name != CHECKPOINTS_DIR:
        return None
    return str(path.parent.parent), step


def trainer_file(checkpoint: str | Path) -> Path:
    """``state/trainer.json`` of a checkpoint folder: what the run recorded (step, base, config)."""
    return Path(checkpoint) / STATE_DIR / TRAINER_FILE


def is_complete(checkpoint: str | Path) -> bool:
    """Whether a checkpoint folder is complete (its ``state/trainer.json`` is in place)."""
    return trainer_file(checkpoint).is_file()


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any] | None:
    """What the run recorded in the checkpoint (``state/trainer.json``); None when it has none or
    it is unreadable (an export copied without its state, a model folder)."""
    try:
        state = json.loads(trainer_file(checkpoint).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def kind_of(checkpoint: str | Path) -> CheckpointKind:
    """A checkpoint's kind, from its files: a LoRA adapter has ``adapter_config.json``."""
    return CheckpointKind.ADAPTER if (Path(checkpoint) / ADAPTER_CONFIG).is_file() else CheckpointKind.FULL


def in_download(relative: str | PurePosixPath | Path) -> bool:
    """Whether a file of a checkpoint folder (its path relative to the folder) is part of its
    download, i.e. not under what downloads leave out (``LEFT_OUT_OF_DOWNLOADS``)."""
    parts = PurePosixPath(Path(relative).as_posix()).parts
    return bool(parts) and parts[0] not in LEFT_OUT_OF_DOWNLOADS


def export_files(checkpoint: str | Path) -> list[Path]:
    """The files of a checkpoint's export (everything a download holds), sorted."""
    folder = Path(checkpoint)
    return sorted(p for p in folder.rglob("*") if p.is_file() and in_download(p.relative_to(folder)))


def folder_bytes(folder: str | Path) -> int:
    """The bytes of every file under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (a run's checkpoints folder), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and is_complete(child):
            found.append((step, child))
    return sorted(found)


def latest(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as (step, folder); None when there is none."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def pruned_steps(steps: list[int] | set[int], keep_last: int) -> list[int]:
    """The steps keep-last drops: all but the newest ``keep_last`` (every checkpoint is kept when
    ``keep_last`` is below 1), oldest first."""
    ordered = sorted(set(steps))
    return ordered[:-keep_last] if keep_last > 0 else []


def prune(root: str | Path, keep_last: int) -> list[int]:
    """Remove the complete checkpoints under ``root`` that keep-last drops; returns their steps.

    Each is renamed to a hidden name first: a removal cut short must not leave a torn folder that
    still looks complete (the next write clears it, ``clear_leftovers``)."""
    root = Path(root)
    found = dict(list_checkpoints(root))
    gone = pruned_steps(list(found), keep_last)
    for step in gone:
        hidden = root / hidden_name(step, Hidden.PRUNED)
        found[step].rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return gone


def clear_leftovers(root: str | Path) -> None:
    """What a write killed midway left in ``root``: its temporary folders and the checkpoints it was
    pruning go; a checkpoint it had moved aside to replace (``.step_N.old``, no ``step_N``) comes back."""
    root = Path(root)
    if not root.is_dir():
        return
    for child in root.iterdir():
        hidden = parse_hidden(child.name)
        if hidden is None:
            continue
        final = root / hidden[0]
        if hidden[1] == Hidden.OLD and not final.exists():
            child.rename(final)
        else:
            shutil.rmtree(child, ignore_errors=True)
