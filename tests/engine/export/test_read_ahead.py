"""The export's read-ahead: items in order, the producer's error raised to the consumer, the
reader stopped (and its source closed) when the consumer leaves early."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.export.read_ahead import Ahead


def test_ahead_yields_in_order_raises_and_stops_its_reader() -> None:
    assert list(Ahead(iter(range(5)))) == [0, 1, 2, 3, 4]

    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("bad tensor")

    got: list[int] = []
    with pytest.raises(ValueError, match="bad tensor"), Ahead(failing()) as items:
        got.extend(items)
    assert got == [1]

    closed = []

    def endless() -> Iterator[int]:
        try:
            n = 0
            while True:
                yield n
                n += 1
        finally:
            closed.append(True)

    with Ahead(endless(), depth=2) as items:
        assert next(items) == 0
    assert closed == [True]  # close() joined the reader, which closed the generator
