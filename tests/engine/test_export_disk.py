"""``roundhouse export`` onto a disk that fills: a real tmpfs mounted as the folder it writes
into, filled by a ballast file. An export that does not fit is refused before it writes, one whose
disk fills midway removes what it wrote; both end with exit status 2 and a line naming the folder,
the bytes needed and free, the checkpoint untouched. Once space is freed the same export works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.commands import cli
from engine.commands.cli import main
from tests.engine.tiny import tiny_model_folder
from tests.utils.filesystems import fill, small_disk

MiB = 1 << 20


def _checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A LoRA checkpoint of the tiny model (padded by 2 MB, so that a copy of it is large) with
    a resume state, and its base folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_folder(tmp_path / "tiny")
    folder = tmp_path / "run" / "step_000002"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    (folder / "padding.bin").write_bytes(os.urandom(2 * MiB))
    (folder / "state").mkdir()
    (folder / "state" / "engine.pt").write_bytes(b"resume state, not part of an export")
    return folder, base


def _snapshot(folder: Path) -> dict[str, bytes]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


@pytest.mark.parametrize("mode", ["copy", "merged", "gguf"])
def test_an_export_that_fills_the_disk_leaves_nothing_and_says_so(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, base = _checkpoint(tmp_path)
    before = _snapshot(checkpoint)
    options = {"copy": [], "merged": ["--merged"], "gguf": ["--gguf", "--quant", "q8_0"]}[mode]
    with small_disk(tmp_path / "disk", 8 * MiB) as disk:
        out = disk / "export"
        argv = ["export", str(checkpoint), "--out", str(out), "--base", str(base), *options]
        for midway in (False, True):  # refused before writing, or the disk fills midway
            if midway:  # the check up front passes: the writes themselves find no space
                monkeypatch.setattr(cli, "check_space", lambda out, needed: None)
            ballast = fill(disk, leave_bytes=32 * 1024)
            capsys.readouterr()
            assert main(argv) == 2
            said = capsys.readouterr().err.splitlines()[-1]  # after the progress bars
            assert said.startswith(f"roundhouse export: disk full: {out} needs "), said
            needed = int(said.split(" needs ", 1)[1].split(" bytes", 1)[0])
            free = int(said.split("), ", 1)[1].split(" bytes", 1)[0])
            assert free < needed, said
            assert sorted(p.name for p in disk.iterdir()) == ["ballast"]  # nothing partial
            assert _snapshot(checkpoint) == before
            ballast.unlink()
        monkeypatch.undo()
        assert main(argv) == 0, capsys.readouterr().err
        names = {p.name for p in out.iterdir()}
        expected = {"copy": "padding.bin", "merged": "config.json", "gguf": "Modelfile"}[mode]
        assert expected in names and "state" not in names, names
        assert sorted(p.name for p in disk.iterdir()) == ["export"]
    assert _snapshot(checkpoint) == before
