"""The playground with images, in a real browser against a real server and worker: an image picked
with the file picker and one dropped on the message box are sent with the message to a tiny
vision-language model, shown in the conversation, and answered; the conversation goes on with
them; a text-only model refuses an image with an error naming the part. Screenshot:
``test-artifacts/screenshots/playground-images.png``."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

VLM = "tiny-vlm-playground"


@pytest.fixture
def vlm(server: Server) -> Iterator[str]:
    """A tiny Qwen2.5-VL in the server's models folder for the test's length."""
    folder = tiny_vlm_folder(server.home / "models" / VLM, "qwen2_5_vl")
    try:
        yield VLM
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def drop_image(page: Page, selector: str, data: bytes, name: str) -> None:
    """Drop a PNG file on an element, as a drag from the desktop does."""
    page.evaluate(
        """([selector, b64, name]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type: "image/png" }));
            const target = document.querySelector(selector);
            const init = { bubbles: true, cancelable: true, dataTransfer: transfer };
            for (const type of ["dragenter", "dragover", "drop"])
                target.dispatchEvent(new DragEvent(type, init));
        }""",
        [selector, base64.b64encode(data).decode(), name],
    )


def test_images_picked_and_dropped_go_with_the_message_and_show_in_the_chat(
    page: Page, server: Server, vlm: str, tmp_path: Path
) -> None:
    picked = tmp_path / "picked.png"
    picked.write_bytes(png(24, 16, 1))
    page.goto(f"{server.base_url}/#/playground")
    base = page.locator("select#playground-base")
    expect(page.locator("#base-model-name")).not_to_be_empty()  # the page has picked its defaults
    expect(base.locator(f"option[value='{vlm}']")).to_have_count(1)
    base.select_option(vlm)
    page.get_by_label("Temperature", exact=True).fill("0")
    page.get_by_label("Max tokens", exact=True).fill("6")

    page.get_by_label("Image", exact=True).set_input_files(str(picked))
    drop_image(page, "#playground-prompt", png(20, 20, 2), "dropped.png")
    tray = page.locator("#playground-attachments img")
    expect(tray).to_have_count(2)
    # one removed and dropped again: the tray follows
    page.get_by_role("button", name="Remove image 2").click()
    expect(tray).to_have_count(1)
    drop_image(page, "#playground-form", png(20, 20, 2), "dropped.png")
    expect(tray).to_have_count(2)

    page.get_by_label("Message", exact=True).fill("what is in these?")
    page.locator("#playground-send").click()
    expect(tray).to_have_count(0)  # sent with the message
    user = page.locator("#base-chat li.turn.user")
    expect(user.locator("img")).to_have_count(2)
    expect(user).to_contain_text("what is in these?")
    src = user.locator("img").first.get_attribute("src") or ""
    assert src.startswith("data:image/png;base64,")
    answer = page.locator("#base-chat li.turn.assistant").last
    expect(answer).not_to_have_attribute("data-state", "running", timeout=90_000)
    assert answer.get_attribute("data-state") == "done", answer.text_content()
    expect(answer.locator(".meta")).to_contain_text("tokens")

    # the conversation goes on, its images sent again with the history
    page.get_by_label("Message", exact=True).fill("and now?")
    page.locator("#playground-send").click()
    answers = page.locator("#base-chat li.turn.assistant")
    expect(answers).to_have_count(2)
    expect(answers.last).not_to_have_attribute("data-state", "running", timeout=90_000)
    assert answers.last.get_attribute("data-state") == "done", answers.last.text_content()
    screenshot(page, "playground-images")

    # a text-only model refuses an image, naming the part
    page.get_by_role("button", name="New conversation").click()
    base.select_option("tiny")
    page.get_by_label("Image", exact=True).set_input_files(str(picked))
    page.get_by_label("Message", exact=True).fill("and this?")
    page.locator("#playground-send").click()
    refused = page.locator("#base-chat li.turn.assistant").last
    expect(refused).to_have_attribute("data-state", "error", timeout=90_000)
    expect(refused).to_contain_text("text-only")
    expect(refused).to_contain_text("messages.0.content.0")
