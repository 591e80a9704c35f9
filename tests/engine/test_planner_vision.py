"""The planner on vision-language models: the tower's and the projector's weights in the input
layer (against the real tiny models, parameter for parameter), an image's patches, tokens and
pixel values (against the families' own processors), and the predicted host bytes against what
the engine's host state holds after a step on a batch of images."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, RoundPipe
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.planner import Hardware, Shape, Workload, layer_times, memory_model, plan_job
from engine.planner.fit import trainable_per_layer
from engine.planner.vision import Tower
from engine.training.run import tuned
from engine.vision.families import vision_spec
from engine.vision.pixels import open_image, row_pixels
from tests.engine.tiny_vision import PLACEHOLDERS, VLM_FAMILIES, png, tiny_processor, tiny_vlm

SIZES = [(16, 16), (40, 24), (7, 30), (100, 9)]
FLAT = ("qwen2_5_vl", "qwen3_vl")  # the families whose processors take a flat list of images


def config_of(model: Any) -> dict[str, Any]:
    return model.config.to_dict() | {"architectures": [type(model).__name__]}


def processor_settings(processor: Any, tmp_path: Path) -> dict[str, Any]:
    """The image processor's ``preprocessor_config.json``, as a model folder holds it."""
    processor.image_processor.save_pretrained(tmp_path)
    return json.loads((tmp_path / "preprocessor_config.json").read_text())  # type: ignore[no-any-return]


def image_token_id(model: Any) -> int:
    return int(getattr(model.config, vision_spec(type(model).__name__).image_token))  # type: ignore[union-attr]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_tower_and_projector_weights_are_the_model_s(family: str) -> None:
    model = tiny_vlm(family)
    spec = vision_spec(type(model).__name__)
    assert spec is not None
    tower, projector = attrgetter(spec.tower, spec.projector)(model)
    projector_params = sum(p.numel() for p in projector.parameters())
    tower_params = sum(p.numel() for p in tower.parameters())
    if any(m is projector for m in tower.modules()):  # Qwen2.5-VL's merger sits in its tower
        tower_params -= projector_params
    shape = Shape.from_config(config_of(model))
    assert shape.tower is not None
    assert (shape.tower.tower_params, shape.tower.projector_params) == (tower_params, projector_params)
    # every weight of the model, in its engine layers: the input layer holds the tower too
    assert sum(shape.layer_params()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_an_image_s_patches_tokens_and_pixels_are_the_processor_s(family: str, tmp_path: Path) -> None:
    model, processor = tiny_vlm(family), tiny_processor(family)
    tower = Tower.from_config(config_of(model), processor_settings(processor, tmp_path))
    assert tower is not None
    arch = type(model).__name__
    for width, height in SIZES:
        image = png(width, height)
        text = f"look {PLACEHOLDERS[family]} here"
        pil = open_image(image)
        out = processor(text=[text], images=[pil] if family in FLAT else [[pil]], return_tensors="pt")
        tokens = int((out["input_ids"] == image_token_id(model)).sum())
        pixels = row_pixels(processor, arch)([image])["pixel_values"]
        cost = tower.image(width, height)
        assert (cost.tokens, cost.pixel_values) == (tokens, pixels.numel()), (width, height)


def test_the_defaults_without_a_processor_are_the_families_published_ones() -> None:
    # Qwen2.5-VL-3B's vision config: 14-pixel patches merged 2x2; a 448x448 image is 256 tokens
    qwen = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {"hidden_size": 2048},
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
    }
    tower = Tower.from_config(qwen)
    assert tower is not None
    assert tower.image(448, 448).tokens == 256 and tower.image(448, 448).patches == 1024
    assert 640e6 < tower.params < 680e6  # Qwen2.5-VL's 670M-parameter vision encoder
    # its config.json on the Hub holds the text sizes at the top, without a text_config
    flat = {k: v for k, v in qwen.items() if k != "text_config"} | {"hidden_size": 2048}
    assert Tower.from_config(flat) == tower
    # Gemma 3's SigLIP at 896 pixels, pooled to 256 tokens whatever the image
    gemma = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560},
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    tower = Tower.from_config(gemma)
    assert tower is not None and tower.image(100, 3000).tokens == 256
    assert 410e6 < tower.tower_params < 420e6  # SigLIP-So400m without its head


def test_bad_vision_sizes_name_the_field() -> None:
    config = config_of(tiny_vlm("idefics3"))
    config["vision_config"]["patch_size"] = 0
    with pytest.raises(ConfigError, match=r"vision_config\.patch_size") as caught:
        Shape.from_config(config)
    assert caught.value.field == "vision_config.patch_size"
    box = Hardware(num_gpus=1, gpu_memory_gb=24.0)
    with pytest.raises(ConfigError, match="vision_tower"):
        plan_job(config_of(tiny_vlm("gemma3_vl")), box, Workload(vision_tower="half"))
    with pytest.raises(ConfigError, match="image_size"):
        plan_job(config_of(tiny_vlm("gemma3_vl")), box, Workload(image_size=(0, 10)))


