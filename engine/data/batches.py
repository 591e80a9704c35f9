"""Packing and batching: deterministic shuffles by seed, a resumable position. Preference pairs
batch as two rows each (chosen, then rejected); prompts (GRPO) as left-padded prompts and their
indices, whose completions the method samples. Rows with images batch with their image tensors
(``images``: one entry per row, made by a ``Pixels`` function such as
``engine.vision.pixels.row_pixels``'s)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.data.encode import Encoded, EncodedPair
from engine.data.prompts import PromptItem
from engine.errors import ConfigError

# one row's image bytes -> its image tensors (what the engine's vision layer takes for the row)
Pixels = Callable[[Sequence[bytes]], dict[str, torch.Tensor]]


def pack(examples: list[Encoded], max_length: int) -> list[Encoded]:
    """Concatenate examples, in order, into sequences of at most ``max_length`` tokens.

    Packed examples attend to each other (no block-diagonal mask); labels stay per example.
    """
    out: list[Encoded] = []
    ids: list[int] = []
    labels: list[int] = []
    images: tuple[bytes, ...] = ()
    first = examples[0].line if examples else 0
    for ex in examples:
        if ids and len(ids) + len(ex.input_ids) > max_length:
            out.append(Encoded(first, ids, labels, len(ids), False, images))
            ids, labels, images, first = [], [], (), ex.line
        ids = ids + ex.input_ids
        labels = labels + ex.labels
        images = images + ex.images
    if ids:
        n = len(ids)
        out.append(Encoded(first, ids[:max_length], labels[:max_length], n, n > max_length, images))
    return out


@dataclass
class Batcher:
    """Batches of ``batch_size`` examples; each epoch a permutation drawn from ``seed``.

    The last incomplete batch of an epoch is dropped. ``state_dict()`` records the position,
    so a resumed run sees exactly the batches it would have seen. Given preference pairs,
    ``batch_size`` counts pairs and each batch is ``collate_pairs``'s (2 × batch_size rows, and
    ``rows``, the pairs' indices).
    Rows with images need ``pixels`` (``collate``'s), which makes each row's image tensors.
    With ``repeat`` each batch is served that many times in a row (GRPO's ``num_iterations``:
    the steps that train on one batch of completions); an epoch is then ``repeat`` times as many
    steps, and ``position`` counts the steps served.
    """

    examples: list[Encoded] | list[EncodedPair] | list[PromptItem]
    batch_size: int
    seed: int
    pad_id: int
    epoch: int = 0
    position: int = 0
    repeat: int = 1
    pixels: Pixels | None = None

    def __post_init__(self) -> None:
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"Batcher: repeat={self.repeat!r} must be an integer >= 1")
        pairs = sum(isinstance(e, EncodedPair) for e in self.examples)
        if pairs not in (0, len(self.examples)):
            raise ValueError(
                f"Batcher: {pairs} of {len(self.examples)} examples are pairs (give all pairs or none)"
            )
        if len(self.examples) < self.batch_size:
            prompts = any(isinstance(e, PromptItem) for e in self.examples)
            what = "training pairs" if pairs else "training prompts" if prompts else "training examples"
            raise ConfigError(
                "hyper.batch_size",
                f"hyper.batch_size={self.batch_size} is larger than the {len(self.examples)} {what}",
                value=self.batch_size,
            )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size * self.repeat

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()

    def next(self) -> dict[str, Any]:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)
        index = self.position // self.repeat  # the batch's index in the epoch
        picked = order[index * self.batch_size : (index + 1) * self.batch_size]
        rows = [self.examples[i] for i in picked]
        self.position += 1
        prompts = [r for r in rows if isinstance(r, PromptItem)]
        if prompts:
            return collate_prompts(prompts, self.pad_id, picked)
        pairs = [r for r in rows if isinstance(r, EncodedPair)]
        if pairs:
            return collate_pairs(pairs, self.pad_id, picked)
        return collate([r for r in rows if isinstance(r, Encoded)], self.pad_id, pixels=self.pixels)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def collate(rows: list[Encoded], pad_id: int, pixels: Pixels | None = None) -> dict[str, Any]:
    """Right-pad rows to the longest: ``input_ids``, ``labels`` (-100 on padding), ``attention_mask``;
    and when a row has images, ``images``: one entry per row, None for a row without images, else
    ``pixels(row.images)``.

    Raises:
        ValueError: rows with images and no ``pixels``.
    """
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        labels[i, :n] = torch.tensor(r.labels)
        mask[i, :n] = 1
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if any(r.images for r in rows):
        if pixels is None:
            line = next(r.line for r in rows if r.images)
            raise ValueError(f"line {line}: a row with images, and no image processor to batch them")
        batch["images"] = [pixels(r.images) if r.images else None for r in rows]
    return batch


def collate_prompts(items: list[PromptItem], pad_id: int, rows: list[int]) -> dict[str, torch.Tensor]:
    """Prompts left-padded to the longest (``input_ids``, ``attention_mask``) and ``rows``, their
    indices among the run's prompts (GRPO samples their completions)."""
    width = max(len(p.input_ids) for p in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, p in enumerate(items):
        ids[i, width - len(p.input_ids) :] = torch.tensor(p.input_ids)
        mask[i, width - len(p.input_ids) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "rows": torch.tensor(rows, dtype=torch.long)}


def collate_pairs(
    pairs: list[EncodedPair], pad_id: int, rows: list[int] | range | None = None
) -> dict[str, torch.Tensor]:
    """Preference pairs as ``collate``'s 2B rows: row 2i is pair i's chosen sequence, 2i + 1 its
    rejected; with ``rows``, their indices among the run's pairs too (``[B]``: a method finds
    each pair's stored values by them)."""
    batch = collate([r for p in pairs for r in (p.chosen, p.rejected)], pad_id)
    if rows is not None:
        if len(rows) != len(pairs):
            raise ValueError(f"collate_pairs: {len(rows)} row indices for {len(pairs)} pairs")
        batch["rows"] = torch.tensor(list(rows), dtype=torch.long)
    return batch


def split_validation(examples: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Hold out ``fraction`` of the examples (at least one), chosen by ``seed``."""
    if fraction <= 0:
        return examples, []
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=g).tolist()
    n_val = max(1, round(fraction * len(examples)))
    held = set(order[:n_val])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]
