"""The datasets page with a preference (DPO) file: uploaded through the page, previewed as its
prompt and both answers (side by side, stacked on a narrow window), trained tokens marked;
a bad pair is refused by line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.web.conftest import ConsoleWatch, Server, screenshot

pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

ROWS = [
    {
        "input": {"messages": [{"role": "user", "content": f"Inventory: {n} figs, 2 limes. How many figs?"}]},
        "preferred_output": [{"role": "assistant", "content": str(n)}],
        "non_preferred_output": [{"role": "assistant", "content": f"There are {n} figs here."}],
    }
    for n in (3, 5, 7)
]


def test_a_preference_dataset_previews_its_prompt_and_both_answers(
    page: Page, console: ConsoleWatch, server: Server, tmp_path: Path
) -> None:
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.locator("#datasets-table")).to_be_visible()
    good = tmp_path / "pairs.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    page.set_input_files("input#dataset-file", str(good))
    expect(page.locator("#upload-status")).to_contain_text("(preference)", timeout=30_000)
    row = page.locator("#datasets-table tbody tr[data-dataset-id]", has_text="pairs.jsonl").first
    expect(row).to_contain_text("preference")

    preview = page.locator("section#preview")
    expect(preview).to_be_visible()
    page.select_option("select#preview-model", "tiny")
    first = preview.locator(".preview-row.preference").first
    expect(first).to_be_visible(timeout=30_000)
    expect(preview.locator(".preview-row.preference")).to_have_count(3)
    expect(first.get_by_role("heading", name="Prompt")).to_be_visible()
    preferred, rejected = first.locator(".answer.preferred"), first.locator(".answer.rejected")
    expect(preferred.get_by_role("heading", name="Preferred")).to_be_visible()
    expect(rejected.get_by_role("heading", name="Rejected")).to_be_visible()

    def text(where: str, trained: bool) -> str:
        spans = first.locator(f"{where} span.tok{'.trained' if trained else ':not(.trained)'}")
        return "".join(spans.all_text_contents())

    assert "How many figs?" in text(".prompt", False) and text(".prompt", True) == ""
    assert text(".answer.preferred", True).startswith("3")
    assert text(".answer.rejected", True).startswith("There are 3 figs here.")
    # side by side on a wide window
    a, b = preferred.bounding_box(), rejected.bounding_box()
    assert a and b and b["x"] > a["x"] + a["width"] - 1 and abs(b["y"] - a["y"]) < 2, (a, b)
    expect(page.locator("rh-histogram#token-histogram svg rect.bar").first).to_be_attached(timeout=30_000)
    expect(preview).to_contain_text("both answers of each pair")
    screenshot(page, "datasets-preference-preview")

    page.set_viewport_size({"width": 420, "height": 800})
    a, b = preferred.bounding_box(), rejected.bounding_box()
    assert a and b and b["y"] >= a["y"] + a["height"] - 1, (a, b)  # stacked
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, overflow
    page.set_viewport_size({"width": 1280, "height": 800})

    bad = tmp_path / "bad-pairs.jsonl"
    same = {**ROWS[0], "non_preferred_output": ROWS[0]["preferred_output"]}
    bad.write_text("\n".join(json.dumps(r) for r in [ROWS[0], same, {"prompt": "q", "chosen": "a"}]) + "\n")
    console.allow(r"status of 422 .*/api/datasets\]$")
    page.set_input_files("input#dataset-file", str(bad))
    errors = page.locator("ul#upload-errors > li")
    expect(errors).to_have_count(2, timeout=30_000)
    texts = errors.all_text_contents()
    assert [int(m.group(1)) for t in texts if (m := re.match(r"line (\d+): ", t))] == [2, 3], texts
    assert "same answer" in texts[0] and "missing field 'rejected'" in texts[1], texts
