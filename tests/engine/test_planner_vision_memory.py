"""An image-heavy batch fits its plan: a small Qwen2.5-VL (a 2-block vision tower of width 64 over
14-pixel patches, a tiny language model) trains one step on 4 rows of 4 images of 224x224 pixels
each (4,096 patches, 1,024 image tokens) through RoundPipe on one CPU worker, and what it holds is
within 10% of the plan:

- host bytes: the compute copy of every weight, and the fp32 masters, gradients and optimizer
  state of what trains (``PlanReport.host_ram``);
- the input layer's activations: the bytes autograd saves in the tower and the projector over the
  micro-batch's patches (``torch.autograd.graph.saved_tensors_hooks``, unique storages, the
  weights left out), against the planner's ``activations`` term of the input layer, for the tower
  trained and for the projector alone; the same for each family's tower at a width and depth the
  planner's coefficients were not read from, in fp32 and bf16;
- the step's peak: the growth of the process's resident memory during one ``forward_backward``
  (``VmHWM`` reset through ``/proc/self/clear_refs``, minus ``VmRSS`` before, in a fresh process
  with ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB so freed tensors leave the resident set, as
  ``bench/planner_memory.py`` measures text runs), against the planner's terms of that stage less
  its weights and the micro-batch's pixel values (a CPU worker computes on the host's compute copy
  and reads the pixel values where the host holds them: nothing is uploaded).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.planner import Hardware, Shape, Workload, memory_model, plan_job
from engine.planner.fit import trainable_per_layer
from engine.scheduling.partition import Plan
from tests.engine.tiny_vision import VLM_FAMILIES, _config, png, tiny_processor, tiny_vlm, vision_tokenizer
from tests.utils import ROOT

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs"
)
ARCH = "Qwen2_5_VLForConditionalGeneration"
ROWS, IMAGES, EDGE = 4, 4, 224  # 4 rows of 4 images of 224x224: 256 patches, 64 tokens each
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, window_size=112)
PIXELS: dict[str, Any] = dict(
    patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=EDGE * EDGE
)
TOLERANCE = 0.10


def heavy_vlm() -> Any:
    """The small Qwen2.5-VL in train mode (the tiny one's language model, a wider tower)."""
    import torch
    import transformers

    config = _config("qwen2_5_vl", vision_tokenizer("qwen2_5_vl"), 2)
    vision = config.vision_config.to_dict() | VISION | {"fullatt_block_indexes": [1]}
    config.vision_config = type(config.vision_config)(**vision)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model.train()
    return model


def heavy_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from engine.vision.processing import build_processor

    return build_processor(ARCH, Qwen2VLImageProcessorPil(**PIXELS), vision_tokenizer("qwen2_5_vl"))


def heavy_batch() -> dict[str, Any]:
    """The rows as the engine takes them: ids, labels, mask and each row's image tensors."""
    from engine.vision.pixels import open_image, row_pixels

    processor = heavy_processor()
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    rows = [[png(EDGE, EDGE, seed=IMAGES * r + k) for k in range(IMAGES)] for r in range(ROWS)]
    texts = [f"row {r}: " + " and ".join([placeholder] * IMAGES) + " say" + "s" * r for r in range(ROWS)]
    batch = processor(
        text=texts, images=[open_image(b) for row in rows for b in row], return_tensors="pt", padding=True
    )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pixels = row_pixels(processor, ARCH)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
        "images": [pixels(row) for row in rows],
    }


def workload(seq_len: int, *, tower: str, projector: str = "full") -> Workload:
    return Workload(
        method="full",
        compute_dtype="float32",
        seq_len=seq_len,
        batch_size=ROWS,
        num_microbatches=1,
        vision_tower=tower,
        projector=projector,
        images_per_row=float(IMAGES),
        image_size=(EDGE, EDGE),
    )


def settings(tmp_path: Path) -> dict[str, Any]:
    heavy_processor().image_processor.save_pretrained(tmp_path)
    return json.loads((tmp_path / "preprocessor_config.json").read_text())  # type: ignore[no-any-return]


