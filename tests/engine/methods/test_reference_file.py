"""The stored reference pass (``engine.methods.reference_file``): computed once in pair order,
read back under the same fingerprint, computed again for another fingerprint or a file that does
not hold a value for every row; a batch's pairs find theirs by index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.batches import Batcher, collate_pairs
from engine.data.sequences import Encoded, EncodedPair
from engine.methods.reference_file import by_rows, fingerprint, stored_or_computed, write_reference
from engine.metrics import ListSink


class CountingEngine:
    """Stands in for the engine's ``sequence_logps``: each row's value is its first token id,
    negated; it records the batches it was asked for and whether the adapters were on."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def sequence_logps(self, *, input_ids: torch.Tensor, adapters: bool = True, **_: Any) -> torch.Tensor:
        self.calls.append((int(input_ids.shape[0]), adapters))
        return -input_ids[:, 0].float()


def pair(i: int, same: bool = False) -> EncodedPair:
    first = 5 if same else 10 + 2 * i
    chosen = Encoded(i + 1, [first, 1, 2], [-100, 1, 2], length=3, truncated=False)
    rejected = Encoded(i + 1, [first + 1, 3], [-100, 3], length=2, truncated=False)
    return EncodedPair(i + 1, chosen, rejected)


def compute(
    engine: Any, path: Path, sink: ListSink, train: list[EncodedPair], val: list[EncodedPair], **kw: Any
):
    key = fingerprint(train, val, base="tiny", compute_dtype="float32", **kw)
    return stored_or_computed(
        engine, path, key, train, val, batch_size=2, pad_id=0, lora=True, sink=sink, unit="rows"
    )


def test_values_are_computed_once_in_pair_order_and_read_back(tmp_path: Path) -> None:
    train, val = [pair(i) for i in range(5)], [pair(i) for i in range(5, 7)]
    engine, sink, path = CountingEngine(), ListSink(), tmp_path / "ref.pt"
    got_train, got_val = compute(engine, path, sink, train, val)
    assert got_train.tolist() == [-float(t) for i in range(5) for t in (10 + 2 * i, 11 + 2 * i)]
    assert got_val.tolist() == [-20.0, -21.0, -22.0, -23.0]
    # batch_size pairs at a time, the training pairs then the validation pairs, the adapters off
    assert engine.calls == [(4, False), (4, False), (2, False), (4, False)]
    assert sink.events[0][0] == "reference" and sink.events[0][2]["rows"] == 7
    assert "7 rows from the base model (adapters off)" in sink.events[0][1]

    again, sink = CountingEngine(), ListSink()
    read_train, read_val = compute(again, path, sink, train, val)
    assert again.calls == [] and sink.events == [
        ("reference", "reference log-probabilities read from ref.pt", {})
    ]
    assert torch.equal(read_train, got_train) and torch.equal(read_val, got_val)

    # another fingerprint (a mark changed) computes them again
    again = CountingEngine()
    compute(again, path, ListSink(), train, val, marks=[b"+"] * 6 + [b"-"])
    assert len(again.calls) == 4


def test_a_file_without_a_value_for_every_row_is_computed_again(tmp_path: Path) -> None:
    train, val = [pair(i) for i in range(3)], [pair(3)]
    path = tmp_path / "ref.pt"
    key = fingerprint(train, val, base="tiny", compute_dtype="float32")
    write_reference(path, {"fingerprint": key, "rows": torch.zeros(8)})  # another layout
    engine = CountingEngine()
    got_train, _ = compute(engine, path, ListSink(), train, val)
    assert engine.calls and got_train.shape == (6,)
    write_reference(path, {"fingerprint": key, "train": torch.zeros(4), "validation": torch.zeros(2)})
    engine = CountingEngine()
    compute(engine, path, ListSink(), train, val)
    assert engine.calls  # too few training values
    with pytest.raises(ValueError, match="3 marks for 4 pairs"):
        fingerprint(train, val, base="tiny", compute_dtype="float32", marks=[b"+"] * 3)


def test_a_served_batch_finds_its_pairs_values_by_index() -> None:
    # pairs of the same tokens stay apart: their values are found by index, not by their tokens
    pairs = [pair(i, same=i in (1, 4)) for i in range(6)]
    values = torch.arange(12, dtype=torch.float32)
    batcher = Batcher(pairs, 3, seed=2, pad_id=0)
    for _ in range(4):  # two epochs
        batch = batcher.next()
        rows = batch["rows"].tolist()
        assert torch.equal(batch["input_ids"], collate_pairs([pairs[i] for i in rows], 0)["input_ids"])
        assert by_rows(values, batch["rows"]).tolist() == [float(v) for i in rows for v in (2 * i, 2 * i + 1)]
    with pytest.raises(ValueError, match="2 row indices for 3 pairs"):
        collate_pairs(pairs[:3], 0, [0, 1])
