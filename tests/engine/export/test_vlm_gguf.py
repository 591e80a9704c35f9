"""A vision-language model's GGUF export is refused, naming why (its vision tower and projector
would need llama.cpp's separate ``mmproj`` file, which is not written), before anything is merged
or written: in the format registry, the GGUF writer, the bundle and ``roundhouse export``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.commands.cli import main
from engine.export.bundle import export_gguf_folder
from engine.export.formats import CHECKPOINT, GGUF, MERGED
from engine.export.gguf_families import family_for, vlm_gguf_refusal
from engine.training.checkpoint_layout import CheckpointKind
from engine.vision.families import REFUSED_VLMS, VISION_FAMILIES
from tests.engine.tiny_vision import tiny_vlm, tiny_vlm_folder

WHY = "mmproj"


@pytest.mark.parametrize("architecture", [*VISION_FAMILIES, *REFUSED_VLMS])
def test_the_registry_refuses_a_vlm_s_gguf_naming_the_mmproj_file(architecture: str) -> None:
    for kind in (CheckpointKind.ADAPTER, CheckpointKind.FULL):
        refused = GGUF.refusal(kind=kind, architecture=architecture)
        assert refused is not None and WHY in refused and "vision-language model" in refused
        assert architecture in refused
    assert MERGED.refusal(kind=CheckpointKind.ADAPTER, architecture=architecture) is None
    assert CHECKPOINT.refusal(kind=CheckpointKind.FULL, architecture=architecture) is None


def test_the_writer_refuses_a_vlm_config_and_passes_a_text_one() -> None:
    config = tiny_vlm("qwen2_5_vl").config
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    with pytest.raises(ValueError, match=WHY):
        family_for(config)
    llava = {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}}
    assert WHY in (vlm_gguf_refusal(llava) or "")
    assert vlm_gguf_refusal({"architectures": ["LlamaForCausalLM"]}) is None


def test_a_vlm_folder_and_a_vlm_adapter_are_refused_before_any_work(tmp_path: Path) -> None:
    base = tiny_vlm_folder(tmp_path / "base", "idefics3")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=WHY):
        export_gguf_folder(base, out, quant="q8_0")
    assert not out.exists()  # nothing written
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))  # never read
    with pytest.raises(ValueError, match=WHY):
        export_gguf_folder(adapter, out, quant="q8_0", base=base)
    assert not out.exists()  # not merged


def test_roundhouse_export_refuses_a_vlm_s_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_vlm_folder(tmp_path / "model", "gemma3_vl")
    out = tmp_path / "gguf"
    assert main(["export", str(folder), "--out", str(out), "--gguf"]) == 2
    err = capsys.readouterr().err
    assert WHY in err and "Gemma3ForConditionalGeneration" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["model"]
