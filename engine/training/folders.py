"""Where checkpoints lie in a run's folder: ``checkpoints/step_000123/``, complete once
``state/trainer.json`` is in place. No torch here: the worker's supervisor reads it too."""

from __future__ import annotations

import re
from pathlib import Path

_STEP = re.compile(r"^step_(\d{6,})$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP.match(child.name)
        if m and (child / "state" / "trainer.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
