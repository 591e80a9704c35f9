"""``roundhouse plan`` of a vision-language model's run: the model folder's image processor and the
training rows' images (how many a row, their sizes, read as the run reads them) price the plan."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine.commands.cli import main
from engine.planner.vision import Tower
from tests.engine.tiny_vision import png, tiny_vlm_folder

# three rows: two images, one, none; widths 24, 40, 8 and heights 16, 40, 8: a mean image of 24x21
ROWS = [[(24, 16), (40, 40)], [(8, 8)], []]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def write_rows(path: Path) -> None:
    lines = []
    for i, sizes in enumerate(ROWS):
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"row {i}"}]
        parts += [{"type": "image_url", "image_url": {"url": data_url(png(w, h, seed=i))}} for w, h in sizes]
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")


def test_plan_of_a_vlm_run_reads_its_processor_and_its_rows_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_vlm_folder(tmp_path / "vlm", "qwen2_5_vl")
    write_rows(tmp_path / "rows.jsonl")
    run = {
        "model": {"path": str(folder)},
        "data": {"train": str(tmp_path / "rows.jsonl"), "max_length": 128},
        "method": {"kind": "lora", "vision_tower": "full"},
        "hyper": {"batch_size": 2, "max_steps": 3},
        "engine": {"num_microbatches": 1},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    argv = ["plan", "--config", str(tmp_path / "run.json"), "--workers", "1", "--host-ram-gb", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    tower = Tower.from_config(json.loads((folder / "config.json").read_text()), processor)
    assert tower is not None
    cost = tower.image(24, 21)
    line = next(x for x in out.splitlines() if x.startswith("vision: "))
    assert "(full)" in line and "1 image a row of 24x21 pixels" in line, line
    found = re.search(r"each ([\d,]+) patches and ([\d,]+) image tokens \(([\d,]+) a row\)", line)
    assert found, line
    assert [int(g.replace(",", "")) for g in found.groups()] == [cost.patches, cost.tokens, cost.tokens]
    assert "images a row: from the first 3 training rows" in out
    # the folder's processor, not the family's defaults: those cost another figure
    default = Tower.from_config(json.loads((folder / "config.json").read_text()))
    assert default is not None and default.image(24, 21).tokens != cost.tokens
    # without the training file no images are assumed, and the plan says so
    (tmp_path / "rows.jsonl").unlink()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0 images a row" in out and "images a row: none assumed (no data read)" in out
