"""The new-job page with a vision-language base model: the vision tower and projector fields show
for a VLM only (and go into the request), and the plan card says how many image tokens a row it
assumed, from the images of the chosen dataset's rows, as ``POST /api/plan`` answers."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect


def _image_rows() -> bytes:
    rows = []
    for i, count in enumerate((2, 1, 1)):
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"What is picture {i}?"}]
        for k in range(count):
            url = "data:image/png;base64," + base64.b64encode(png(24, 16, seed=3 * i + k)).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
        rows.append(
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "noise"}]}
        )
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _plan_with(dataset_id: str) -> Any:
    def matches(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("dataset_id") == dataset_id

    return matches


def test_vision_fields_show_for_a_vlm_only_and_the_plan_counts_image_tokens(
    page: Page, server: Server
) -> None:
    folder = tiny_vlm_folder(server.home / "models" / "tiny-vlm", "qwen2_5_vl")
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("pictures.jsonl", _image_rows())})
        assert r.status_code == 201, r.text
        dataset = r.json()
    try:
        page.goto(f"{server.base_url}/#/jobs/new")
        expect(page.locator("form#new-job-form")).to_be_visible()
        page.select_option("select#base-model", "tiny")
        expect(page.locator("#plan-fits")).to_be_visible(timeout=30_000)
        expect(page.locator("#vision-options")).to_be_hidden()
        expect(page.locator("#plan-image-tokens")).to_have_count(0)
        page.select_option("select#dataset", dataset["id"])
        with page.expect_response(_plan_with(dataset["id"]), timeout=30_000):
            page.select_option("select#base-model", "tiny-vlm")
        # the VLM's plan answers: its fields show, frozen by default (the schema's default)
        expect(page.locator("#vision-options")).to_be_visible(timeout=30_000)
        expect(page.locator("select#vision-tower")).to_have_value("frozen")
        expect(page.locator("select#projector")).to_have_value("frozen")
        with page.expect_response(_plan_with(dataset["id"]), timeout=30_000) as answer:
            page.select_option("select#vision-tower", "lora")
        sent = answer.value.request.post_data_json or {}
        assert (sent["method"]["vision_tower"], sent["method"]["projector"]) == ("lora", "frozen")
        expect(page.locator("#request-preview")).to_contain_text('"vision_tower": "lora"')
        vision = answer.value.json()["assumptions"]["vision"]
        assert vision["images_from_data"] and vision["images_per_row"] == pytest.approx(4 / 3)
        assert vision["image_size"] == [24, 16] and vision["vision_tower"] == "lora"
        tokens = vision["image_tokens_per_row"]
        assert tokens == pytest.approx(4 / 3 * vision["image_tokens_per_image"]) and tokens > 0
        expect(page.locator("#plan-image-tokens")).to_have_text(f"{tokens:.3g}")
        note = page.locator("#plan-images")
        expect(note).to_contain_text(f"{tokens:.3g} image tokens a row: 1.33 images a row of 24x16 pixels")
        expect(note).to_contain_text(f"each {vision['patches_per_image']} patches and")
        expect(note).to_contain_text("vision tower lora, projector frozen")
        screenshot(page, "new-job-vlm")
        # back to a text model: the fields hide and leave the request
        page.select_option("select#base-model", "tiny")
        expect(page.locator("#vision-options")).to_be_hidden()
        expect(page.locator("#request-preview")).not_to_contain_text("vision_tower")
        expect(page.locator("#plan-image-tokens")).to_have_count(0, timeout=30_000)
    finally:
        shutil.rmtree(folder)
        with server.client() as client:
            client.delete(f"/api/datasets/{dataset['id']}")
