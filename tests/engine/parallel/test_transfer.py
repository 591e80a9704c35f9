"""Parameter windows (LPT with oversized tensors split first) and the CPU copy path."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.transfer import DeviceLink, plan_windows


def covered(windows, sizes) -> dict:
    seen: dict = {key: [] for key, _ in sizes}
    for w in windows:
        for p in w:
            seen[p.key].append((p.start, p.stop))
    return seen


def test_every_element_is_copied_exactly_once() -> None:
    sizes = [("a", 10), ("b", 1000), ("c", 7), ("d", 0), ("e", 333)]
    for n in range(1, 9):
        windows = plan_windows(sizes, n)
        assert len(windows) == n
        for key, size in sizes:
            spans = sorted(covered(windows, sizes)[key])
            pos = 0
            for a, b in spans:
                assert a == pos and b > a
                pos = b
            assert pos == size


def test_a_huge_tensor_is_split_and_the_windows_balance() -> None:
    # an LM head 20x bigger than a block's matrices lands in every window, not in one
    sizes = [("head", 2000), ("q", 100), ("k", 100), ("v", 100), ("o", 100)]
    windows = plan_windows(sizes, 4)
    loads = [sum(p.stop - p.start for p in w) for w in windows]
    assert sum(loads) == 2400
    assert max(loads) - min(loads) <= 100
    assert all(any(p.key == "head" for p in w) for w in windows)


def test_lpt_order_is_deterministic_and_largest_first() -> None:
    sizes = [("a", 5), ("b", 9), ("c", 7), ("d", 3)]
    windows = plan_windows(sizes, 2)
    # 24 elements, share 12: nothing split; LPT: b->w0, c->w1, a->w1, d->w0
    assert [[(p.key, p.start, p.stop) for p in w] for w in windows] == [
        [("b", 0, 9), ("d", 0, 3)],
        [("c", 0, 7), ("a", 0, 5)],
    ]
    assert plan_windows(sizes, 2) == windows


def test_bad_window_count() -> None:
    with pytest.raises(ValueError, match="num_windows must be >= 1, got 0"):
        plan_windows([("a", 1)], 0)
    with pytest.raises(ValueError, match="negative size -3"):
        plan_windows([("a", -3)], 1)


def test_cpu_link_copies_pieces_into_its_own_buffer() -> None:
    link = DeviceLink(torch.device("cpu"))
    host = torch.arange(10, dtype=torch.float32)
    dev = link.empty_like(host)
    for window in plan_windows([("x", 10)], 3):
        link.copy_pieces([(host, dev, p.start, p.stop) for p in window], None)
    assert torch.equal(dev, host)
    assert dev.data_ptr() != host.data_ptr()
    out, event = link.download(dev)
    assert event is None and torch.equal(out, host)
