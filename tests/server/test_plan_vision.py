"""``POST /api/plan`` of a vision-language model's job: the image processor's settings come from
the model folder's ``preprocessor_config.json``, the images a row holds and their sizes from the
dataset's rows (its stored images), and the plan says how many image tokens a row it assumed."""

from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.data import encode_example, read_examples
from engine.model import load_processor_for
from engine.planner.vision import Tower
from server.settings import Settings
from tests.engine.tiny_vision import png, tiny_vlm_folder

# two rows of two images and one of one: 5/3 images a row; widths 16, 24, 40, 16, 32, heights 16,
# 16, 40, 24, 32: a mean image of 26x26 pixels
ROW_IMAGES = [[(16, 16), (24, 16)], [(40, 40)], [(16, 24), (32, 32)]]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'roundhouse.db'}"


def chat_row(images: list[bytes]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    parts += [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
        for b in images
    ]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "noise"}]}


def rows_file() -> bytes:
    rows = [chat_row([png(w, h, seed=i) for i, (w, h) in enumerate(row)]) for row in ROW_IMAGES]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload_images(client: TestClient) -> dict[str, Any]:
    r = client.post("/api/datasets", files={"file": ("pictures.jsonl", rows_file())})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_a_vlm_plan_reads_the_processor_and_the_datas_images(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    folder = tiny_vlm_folder(settings.models_dir / "tiny-vlm", "qwen2_5_vl")
    # a processor of its own: at most 16x16 pixels an image (one 8x8-patch token grid of 4x4)
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    processor["size"] = {"shortest_edge": 8 * 8, "longest_edge": 16 * 16}
    processor.pop("min_pixels", None), processor.pop("max_pixels", None)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    dataset = upload_images(client)
    body = {
        "base_model": "tiny-vlm",
        "dataset_id": dataset["id"],
        "data": {"max_length": 128},
        "method": {"objective": "sft", "tuning": "lora", "vision_tower": "lora", "projector": "full"},
        "hyper": {"batch_size": 3, "max_steps": 5},
        "engine": {"num_microbatches": 1},
        "hardware": {"num_gpus": 1, "gpu_memory_gb": 24},
    }
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    vision = r.json()["assumptions"]["vision"]
    assert vision["images_from_data"] is True
    assert vision["images_per_row"] == pytest.approx(5 / 3)
    assert vision["image_size"] == [26, 26]
    assert (vision["vision_tower"], vision["projector"]) == ("lora", "full")
    config = json.loads((folder / "config.json").read_text())
    tower = Tower.from_config(config, processor)
    assert tower is not None and tower.max_pixels == 16 * 16
    cost = tower.image(26, 26)  # scaled down to 16x16: 16 patches, 4 tokens
    assert (
        (vision["patches_per_image"], vision["image_tokens_per_image"])
        == (cost.patches, cost.tokens)
        == (16, 4)
    )
    assert vision["image_tokens_per_row"] == pytest.approx(5 / 3 * 4)
    # the rows' token counts through the processor, image tokens included: one batch of the three
    # rows, padded to the longest
    assumptions = r.json()["assumptions"]
    assert assumptions["tokens_from_data"]
    (tmp_path / "rows.jsonl").write_bytes(rows_file())
    _, _, examples, _ = read_examples(tmp_path / "rows.jsonl")
    encoded = [encode_example(ex, load_processor_for(folder), 1 << 20) for ex in examples]
    assert assumptions["tokens_per_sequence"] == max(e.length for e in encoded)
    # the folder's defaults (a 32x32 bound) give other costs: the processor was read
    default = Tower.from_config(config)
    assert default is not None and default.image(26, 26).tokens != 4
    # without a dataset the plan assumes no images, and says so
    bare = client.post("/api/plan", json={k: v for k, v in body.items() if k != "dataset_id"}).json()
    assert bare["assumptions"]["vision"]["images_from_data"] is False
    assert bare["assumptions"]["vision"]["images_per_row"] == 0
    # a text model's plan has no vision facts
    text = client.post("/api/plan", json=body | {"base_model": "tiny", "method": {"kind": "lora"}}).json()
    assert text["assumptions"]["vision"] is None


def test_a_vlm_plan_of_a_zip_reads_its_stored_images(client: TestClient, settings: Settings) -> None:
    tiny_vlm_folder(settings.models_dir / "tiny-vlm", "idefics3")
    files = {f"img{i}.png": png(40, 20, seed=i) for i in range(4)}
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image><image> two"},
                {"role": "assistant", "content": "a"},
            ],
            "images": ["img0.png", "img1.png"],
        },
        {
            "messages": [{"role": "user", "content": "<image> one"}, {"role": "assistant", "content": "b"}],
            "images": ["img2.png"],
        },
    ]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        for name, data in files.items():
            zf.writestr(name, data)
    r = client.post("/api/datasets", files={"file": ("pictures.zip", out.getvalue())})
    assert r.status_code == 201, r.text
    body = {
        "base_model": "tiny-vlm",
        "dataset_id": r.json()["id"],
        "data": {"max_length": 256},
        "hyper": {"batch_size": 2, "max_steps": 5},
        "engine": {"num_microbatches": 1},
        "hardware": {"num_gpus": 1, "gpu_memory_gb": 24},
    }
    plan = client.post("/api/plan", json=body)
    assert plan.status_code == 200, plan.text
    vision = plan.json()["assumptions"]["vision"]
    assert vision["images_from_data"] and vision["images_per_row"] == 1.5 and vision["image_size"] == [40, 20]
