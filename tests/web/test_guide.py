"""The manual in the browser: the header's "Guide" link opens /guide, whose pages load with no
request leaving this server; and the README's screenshot of a finished job's page
(docs/images/job-page.png), taken here from a real job so that it shows the UI as it is.

The screenshot is written on every run: a 1280x800 viewport of the job page with its charts drawn
(times and figures differ from run to run, the layout does not).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.utils import ROOT
from tests.utils.jobs import start_job, wait_for_job
from tests.web.conftest import CHROMIUM, VIEWPORT, ConsoleWatch, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, Route, expect

JOB_PAGE_PNG = ROOT / "docs" / "images" / "job-page.png"
STEPS = 30
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"How many boxes are on shelf {i}?"},
            {"role": "assistant", "content": f"Shelf {i} holds {(i * 7) % 12} boxes."},
        ]
    }
    for i in range(48)
]


def only_this_server(page: Page, server: Server) -> list[str]:
    """Abort and record every request of ``page`` to another address."""
    here = urlsplit(server.base_url).netloc
    elsewhere: list[str] = []

    def route(r: Route) -> Any:
        if urlsplit(r.request.url).netloc == here or r.request.url.startswith("data:"):
            return r.continue_()
        elsewhere.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
    return elsewhere


def test_the_header_link_opens_the_guide(page: Page, server: Server, console: ConsoleWatch) -> None:
    page.goto(f"{server.base_url}/#/jobs")
    link = page.get_by_role("link", name="Guide", exact=True)
    expect(link).to_have_attribute("href", "/guide")
    with page.context.expect_page() as opened:
        link.click()
    guide = opened.value
    console.attach(guide)
    elsewhere = only_this_server(guide, server)
    guide.wait_for_load_state()
    assert urlsplit(guide.url).path == "/guide"
    expect(guide.locator("#guide-page h1").first).to_be_visible()
    pages = guide.locator("nav.guide-nav a")
    expect(pages.first).to_have_attribute("aria-current", "page")
    assert pages.count() > 5, pages.all_text_contents()
    # the guide's own styles: the list of pages beside the page
    assert guide.eval_on_selector(".guide-layout", "e => getComputedStyle(e).display") == "grid"
    # a page of the list, then the generated reference through the page's own link
    guide.goto(f"{server.base_url}/guide/reference/index")
    expect(guide.locator("#guide-page h1")).to_have_text("Reference")
    guide.locator("#guide-page a", has_text="Settings").click()
    expect(guide).to_have_url(f"{server.base_url}/guide/reference/settings")
    expect(guide.locator("#guide-page td code", has_text="ROUNDHOUSE_HOME")).to_be_visible()
    screenshot(guide, "guide-settings")
    guide.close()
    assert elsewhere == [], elsewhere


@pytest.fixture
def finished_job(server: Server) -> Iterator[str]:
    """A LoRA job of the tiny model that ran to the end, with validation loss and checkpoints."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("shelves.jsonl", content)}, data={"name": "shelves"})
        assert r.status_code == 201, r.text
        dataset_id = r.json()["id"]
        job = start_job(
            client,
            dataset_id,
            name="shelves: LoRA on tiny",
            data={"max_length": 64, "validation_fraction": 0.125},
            hyper={"max_steps": STEPS, "learning_rate": 0.005, "optimizer": "adamw", "warmup_steps": 3},
            checkpoint={"every_steps": 10, "keep_last": 3},
            eval={"every_steps": 5},
        )
        done = wait_for_job(client, job["id"], ("succeeded",), logs=server.log_tail)
        assert done["step"] == STEPS, done
        yield str(job["id"])
        client.delete(f"/api/jobs/{job['id']}")
        client.delete(f"/api/datasets/{dataset_id}")


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_the_readme_screenshot_of_a_finished_job(page: Page, server: Server, finished_job: str) -> None:
    page.goto(f"{server.base_url}/#/jobs/{finished_job}")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#job-step")).to_contain_text(f"step {STEPS} / {STEPS}")
    # every chart drawn: the loss (train and validation) to the last step, the speed, the devices
    page.wait_for_function(
        "n => Number(document.querySelector('#loss-chart path.series')?.getAttribute('data-count')) === n",
        arg=STEPS,
    )
    for chart in ("loss-chart", "speed-chart", "gpu-chart", "memory-chart"):
        expect(page.locator(f"rh-line-chart#{chart} svg .series").first).to_be_attached()
    expect(page.locator("#loss-chart path.series")).to_have_count(2)  # train and validation
    expect(page.locator('#checkpoints-table tbody tr[data-step="30"]')).to_be_visible()
    page.evaluate("document.fonts.ready")
    page.evaluate("window.scrollTo(0, 0)")
    JOB_PAGE_PNG.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(JOB_PAGE_PNG), animations="disabled", caret="hide")
    assert png_size(JOB_PAGE_PNG) == (VIEWPORT["width"], VIEWPORT["height"])
    # the charts are in the picture: the loss chart's top edge is inside the viewport
    top = page.eval_on_selector("#loss-chart", "e => e.getBoundingClientRect().top")
    assert 0 <= top < VIEWPORT["height"] - 150, top
    screenshot(page, "job-page-full")
