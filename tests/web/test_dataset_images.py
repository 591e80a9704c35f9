"""The datasets page with images: a zip of a JSONL file and its pictures uploaded through the page
is stored (each picture once); previewed through a text model it says that model cannot render
images, and through a vision-language base model each row shows its thumbnails beside its tokens."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.web.conftest import ConsoleWatch, Server, screenshot

pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect


def row(*images: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Which colours?"}]
    parts += [{"type": "image_url", "image_url": {"url": name}} for name in images]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "some"}]}


def test_a_zip_with_images_is_stored_and_previewed_with_thumbnails(
    page: Page, console: ConsoleWatch, server: Server, tmp_path: Path
) -> None:
    rows = [row("pics/a.png", "pics/b.png"), row("pics/a.png")]
    archive = tmp_path / "pictures.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("pictures/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        zf.writestr("pictures/pics/a.png", png(40, 30, seed=5))
        zf.writestr("pictures/pics/b.png", png(20, 50, seed=6))
    vlm = server.home / "models" / "tiny-vlm"  # a vision-language base model the page lists
    if not (vlm / "config.json").is_file():
        tiny_vlm_folder(vlm, "qwen2_5_vl")
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.locator("#datasets-table")).to_be_visible()
    assert ".zip" in (page.get_attribute("input#dataset-file", "accept") or "")
    console.allow(r"status of 422 .*/api/datasets/[0-9a-f]+/(preview|stats)")  # the text model's
    page.set_input_files("input#dataset-file", str(archive))
    expect(page.locator("#upload-status")).to_contain_text(
        "Stored pictures.zip: 2 rows (chat)", timeout=30_000
    )
    preview = page.locator("section#preview")
    page.select_option("select#preview-model", "tiny")
    expect(preview.locator(".error")).to_contain_text("model 'tiny'", timeout=30_000)
    expect(preview.locator(".error")).to_contain_text("vision-language model")
    ident = preview.get_attribute("data-id")
    assert ident is not None

    # a vision-language model's processor renders the rows: each beside its pictures
    page.select_option("select#preview-model", "tiny-vlm")
    page.fill("input#preview-max-length", "4096")
    page.dispatch_event("input#preview-max-length", "change")
    first = preview.locator(".with-images").first
    expect(first).to_be_visible(timeout=30_000)
    expect(preview.locator(".with-images")).to_have_count(2)
    expect(first.locator("img.thumb")).to_have_count(2)
    expect(preview.locator(".with-images").nth(1).locator("img.thumb")).to_have_count(1)
    loaded = first.locator("img.thumb").first.evaluate("i => i.complete && i.naturalWidth")
    assert loaded == 40  # the picture itself (smaller than a thumbnail)
    thumbs, tokens = first.locator(".thumbs").bounding_box(), first.locator("pre.tokens").first.bounding_box()
    assert (
        thumbs is not None and tokens is not None and thumbs["x"] + thumbs["width"] <= tokens["x"]
    )  # beside
    screenshot(page, "dataset-preview-images")
    images = server.home / "images"
    assert console.unexpected() == []

    # each picture stored once (a.png is named twice), listed in the dataset's manifest
    named = (server.home / "datasets" / ident / "images.txt").read_text().split()
    assert len(named) == 2 and all((images / h[:2] / h).is_file() for h in named)
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("t.jsonl", json.dumps(row("gone.png")) + "\n")
    console.allow(r"status of 422 .*/api/datasets\]?$")
    page.set_input_files("input#dataset-file", str(bad))
    expect(page.locator("#upload-errors")).to_contain_text(
        "line 1: messages[0].content[1].image_url.url: 'gone.png'"
    )
