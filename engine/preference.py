"""The DPO side of a run: its pairs, their reference log-probabilities, its loss and validation.

The reference log-probabilities of every training and validation pair are computed once, before
the first step and before a resume loads its weights: through the engine with the LoRA adapters
off (the base model) for a LoRA run, or on the initial weights for a full fine-tune, which are
the base model's too. They are stored in the run folder (``dpo_reference.pt``, written
atomically), so a resumed or redelivered run reads them instead of computing them again; the
file carries a fingerprint of the pairs' tokens, the base model and the compute dtype, and is
recomputed when any of them changed.

The batcher hands out padded tensors; a batch's rows find their reference values by their
tokens (a digest of each row's ids and labels), whatever order the batcher drew them in.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from engine.data.batches import collate_pairs
from engine.data.encode import Encoded, EncodedPair, load_pairs
from engine.errors import ConfigError
from engine.metrics import Sink
from engine.model.preference import PairStats
from engine.roundpipe import RoundPipe

REFERENCE_FILE = "dpo_reference.pt"


def row_key(input_ids: Any, labels: Any) -> bytes:
    """A digest of one sequence's ids and labels (lists or 1-D tensors, without padding)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).numpy().tobytes()
    lab = torch.as_tensor(labels, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(ids + b"|" + lab, digest_size=16).digest()


def _rows(pairs: list[EncodedPair]) -> list[Encoded]:
    return [r for p in pairs for r in (p.chosen, p.rejected)]


def load_preference_data(
    config: Any, tokenizer: Any, split: Any
) -> tuple[list[EncodedPair], list[EncodedPair]]:
    """The training and validation pairs of a DPO run (``config`` a ``TrainConfig``).

    Args:
        split: ``run.split_validation``, holding out ``data.validation_fraction`` of the pairs
            when there is no validation file.

    Raises:
        ConfigError: rows that are not preference rows (``data.train``/``data.validation``),
            invalid rows by line, ``data.packing`` (pairs are never packed) or
            ``hyper.router_aux_loss``.
    """
    data = config.data
    if config.hyper.router_aux_loss:
        raise ConfigError(
            "hyper.router_aux_loss",
            "hyper.router_aux_loss=true: not defined for DPO; set it to false",
            value=True,
        )
    if data.packing:
        raise ConfigError(
            "data.packing", "data.packing=true: DPO trains on whole pairs and cannot pack them", value=True
        )
    train = load_pairs(data.train, tokenizer, fmt=data.format, max_length=data.max_length)
    if data.validation:
        val = load_pairs(
            data.validation, tokenizer, fmt=data.format, max_length=data.max_length, field="data.validation"
        )
        return train, val
    held: tuple[list[EncodedPair], list[EncodedPair]] = split(
        train, data.validation_fraction, config.hyper.seed
    )
    return held


class PreferenceRun:
    """The pairs of a DPO run and their reference log-probabilities.

    Args:
        train: the training pairs (what the batcher draws from).
        validation: the validation pairs (may be empty).
        beta: the DPO temperature (``method.beta``).
        lora: the run trains a LoRA adapter: the reference is the base, its adapters off.
    """

    def __init__(
        self, train: list[EncodedPair], validation: list[EncodedPair], *, beta: float, lora: bool
    ) -> None:
        self.train = train
        self.validation = validation
        self.beta = beta
        self.lora = lora
        self.table: dict[bytes, float] = {}
        self.validation_logps = torch.empty(0)

    def fingerprint(self, *, base: str, compute_dtype: str) -> str:
        """What the reference values depend on: every row's tokens, the base model, the dtype."""
        h = hashlib.sha256(f"{base}|{compute_dtype}|{len(self.train)}|{len(self.validation)}".encode())
        for row in _rows(self.train) + _rows(self.validation):
            h.update(row_key(row.input_ids, row.labels))
        return h.hexdigest()

    def prepare(
        self,
        engine: RoundPipe,
        folder: Path,
        *,
        base: str,
        compute_dtype: str,
        batch_size: int,
        pad_id: int,
        sink: Sink,
    ) -> None:
        """Read the stored reference log-probabilities, or compute and store them.

        Call it before the engine resumes or takes a step: it computes on the initial weights.

        Raises:
            Cancelled: the run's cancel flag was set while computing.
        """
        path = folder / REFERENCE_FILE
        fingerprint = self.fingerprint(base=base, compute_dtype=compute_dtype)
        stored = _read(path)
        if stored is not None and stored.get("fingerprint") == fingerprint:
            train, val = stored["train"], stored["validation"]
            sink.event("reference", f"reference log-probabilities read from {REFERENCE_FILE}", {})
        else:
            started = time.perf_counter()
            train = self.reference_logps(engine, self.train, batch_size, pad_id)
            val = self.reference_logps(engine, self.validation, batch_size, pad_id)
            _write_atomic(path, {"fingerprint": fingerprint, "train": train, "validation": val})
            n = len(self.train) + len(self.validation)
            seconds = time.perf_counter() - started
            what = "the base model (adapters off)" if self.lora else "the initial weights"
            sink.event(
                "reference",
                f"reference log-probabilities of {n} pairs from {what} in {seconds:.1f} s",
                {"pairs": n, "seconds": seconds},
            )
        self.table = {
            row_key(row.input_ids, row.labels): float(v)
            for row, v in zip(_rows(self.train), train.tolist(), strict=True)
        }
        self.validation_logps = val

    def reference_logps(
        self, engine: RoundPipe, pairs: list[EncodedPair], batch_size: int, pad_id: int
    ) -> torch.Tensor:
        """``[2 * len(pairs)]`` the reference's log-probability of every row, in pair order."""
        parts = [torch.empty(0)]
        for i in range(0, len(pairs), batch_size):
            batch = collate_pairs(pairs[i : i + batch_size], pad_id)
            parts.append(engine.sequence_logps(**batch, adapters=not self.lora))
        return torch.cat(parts)

    def lookup(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[rows]`` the reference log-probabilities of a collated batch's rows."""
        out = []
        for ids, labels, mask in zip(
            batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True
        ):
            n = int(mask.sum())  # collate pads on the right
            key = row_key(ids[:n], labels[:n])
            if key not in self.table:
                raise RuntimeError("a training row has no reference log-probability (prepare() first)")
            out.append(self.table[key])
        return torch.tensor(out, dtype=torch.float32)

    def forward_backward(self, engine: RoundPipe, batch: dict[str, torch.Tensor]) -> PairStats:
        """Forward and backward of one training batch under the DPO loss."""
        return engine.forward_backward_dpo(**batch, reference_logps=self.lookup(batch), beta=self.beta)

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        """``loss/val`` and the validation pairs' reward accuracy and margin (None: no pairs)."""
        if not self.validation:
            return None
        sums = {"loss": 0.0, "reward_accuracy": 0.0, "reward_margin": 0.0}
        for i in range(0, len(self.validation), batch_size):
            chunk = self.validation[i : i + batch_size]
            batch = collate_pairs(chunk, pad_id)
            reference = self.validation_logps[2 * i : 2 * (i + len(chunk))]
            stats = engine.evaluate_dpo(**batch, reference_logps=reference, beta=self.beta)
            for k in sums:
                sums[k] += getattr(stats, k) * stats.pairs
        n = len(self.validation)
        return {
            "loss/val": sums["loss"] / n,
            "dpo/val_reward_accuracy": sums["reward_accuracy"] / n,
            "dpo/val_reward_margin": sums["reward_margin"] / n,
        }


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
    except Exception:  # a damaged file is computed again
        return None
    return data if isinstance(data, dict) else None


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
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
