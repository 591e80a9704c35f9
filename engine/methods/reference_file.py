"""A method's stored reference log-probabilities (DPO's, KTO's): the file in the run folder.

The reference model's log-probabilities of every training and validation row are computed once,
before the first step, and kept beside the checkpoints, so that a resumed or redelivered run
reads them instead of computing them again. The file carries a fingerprint of what they depend
on (the rows' tokens, the base model, the compute dtype); a method recomputes them when it
differs. A batch's rows find their values by their tokens (``row_key``), whatever order the
batcher drew them in.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch


def row_key(input_ids: Any, labels: Any) -> bytes:
    """A digest of one sequence's ids and labels (lists or 1-D tensors, without padding)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).numpy().tobytes()
    lab = torch.as_tensor(labels, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(ids + b"|" + lab, digest_size=16).digest()


def read_reference(path: Path) -> dict[str, Any] | None:
    """The stored values, or None: no file, or a damaged one (computed again)."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
    except Exception:  # a damaged file is computed again
        return None
    return data if isinstance(data, dict) else None


def write_reference(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file beside ``path``, fsync it, rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
