"""Checkpoint writes on a disk that fills (a real tmpfs) and after a write killed midway: the
partial folder goes, the checkpoints before stay the ones a resume picks, ``DiskFull`` names the
path, the bytes needed and free."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.errors import DiskFull
from engine.training.checkpoint import write_checkpoint
from engine.training.checkpoint_layout import clear_leftovers, latest, list_checkpoints
from tests.utils.filesystems import fill, small_disk

MiB = 1 << 20


def _writer(size: int):
    def write(tmp: Path) -> None:
        (tmp / "state").mkdir()
        (tmp / "weights.bin").write_bytes(b"\1" * size)
        (tmp / "state" / "trainer.json").write_text("{}\n")

    return write


def test_a_checkpoint_that_fills_the_disk_is_removed_and_the_one_before_stays(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 8 * MiB) as disk:
        root = disk / "checkpoints"
        write_checkpoint(root, 1, _writer(2 * MiB), keep_last=5)
        # no size given: the write itself runs out of space
        with pytest.raises(DiskFull) as caught:
            write_checkpoint(root, 2, _writer(7 * MiB), keep_last=5)
        full = caught.value
        assert full.path == str(root / "step_000002") and full.free_bytes > 5 * MiB
        assert full.needed_bytes > full.free_bytes and str(full.path) in str(full)
        assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # nothing partial left
        assert latest(root) == (1, root / "step_000001")
        # given the size, it is refused before a byte is written, keeping the reserve free
        with pytest.raises(DiskFull) as refused:
            write_checkpoint(root, 2, _writer(MiB), keep_last=5, needed_bytes=MiB, reserve_bytes=5 * MiB)
        assert refused.value.needed_bytes == 7 * MiB and refused.value.free_bytes < 7 * MiB
        assert [s for s, _ in list_checkpoints(root)] == [1]
        # once there is room it goes on
        write_checkpoint(root, 2, _writer(MiB), keep_last=5, needed_bytes=MiB, reserve_bytes=MiB)
        assert [s for s, _ in list_checkpoints(root)] == [1, 2]


def test_a_full_disk_leaves_nothing_when_a_ballast_fills_it_first(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 4 * MiB) as disk:
        root = disk / "checkpoints"
        ballast = fill(disk, leave_bytes=MiB // 2)
        with pytest.raises(DiskFull):
            write_checkpoint(root, 1, _writer(MiB), keep_last=5)
        assert list(root.iterdir()) == []
        ballast.unlink()
        write_checkpoint(root, 1, _writer(MiB), keep_last=5)
        assert latest(root) is not None


def test_what_a_killed_write_left_is_cleared_and_a_moved_aside_checkpoint_comes_back(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 4, _writer(10), keep_last=5)
    write_checkpoint(root, 8, _writer(10), keep_last=5)
    # killed while writing step 12, and while replacing step 8 (moved aside, new one not in place)
    (root / ".step_000012.tmp" / "state").mkdir(parents=True)
    (root / "step_000008").rename(root / ".step_000008.old")
    (root / ".step_000002.pruned" / "state").mkdir(parents=True)  # and while pruning step 2
    assert latest(root) == (4, root / "step_000004")  # a torn or hidden one is never picked
    clear_leftovers(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000008"]
    shutil.rmtree(root / "step_000008" / "state")  # torn: no trainer.json, never a checkpoint
    assert latest(root) == (4, root / "step_000004")