def test_images_cost_time_and_memory_and_too_many_image_tokens_do_not_fit(tmp_path: Path) -> None:
    model, processor = tiny_vlm("qwen2_5_vl"), tiny_processor("qwen2_5_vl")
    config, settings = config_of(model), processor_settings(processor, tmp_path)
    shape = Shape.from_config(config, processor=settings)
    box = Hardware(num_gpus=1, gpu_memory_gb=24.0)
    job = Workload(method="full", seq_len=64, batch_size=4, num_microbatches=2, compute_dtype="float32")
    frozen = replace(job, images_per_row=2.0, image_size=(16, 16))
    trained = replace(frozen, vision_tower="full", projector="full")
    text_time, frozen_time, trained_time = (layer_times(shape, w, box)[0] for w in (job, frozen, trained))
    assert text_time == (0.0, 0.0)  # the embedding lookup
    assert frozen_time[0] > 0 and frozen_time[1] == 0  # the tower's forward, no backward through it
    assert trained_time[0] == frozen_time[0] and trained_time[1] == pytest.approx(2 * trained_time[0])
    per_layer = [trainable_per_layer(shape, w) for w in (frozen, trained)]
    frozen_memory, trained_memory = (
        memory_model(shape, w, box, t) for w, t in zip((frozen, trained), per_layer, strict=True)
    )
    assert frozen_memory.activations[0] == 0 < trained_memory.activations[0]  # kept for its backward
    reports = [plan_job(config, box, w, processor=settings) for w in (job, frozen, trained)]
    assert [r.assumptions["vision"]["image_tokens_per_row"] for r in reports] == [0, 8, 8]  # 2 images of 4
    assert reports[2].trainable - reports[1].trainable == shape.tower.params  # type: ignore[union-attr]
    assert reports[1].host_ram["images_gb"] == pytest.approx(4 * 2 * 1536 * 4 / 1e9)  # fp32 pixel values
    assert "vision: tower" in reports[1].describe()
    too_many = plan_job(
        config, box, replace(job, images_per_row=20.0, image_size=(32, 32)), processor=settings
    )
    assert not too_many.fits and "image tokens, more than seq_len=64" in too_many.problems[0]


# (family, tuning, tower, projector): what the run trains, as ``method`` says it
TUNED = [
    ("qwen2_5_vl", "full", "frozen", "frozen"),
    ("gemma3_vl", "full", "full", "full"),
    ("idefics3", "full", "frozen", "full"),
    ("qwen2_5_vl", "lora", "lora", "lora"),
    ("qwen2_5_vl", "lora", "full", "frozen"),  # the tower copied whole, its merger in it
    ("idefics3", "lora", "full", "full"),
    ("gemma3_vl", "lora", "frozen", "full"),
]


@pytest.mark.parametrize(("family", "tuning", "tower", "projector"), TUNED)
def test_predicted_host_bytes_are_what_the_engine_holds_after_a_step(
    family: str, tuning: str, tower: str, projector: str, tmp_path: Path
) -> None:
    options = {"kind": tuning, "lora_r": 4, "vision_tower": tower, "projector": projector}
    run = {"model": {"path": "tiny"}, "data": {"train": "rows.jsonl"}, "method": options}
    model, processor = tiny_vlm(family), tiny_processor(family)
    arch = type(model).__name__
    tuned_model = tuned(copy.deepcopy(model), TrainConfig.model_validate(run).method)  # as the run does
    rows, sizes = 4, [(16, 16), (24, 40), (40, 24), (16, 16)]
    images = [png(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    texts = [f"row {i} {PLACEHOLDERS[family]} says {'x' * (3 * i)}" for i in range(rows)]
    pils = [open_image(b) for b in images]
    batch = processor(
        text=texts,
        images=pils if family in FLAT else [[p] for p in pils],
        return_tensors="pt",
        padding=True,
    )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    pixels = row_pixels(processor, arch)
    with RoundPipe(tuned_model, EngineConfig(devices=["cpu"], num_microbatches=2)) as rp:
        rp.forward_backward(
            input_ids=ids, labels=labels, attention_mask=mask, images=[pixels([b]) for b in images]
        )
        rp.step()
        rp.synchronize()
        weights = sum(t.compute.numel() * t.compute.element_size() for t in rp.host.tensors)
        optimizer = 0
        for t in rp.host.trainable:
            assert t.master is not None and t.master.grad is not None
            optimizer += t.master.numel() * t.master.element_size() + t.master.grad.numel() * 4
        for owner in rp.optimizer.optimizers.values():
            for state in owner.state.values():
                optimizer += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
    width = sum(w for w, _ in sizes) // rows, sum(h for _, h in sizes) // rows
    job = Workload(
        method=tuning,
        lora_r=4,
        compute_dtype="float32",
        batch_size=rows,
        num_microbatches=2,
        seq_len=int(ids.shape[1]),
        vision_tower=tower,
        projector=projector,
        images_per_row=1.0,
        image_size=width,
    )
    report = plan_job(
        config_of(model),
        Hardware(num_gpus=1, gpu_memory_gb=24.0),
        job,
        processor=processor_settings(processor, tmp_path),
    )
    # every weight, the tower's and the projector's too (and a LoRA run's copies of a part it
    # trains whole); the engine also holds the towers' buffers (Qwen2.5-VL's rotary frequencies,
    # SigLIP's position ids, twice with a copy), which the planner does not count: a few hundred bytes
    assert 0 <= weights - report.host_ram["weights_gb"] * 1e9 <= 512
    assert report.host_ram["optimizer_gb"] * 1e9 == pytest.approx(optimizer, rel=1e-9)
    measured = weights + optimizer
    predicted = (report.host_ram["weights_gb"] + report.host_ram["optimizer_gb"]) * 1e9
    assert abs(predicted - measured) <= 0.1 * measured


def test_the_workload_of_a_vlm_run_takes_its_tower_settings_and_the_data_s_images() -> None:
    options = {"kind": "lora", "vision_tower": "lora", "projector": "full"}
    config = TrainConfig.model_validate(
        {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "method": options}
    )
    job = Workload.from_train_config(config, image_counts=[1, 2, 3, 2], image_sizes=[(10, 20), (30, 40)])
    assert (job.vision_tower, job.projector) == ("lora", "full")
    assert job.images_per_row == 2.0 and job.image_size == (20, 30)
    plain = Workload.from_train_config(config)
    assert plain.images_per_row == 0 and plain.image_size == Workload().image_size
