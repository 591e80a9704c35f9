"""The checkpoint folder layout (``engine.training.checkpoint_layout``): step names and their
parsing, the store's keys, what a download leaves out, keep-last pruning, and no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.training import checkpoint_layout as layout
from engine.training.checkpoint_layout import CheckpointKind, Hidden


def checkpoint(root: Path, step: int, *, complete: bool = True, adapter: bool = True) -> Path:
    folder = root / layout.step_name(step)
    (folder / layout.STATE_DIR).mkdir(parents=True)
    (folder / ("adapter_model.safetensors" if adapter else "model.safetensors")).write_bytes(b"w" * 10)
    if adapter:
        (folder / layout.ADAPTER_CONFIG).write_text("{}")
    if complete:
        layout.trainer_file(folder).write_text(json.dumps({"step": step, "base_model": "/models/tiny"}))
    return folder


def test_step_names_parse_back_and_nothing_else_parses() -> None:
    for step in (0, 7, 123456, 1234567):
        assert layout.parse_step(layout.step_name(step)) == step
    assert layout.step_name(42) == "step_000042"
    assert layout.parse_step("runs/j1/checkpoints/step_000042") == 42  # a key or a path
    for other in ("step_42", "step_000042-merged", ".step_000042.tmp", "steps_000042", "state", ""):
        assert layout.parse_step(other) is None, other
    with pytest.raises(ValueError, match="step"):
        layout.step_name(-1)


def test_keys_of_a_job_s_checkpoints() -> None:
    assert layout.checkpoints_key("runs/j1") == "runs/j1/checkpoints"
    assert layout.checkpoint_key("runs/j1/", 3) == "runs/j1/checkpoints/step_000003"
    assert layout.run_of_key("runs/j1/checkpoints/step_000003") == ("runs/j1", 3)
    assert layout.run_of_key("/home/x/runs/j1/checkpoints/step_000003") == ("/home/x/runs/j1", 3)
    assert layout.run_of_key("runs/j1/exports/step_000003") is None
    assert layout.run_of_key("runs/j1/checkpoints/latest") is None


def test_hidden_names_round_trip() -> None:
    for suffix in Hidden:
        assert layout.parse_hidden(layout.hidden_name(5, suffix)) == ("step_000005", suffix)
    assert layout.parse_hidden("step_000005") is None
    assert layout.parse_hidden(".step_000005.partial") is None


@pytest.mark.parametrize(
    ("steps", "keep_last", "dropped"),
    [
        ([1, 2, 3, 5], 2, [1, 2]),
        ([5, 1, 3, 2], 1, [1, 2, 3]),  # by step, whatever the order given
        ({1, 2}, 5, []),
        ([1, 2, 3], 0, []),  # below 1: every checkpoint is kept
        ([], 3, []),
    ],
)
def test_keep_last_drops_the_oldest(steps: list[int], keep_last: int, dropped: list[int]) -> None:
    assert layout.pruned_steps(steps, keep_last) == dropped


def test_prune_removes_the_oldest_complete_checkpoints_only(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint(tmp_path, step)
    torn = checkpoint(tmp_path, 4, complete=False)  # a write that never finished: not a checkpoint
    assert [s for s, _ in layout.list_checkpoints(tmp_path)] == [1, 2, 3]
    assert layout.prune(tmp_path, 2) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003", torn.name]
    assert layout.latest(tmp_path) == (3, tmp_path / "step_000003")
    assert layout.latest(tmp_path / "none") is None and layout.list_checkpoints(tmp_path / "none") == []


def test_leftovers_of_a_killed_write_are_cleared(tmp_path: Path) -> None:
    kept = checkpoint(tmp_path, 1)
    (tmp_path / layout.hidden_name(2, Hidden.TMP)).mkdir()
    (tmp_path / layout.hidden_name(3, Hidden.PRUNED)).mkdir()
    (tmp_path / layout.hidden_name(1, Hidden.OLD)).mkdir()  # replaced already: goes
    moved_aside = tmp_path / layout.hidden_name(4, Hidden.OLD)  # its replacement never came: back
    checkpoint(tmp_path, 4).rename(moved_aside)
    layout.clear_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name, "step_000004"]
    assert layout.is_complete(tmp_path / "step_000004")


def test_what_a_download_holds(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, 2)
    (folder / "evaluations").mkdir()
    (folder / "evaluations" / "e1.json").write_text("{}")
    (folder / "sub" / "state").mkdir(parents=True)  # a nested folder named state is no resume state
    (folder / "sub" / "state" / "x").write_text("x")
    names = [p.relative_to(folder).as_posix() for p in layout.export_files(folder)]
    assert names == ["adapter_config.json", "adapter_model.safetensors", "evaluations/e1.json", "sub/state/x"]
    assert not layout.in_download("state/trainer.json") and layout.in_download("config.json")
    assert layout.folder_bytes(folder) == sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_kind_and_recorded_state(tmp_path: Path) -> None:
    adapter, full = checkpoint(tmp_path, 1), checkpoint(tmp_path, 2, adapter=False)
    assert (layout.kind_of(adapter), layout.kind_of(full)) == (CheckpointKind.ADAPTER, CheckpointKind.FULL)
    assert layout.read_trainer_state(adapter) == {"step": 1, "base_model": "/models/tiny"}
    assert layout.read_trainer_state(checkpoint(tmp_path, 3, complete=False)) is None
    layout.trainer_file(full).write_text("not json")
    assert layout.read_trainer_state(full) is None


def test_the_layout_imports_no_torch() -> None:
    code = "import sys, engine.training.checkpoint_layout; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