def config_of(model: Any) -> dict[str, Any]:
    return model.config.to_dict() | {"architectures": [ARCH]}


def engine_config() -> Any:
    from engine import EngineConfig

    layers = 2 + 2  # the input layer, 2 blocks, the output layer: one fused stage
    return EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        partition={"forward": [], "fused": layers, "backward": []},
        calibration_steps=0,
        compute_dtype="float32",
    )


def tuned_vlm(tower: str, projector: str) -> Any:
    from engine.config import TrainConfig
    from engine.training.run import tuned

    method = {"kind": "full", "vision_tower": tower, "projector": projector}
    run = TrainConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "method": method})
    return tuned(heavy_vlm(), run.method)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child() -> dict[str, int]:
    """One step's resident growth on one CPU worker, the tower and projector trained (run in a
    fresh process: ``python -c``)."""
    from engine import RoundPipe

    batch = heavy_batch()
    with RoundPipe(tuned_vlm("full", "full"), engine_config()) as rp:
        # a first step makes the buffers the engine creates lazily (gradients, optimizer state)
        rp.forward_backward(**batch)
        rp.step()
        rp.synchronize()
        gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        rp.forward_backward(**batch)
        rp.synchronize()
        peak = _status("VmHWM")
    return {"growth": peak - before, "seq_len": int(batch["input_ids"].shape[1])}


def test_an_image_heavy_batch_holds_what_the_plan_says_on_the_host(tmp_path: Path) -> None:
    from engine import RoundPipe

    batch = heavy_batch()
    seq_len = int(batch["input_ids"].shape[1])
    assert sum(int(p["pixel_values"].shape[0]) for p in batch["images"]) == ROWS * IMAGES * 256
    with RoundPipe(tuned_vlm("full", "full"), engine_config()) as rp:
        rp.forward_backward(**batch)
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
    box = Hardware.cpu_host(cores=2, ram_gb=16.0)
    report = plan_job(
        config_of(heavy_vlm()), box, workload(seq_len, tower="full"), processor=settings(tmp_path)
    )
    vision = report.assumptions["vision"]
    assert (vision["patches_per_image"], vision["image_tokens_per_image"]) == (256, 64)
    assert report.fits
    predicted = (report.host_ram["weights_gb"] + report.host_ram["optimizer_gb"]) * 1e9
    assert abs(predicted - (weights + optimizer)) <= TOLERANCE * (weights + optimizer)


