"""A method's reference log-probabilities (DPO's, KTO's): computed once, kept in the run folder.

The reference model's log-probabilities of both sequences of every training and validation pair
(DPO's chosen and rejected answers; KTO's row and its mismatched row) are computed once, before
the first step, and kept beside the checkpoints, so that a resumed or redelivered run reads them
instead of computing them again. The file carries a fingerprint of what they depend on (the
sequences' tokens, the base model, the compute dtype, what else the method names); a method
recomputes them when it differs. The values stay in pair order: a batch's rows find theirs by
their indices (the ``rows`` that ``collate_pairs`` carries).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.data.batches import collate_pairs
from engine.data.encode import EncodedPair
from engine.kinds import EngineEvent
from engine.metrics import Sink

if TYPE_CHECKING:
    from engine.roundpipe import RoundPipe


def row_key(input_ids: Any, labels: Any) -> bytes:
    """A digest of one sequence's ids and labels (lists or 1-D tensors, without padding)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).numpy().tobytes()
    lab = torch.as_tensor(labels, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(ids + b"|" + lab, digest_size=16).digest()


def fingerprint(
    train: list[EncodedPair],
    validation: list[EncodedPair],
    *,
    base: str,
    compute_dtype: str,
    tag: str = "",
    marks: Sequence[bytes] = (),
) -> str:
    """What the reference values depend on: both sequences' tokens of every pair, in order, the
    base model and the dtype; ``tag`` and ``marks`` (one a pair, training then validation: KTO's
    labels) add what else the method stores by."""
    pairs = train + validation
    if marks and len(marks) != len(pairs):
        raise ValueError(f"fingerprint: {len(marks)} marks for {len(pairs)} pairs")
    h = hashlib.sha256(f"{tag}{base}|{compute_dtype}|{len(train)}|{len(validation)}".encode())
    for i, pair in enumerate(pairs):
        h.update(row_key(pair.chosen.input_ids, pair.chosen.labels))
        h.update(row_key(pair.rejected.input_ids, pair.rejected.labels))
        if marks:
            h.update(marks[i])
    return h.hexdigest()


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


def pair_logps(
    engine: RoundPipe, pairs: list[EncodedPair], *, batch_size: int, pad_id: int, lora: bool
) -> torch.Tensor:
    """``[2 * len(pairs)]`` the reference's log-probability of both sequences of every pair, in
    pair order, ``batch_size`` pairs at a time: a LoRA run's base (adapters off), or a full
    fine-tune's weights as they are (call it before the first step)."""
    parts = [torch.empty(0)]
    for i in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[i : i + batch_size], pad_id)
        parts.append(engine.sequence_logps(**batch, adapters=not lora))
    return torch.cat(parts)


def _usable(stored: dict[str, Any], fingerprint: str, sizes: dict[str, int]) -> bool:
    """The stored file is of these pairs: its fingerprint and a value for each of their rows."""
    if stored.get("fingerprint") != fingerprint:
        return False
    for key, n in sizes.items():
        value = stored.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (2 * n,):
            return False
    return True


def stored_or_computed(
    engine: RoundPipe,
    path: Path,
    fingerprint: str,
    train: list[EncodedPair],
    validation: list[EncodedPair],
    *,
    batch_size: int,
    pad_id: int,
    lora: bool,
    sink: Sink,
    unit: str = "pairs",
    described: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probabilities of the training and of the validation pairs
    (``pair_logps``'s, ``[2 * pairs]`` each): read from ``path`` when it holds them under
    ``fingerprint``, else computed (the training pairs, then the validation pairs) and stored.
    Either way a ``reference`` event tells the sink; a computing one counts the pairs as
    ``unit`` (its data's key) and words them as ``described`` (default ``unit``).

    Call it before the engine resumes or takes a step: it computes on the initial weights.

    Raises:
        Cancelled: the run's cancel flag was set while computing.
    """
    stored = read_reference(path)
    if stored is not None and _usable(
        stored, fingerprint, {"train": len(train), "validation": len(validation)}
    ):
        sink.event(EngineEvent.REFERENCE, f"reference log-probabilities read from {path.name}", {})
        return stored["train"], stored["validation"]
    started = time.perf_counter()
    train_logps = pair_logps(engine, train, batch_size=batch_size, pad_id=pad_id, lora=lora)
    validation_logps = pair_logps(engine, validation, batch_size=batch_size, pad_id=pad_id, lora=lora)
    write_reference(path, {"fingerprint": fingerprint, "train": train_logps, "validation": validation_logps})
    n, seconds = len(train) + len(validation), time.perf_counter() - started
    source = "the base model (adapters off)" if lora else "the initial weights"
    sink.event(
        EngineEvent.REFERENCE,
        f"reference log-probabilities of {n} {described or unit} from {source} in {seconds:.1f} s",
        {unit: n, "seconds": seconds},
    )
    return train_logps, validation_logps


def by_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[2 * len(rows)]`` both values of each pair ``rows`` names (``values`` ``[2 * pairs]`` in
    pair order, as ``stored_or_computed`` gives them), the pairs interleaved as a collated batch's."""
    return values.view(-1, 2)[rows.long()].reshape(-1)
