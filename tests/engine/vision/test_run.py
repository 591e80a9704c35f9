"""A VLM fine-tune end to end through ``train()``: OpenAI vision rows with images of several
sizes and a text row, validation, checkpoints, a resume that is bitwise the uninterrupted run,
and exports that load back with the tower's trained weights."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import TrainConfig
from engine.training.checkpoint import load_state
from engine.training.run import train
from tests.engine.tiny_vision import png, tiny_vlm_folder

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def picture(colour: str, width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()


def rows() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(12):
        colour = list(COLOURS)[i % 3]
        size = [(24, 16), (16, 16), (40, 30), (20, 36)][i % 4]
        url = "data:image/png;base64," + base64.b64encode(picture(colour, *size)).decode()
        out.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what colour? "},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    },
                    {"role": "assistant", "content": colour},
                ]
            }
        )
    out.append({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]})
    return out


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl", "idefics3"])
def workspace(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, str]:
    tiny_vlm_folder(tmp_path / "model", request.param)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return tmp_path, request.param


def config(d: Path, out: str, **method: Any) -> TrainConfig:
    return TrainConfig.parse(
        {
            "model": {"path": str(d / "model"), "name": "tiny-vlm"},
            "data": {"train": str(d / "train.jsonl"), "validation_fraction": 0.25, "max_length": 128},
            "method": {"tuning": "lora", "lora_r": 4, "lora_alpha": 8, **method},
            # a constant rate: a run cut at step 2 then continued to 4 sees the same rates
            "hyper": {
                "max_steps": 4,
                "batch_size": 3,
                "learning_rate": 5e-3,
                "schedule": "constant",
                "warmup_steps": 0,
            },
            "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2},
            "checkpoint": {"every_steps": 2, "keep_last": 5},
            "eval": {"every_steps": 2},
            "output_dir": str(d / out),
        }
    )


def test_a_vlm_trains_validates_and_resumes_bitwise(workspace: tuple[Path, str]) -> None:
    d, _ = workspace
    whole = train(config(d, "whole", vision_tower="full", projector="full"))
    assert whole.status == "succeeded" and whole.step == 4
    assert "loss/val" in whole.metrics and torch.isfinite(torch.tensor(whole.metrics["loss/val"]))
    # stopped after step 2, then resumed from its checkpoint: the same bits as the whole run
    halted = d / "halted"
    cfg = config(d, "halted", vision_tower="full", projector="full")
    cfg.hyper.max_steps = 2
    train(cfg)
    cfg.hyper.max_steps = 4
    resumed = train(cfg)
    assert resumed.step == 4
    assert whole.checkpoint is not None and resumed.checkpoint is not None
    a = load_state(whole.checkpoint)[0]["masters"]
    b = load_state(resumed.checkpoint)[0]["masters"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the tower trained (its weights are in the adapter's saved modules)
    assert any("visual" in k or "vision_model" in k for k in a), sorted(a)[:5]
    assert halted.is_dir()


def test_image_data_for_a_text_model_is_refused_naming_the_data(tmp_path: Path) -> None:
    from engine.errors import ConfigError
    from tests.engine.tiny import tiny_model_folder

    tiny_model_folder(tmp_path / "model", "llama")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    with pytest.raises(ConfigError) as info:
        train(config(tmp_path, "out"))
    assert "image" in str(info.value)


def test_png_sizes_differ() -> None:
    assert png(24, 16) != png(16, 24)


def test_a_tower_trained_whole_around_its_frozen_projector_saves_and_loads(tmp_path: Path) -> None:
    """Qwen2.5-VL's projector sits inside its tower: trained whole (peft's modules_to_save), the
    tower is saved with the frozen projector in it, unchanged, and the adapter loads back."""
    from safetensors.torch import load_file

    from engine.inference.generate import load_for_inference

    tiny_vlm_folder(tmp_path / "model", "qwen2_5_vl")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    cfg = config(tmp_path, "out", vision_tower="full", projector="frozen")
    cfg.hyper.max_steps = 2
    result = train(cfg)
    assert result.status == "succeeded" and result.checkpoint is not None
    saved = load_file(result.checkpoint / "adapter_model.safetensors")
    base = load_file(tmp_path / "model" / "model.safetensors")

    def stored(key: str) -> torch.Tensor:  # the base folder keeps the tower as "visual.*"
        return base[key.replace("base_model.model.model.", "")]

    merger = {k: v for k, v in saved.items() if ".visual.merger." in k}
    assert merger and all(torch.equal(v, stored(k)) for k, v in merger.items())
    blocks = [k for k in saved if ".visual.blocks." in k]
    assert any(not torch.equal(saved[k], stored(k)) for k in blocks)
    model, _ = load_for_inference(tmp_path / "model", adapter=result.checkpoint)
    assert type(model.get_base_model()).__name__ == "Qwen2_5_VLForConditionalGeneration"
