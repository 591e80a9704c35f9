"""A small real filesystem that fills up: a tmpfs of a given size mounted on a test's folder.

Mounting needs CAP_SYS_ADMIN (root, as ``make test`` runs in CI); without it the tests that use
it skip, saying why. A quota would need a filesystem mounted with quotas, which a test cannot
arrange either; a loop device needs the same privilege, and tmpfs needs no image file."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(folder: Path, size_bytes: int) -> str | None:
    """Mount; None when it worked, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


@contextlib.contextmanager
def small_disk(folder: Path, size_bytes: int) -> Iterator[Path]:
    """``folder`` as a tmpfs of ``size_bytes`` (rounded up to pages) while the block runs; skips the
    test when this process may not mount."""
    why = _mount(folder, size_bytes)
    if why is not None:
        pytest.skip(f"cannot mount a {size_bytes}-byte tmpfs on {folder} (needs root): {why}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, *, leave_bytes: int, name: str = "ballast") -> Path:
    """Write a file into ``folder`` until only ``leave_bytes`` stay free on its disk (real blocks,
    not a sparse file); returns the file, whose removal gives the space back."""
    path = folder / name
    free = shutil.disk_usage(folder).free
    todo = max(free - leave_bytes, 0)
    block = b"\0" * (1 << 20)
    with path.open("wb") as out:
        while todo > 0:
            n = min(todo, len(block))
            out.write(block[:n])
            todo -= n
        out.flush()
        os.fsync(out.fileno())
    return path
