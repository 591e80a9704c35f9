"""The new-job page asks for a job on several boxes ("Boxes": 1, 2, ... or "as many as fit", and
the fewest to go on with after a fault), posted as ``placement.hosts`` / ``placement.min_hosts``;
the plan card shows the gradient exchange (bytes a step, time, over what link, hidden or not) and
the scaling over one box, as ``POST /api/plan`` answers them; a batch too small for the boxes is
refused naming ``hyper.batch_size``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect


def _plan_for(hosts: Any) -> Any:
    def matches(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and (sent.get("placement") or {}).get("hosts") == hosts

    return matches


def _shown(x: float) -> str:
    """A figure as the page's ``number`` writes it: 3 significant digits."""
    return f"{float(f'{x:.3g}'):,}".removesuffix(".0")


def _time(s: float) -> str:
    """A short time as the plan card writes it."""
    return f"{_shown(1000 * s)} ms" if s < 1 else f"{_shown(s)} s"


def test_two_boxes_show_the_exchange_and_the_scaling(
    page: Page, server: Server, console: ConsoleWatch
) -> None:
    console.allow(r"status of 422 .*/api/plan\]?$")  # the 3 boxes below
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    expect(page.locator("#placement-min-hosts")).to_be_hidden()  # one box: nothing to fall back to
    with page.expect_response(_plan_for(2), timeout=30_000) as answer:
        page.select_option("select#placement-hosts", "2")
    plan = answer.value.json()
    ex = plan["exchange"]
    assert plan["hosts"] == 2 and ex["bytes_per_step"] == 4 * plan["trainable"]  # fp32, a ring of 2
    assert plan["assumptions"]["link_source"] in ("nominal", "nic", "measured")
    expect(page.locator("#placement-host")).to_be_disabled()  # several boxes: no one host
    note = page.locator("#plan-exchange")
    expect(note).to_contain_text("Gradient exchange on 2 boxes", timeout=30_000)
    text = note.inner_text()
    assert f"each training {plan['assumptions']['rows_per_host']} of each batch's 8 examples" in text
    sent = re.search(r": ([\d.,]+) (kB|MB|GB) a box a step over ([\d.]+) Gbit/s", text)
    assert sent, text
    unit = {"kB": 1e3, "MB": 1e6, "GB": 1e9}[sent.group(2)]
    assert float(sent.group(1).replace(",", "")) * unit == pytest.approx(ex["bytes_per_step"], rel=5e-3)
    assert float(sent.group(3)) == pytest.approx(ex["link_gbps"], rel=5e-3)
    assert f"{_time(ex['seconds'])}; it adds {_time(ex['exposed_s'])}" in text  # sync: not hidden
    assert f"{_shown(plan['scaling'])}x one box's {_shown(plan['one_box']['tokens_per_s'])} tokens/s" in text
    expect(page.locator("#plan-scaling")).to_have_text(f"{_shown(plan['scaling'])}x on 2 boxes")
    expect(page.locator("#plan-hardware")).to_contain_text("2 boxes, each ")
    page.fill("#placement-min-hosts", "1")
    expect(page.locator("#request-preview")).to_contain_text('"min_hosts": 1')
    screenshot(page, "new-job-two-boxes")

    # 8 rows in 4 micro-batches cannot give 3 boxes a row each of every micro-batch
    with page.expect_response(_plan_for(3), timeout=30_000) as refused:
        page.select_option("select#placement-hosts", "3")
    assert refused.value.status == 422
    expect(page.locator("#plan")).to_contain_text(
        "hyper.batch_size=8 is smaller than 3 hosts x 4 micro-batches"
    )
    # "as many as fit": the hosts online now (this machine's worker), so one box and no exchange
    with page.expect_response(_plan_for("auto"), timeout=30_000) as auto:
        page.select_option("select#placement-hosts", "auto")
    assert auto.value.json()["exchange"] is None
    expect(page.locator("#request-preview")).to_contain_text('"hosts": "auto"')
    expect(page.locator("#plan-exchange")).to_have_count(0)
