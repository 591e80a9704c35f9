"""Exports of a vision-language model: the adapter folder, the full model folder and the merged
folder carry the base's processor files, and the merged folder loads with ``load_model`` and
``load_processor_for`` and gives the logits of the weights the engine trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.export import copy_processor_files, merge_adapter, save_export
from engine.model.loading import load_model, load_processor_for
from engine.vision.pixels import open_image
from engine.vision.processing import PROCESSOR_FILES
from tests.engine.tiny import tiny_model, tiny_tokenizer
from tests.engine.tiny_vision import PLACEHOLDERS as PLACEHOLDER
from tests.engine.tiny_vision import VLM_FAMILIES, png, tiny_vlm_folder


def processor_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in PROCESSOR_FILES if (folder / name).is_file()}


def image_logits(model: Any, processor: Any, family: str) -> torch.Tensor:
    """The model's logits on two rows with images of different sizes, as its processor encodes them."""
    pictures = [open_image(png(16, 16, seed=1)), open_image(png(40, 24, seed=2))]
    texts = [f"what is {PLACEHOLDER[family]} this", f"and {PLACEHOLDER[family]}"]
    images: Any = pictures if family in ("qwen2_5_vl", "qwen3_vl") else [[p] for p in pictures]
    inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_merged_vlm_adapter_carries_its_processor_and_gives_the_trained_logits(
    family: str, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_vlm_folder(tmp_path / "base", family)
    wanted = processor_files(base)
    assert "preprocessor_config.json" in wanted
    processor = load_processor_for(base)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*(language_model|text_model).*\.(q_proj|v_proj|down_proj)"
    )
    trained = get_peft_model(load_model(base), lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # as if trained: the merge changes the logits
    weights = {k: v.detach().clone() for k, v in trained.state_dict().items() if "lora_" in k}
    adapter = tmp_path / "adapter"
    save_export(trained, weights, processor.tokenizer, adapter, base_name="org/tiny-vlm", base_folder=base)
    assert processor_files(adapter) == wanted  # the adapter runs on images on its base elsewhere
    merged = merge_adapter(adapter, base, tmp_path / "merged")
    assert processor_files(merged) == wanted
    reloaded, reloaded_processor = load_model(merged), load_processor_for(merged)
    assert type(reloaded).__name__ == type(trained.get_base_model()).__name__
    expected = image_logits(trained, processor, family)
    got = image_logits(reloaded, reloaded_processor, family)
    assert not torch.allclose(expected, image_logits(load_model(base), processor, family), atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_full_vlm_checkpoint_carries_its_processor_and_loads_as_trained(tmp_path: Path) -> None:
    family = "gemma3_vl"
    base = tiny_vlm_folder(tmp_path / "base", family)
    processor = load_processor_for(base)
    model = load_model(base)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    for key in weights:
        if "vision_tower" in key or "layers.0" in key:  # tower and language model both trained
            weights[key] = weights[key] + 0.05 * torch.randn_like(weights[key])
    folder = tmp_path / "full"
    save_export(model, weights, processor.tokenizer, folder, base_name="org/tiny-vlm", base_folder=base)
    assert processor_files(folder) == processor_files(base)
    model.load_state_dict(weights)
    reloaded = load_model(folder)
    torch.testing.assert_close(
        image_logits(reloaded, load_processor_for(folder), family), image_logits(model, processor, family)
    )


def test_a_text_model_gets_no_processor_files_and_the_tokenizer_s_own_stay(tmp_path: Path) -> None:
    text = tmp_path / "text"
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    save_export(
        model, model.state_dict(), tokenizer, text, base_name="org/t", base_folder=tmp_path / "nowhere"
    )
    # the tokenizer writes its own chat template; no image processor settings
    assert set(processor_files(text)) <= {"chat_template.jinja", "chat_template.json"}
    vlm = tiny_vlm_folder(tmp_path / "vlm", "qwen2_5_vl")
    (text / "chat_template.jinja").write_text("ours")
    copied = copy_processor_files(vlm, text)
    assert "preprocessor_config.json" in copied and "chat_template.jinja" not in copied
    assert (text / "chat_template.jinja").read_text() == "ours"
    assert copy_processor_files(None, text) == []