@pytest.mark.parametrize(("tower", "projector"), [("full", "full"), ("frozen", "full")])
def test_the_input_layer_keeps_the_activations_the_plan_says(
    tower: str, projector: str, tmp_path: Path
) -> None:
    import torch

    model = tuned_vlm(tower, projector)
    visual = model.model.visual  # Qwen2.5-VL's tower holds its projector (the merger)
    batch = heavy_batch()
    images = {k: torch.cat([row[k] for row in batch["images"]]) for k in batch["images"][0]}
    skip = {t.untyped_storage().data_ptr() for t in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # what the engine's input layer runs on a micro-batch's images (``engine.vision.layer``)
        out = visual(images["pixel_values"], grid_thw=images["image_grid_thw"])
    features = getattr(out, "pooler_output", out)
    assert features.shape[0] == ROWS * IMAGES * 64
    measured = sum(kept.values())
    job = workload(int(batch["input_ids"].shape[1]), tower=tower, projector=projector)
    shape = Shape.from_config(config_of(model), processor=settings(tmp_path))
    memory = memory_model(shape, job, Hardware(gpu_memory_gb=64.0), trainable_per_layer(shape, job))
    predicted = memory.activations[0]
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


def test_an_image_heavy_step_peaks_where_the_plan_says(tmp_path: Path) -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    code = (
        "import json; from tests.engine.test_planner_vision_memory import child; print(json.dumps(child()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    step = json.loads(done.stdout.strip().splitlines()[-1])
    job = workload(step["seq_len"], tower="full")
    model = heavy_vlm()
    shape = Shape.from_config(config_of(model), processor=settings(tmp_path))
    memory = memory_model(shape, job, Hardware(gpu_memory_gb=64.0), trainable_per_layer(shape, job))
    layers = shape.layers + 2
    terms = memory.stage_terms(Plan.from_counts(layers, forward=[], fused=layers, backward=[]), 0, 1)
    # one step queues no next stage; a CPU worker computes on the host's copy of the weights and
    # reads the micro-batch's pixel values where the host holds them (a GPU worker uploads both)
    cost = shape.tower.image(EDGE, EDGE)  # type: ignore[union-attr]
    pixels = ROWS * IMAGES * cost.pixel_values * 4
    predicted = terms["total"] - terms["prefetch"] - terms["weights"] - pixels
    assert abs(predicted - step["growth"]) <= TOLERANCE * step["growth"], (terms, step)


def saved_image_bytes(model: Any, images: dict[str, Any]) -> int:
    """Bytes autograd saves running the family's tower and projector over ``images`` (the weights
    and the pixel values left out), as the engine's input layer runs them."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *images.values()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    inner, pixels = model.model, images["pixel_values"]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if "image_grid_thw" in images:  # Qwen2.5-VL: the merger is in the tower
            inner.visual(pixels, grid_thw=images["image_grid_thw"])
        elif "pixel_attention_mask" in images:  # Idefics3: the tower with its patch mask, the connector
            p = model.config.vision_config.patch_size
            mask = images["pixel_attention_mask"].unfold(1, p, p).unfold(2, p, p).sum((-1, -2)) > 0
            inner.connector(
                inner.vision_model(pixel_values=pixels, patch_attention_mask=mask).last_hidden_state
            )
        else:  # Gemma 3: SigLIP, then the pooling projector
            inner.multi_modal_projector(inner.vision_tower(pixel_values=pixels).last_hidden_state)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_family_s_tower_keeps_the_activations_the_plan_says(
    family: str, dtype: str, tmp_path: Path
) -> None:
    import torch

    from engine.vision.families import vision_spec
    from engine.vision.pixels import row_pixels

    model = tiny_vlm(family)
    config = model.config
    depth = "depth" if family in ("qwen2_5_vl", "qwen3_vl") else "num_hidden_layers"
    wider: dict[str, Any] = {
        "hidden_size": 96,
        "intermediate_size": 160,
        depth: 3,
    }  # not a shape the coefficients came from
    if family == "qwen2_5_vl":
        wider["fullatt_block_indexes"] = [2]
    config.vision_config = type(config.vision_config)(**(config.vision_config.to_dict() | wider))
    model = type(model)(config).to(getattr(torch, dtype))
    processor = tiny_processor(family)
    arch = type(model).__name__
    rows = row_pixels(processor, arch)([png(32, 32, seed=i) for i in range(6)])
    images = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in rows.items()}
    processor.image_processor.save_pretrained(tmp_path)
    tower = Shape.from_config(
        config_of(model) | {"architectures": [arch]},
        processor=json.loads((tmp_path / "preprocessor_config.json").read_text()),
    ).tower
    assert tower is not None
    patches = 6 * tower.image(32, 32).patches
    spec = vision_spec(arch)
    assert spec is not None
    trained, projector = model.get_submodule(spec.tower), model.get_submodule(spec.projector)
    d = 4 if dtype == "float32" else 2
    for whole in (True, False):
        trained.requires_grad_(whole)
        projector.requires_grad_(True)
        # the patch embedding keeps its input, the pixel values, when the tower trains
        measured = saved_image_bytes(model, images) + (images["pixel_values"].numel() * d if whole else 0)
        predicted = tower.activation_bytes(patches, d, tower=whole)
        assert abs(predicted - measured) <= TOLERANCE * measured, (whole, predicted, measured)
