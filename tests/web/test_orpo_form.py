"""An ORPO job from the new-job page: the method listing's ORPO option with its own fieldset
(#orpo-options: its title as the legend, its beta's hint from its schema, tuning labels without a
reference), the fit preview planning pairs without a reference pass, and the job page showing its
method and ORPO's charts as the listing names them. It leaves no job behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, method_entry, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_dpo_form import PAIRS, _post
from tests.web.test_job_manage import wait


@pytest.fixture(scope="module")
def pairs(server: Server) -> Iterator[dict[str, Any]]:
    state: dict[str, Any] = {"pairs": _post(server, "orpo-form pairs", PAIRS)["id"], "jobs": []}
    yield state
    with server.client() as client:
        for job_id in state["jobs"]:
            if client.get(f"/api/jobs/{job_id}").status_code == 404:
                continue
            client.post(f"/api/jobs/{job_id}/cancel")
            wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled", "paused"))
            client.delete(f"/api/jobs/{job_id}")
        client.delete(f"/api/datasets/{state['pairs']}")


def test_an_orpo_job_from_the_new_job_page(
    page: Page, console: ConsoleWatch, server: Server, pairs: dict[str, Any]
) -> None:
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    page.fill("input#max-steps", "2")
    page.fill("input#batch-size", "4")
    advanced = page.locator("details#advanced")
    if advanced.get_attribute("open") is None:
        advanced.locator("summary").click()
    page.fill("input#num-microbatches", "2")

    orpo, dpo = method_entry(server, "orpo"), method_entry(server, "dpo")
    page.check("input#method-orpo")
    options = page.locator("#orpo-options")
    expect(options).to_be_visible()
    expect(page.locator("#dpo-options")).to_be_hidden()
    expect(options.locator("legend")).to_have_text(orpo["title"])
    expect(options).to_contain_text(re.compile("reference-free", re.IGNORECASE))
    expect(page.locator("#orpo-beta-hint")).to_contain_text("odds-ratio loss")
    expect(page.locator("select#orpo-tuning option").first).to_have_text("LoRA adapter")
    expect(page.locator('label[for="batch-size"]')).to_have_text("Batch size (rows)")
    page.select_option("select#dataset", pairs["pairs"])
    page.fill("input#lora-r", "4")

    def orpo_plan(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("method", {}).get("beta") == 0.3

    with page.expect_response(orpo_plan, timeout=30_000) as answer:
        page.fill("input#orpo-beta", "0.3")
    response = answer.value
    assert response.status == 200, response.text()
    plan = response.json()
    assert plan["assumptions"]["objective"] == "orpo" and plan["reference_s"] is None
    note = page.locator("#plan-dpo")
    expect(note).to_contain_text(
        "ORPO: 2 sequences (preferred and rejected) per pair, 8 a step; no reference pass"
    )
    expect(page.locator("#plan-reference")).to_have_count(0)

    # the DPO option has its own fieldset, saying what DPO's fields mean (its reference too)
    page.check("input#method-dpo")
    expect(options).to_be_hidden()
    expect(page.locator("#dpo-options legend")).to_have_text(dpo["title"])
    expect(page.locator("#dpo-beta-hint")).to_have_text(
        dpo["options_schema"]["properties"]["beta"]["description"]
    )
    expect(page.locator("select#dpo-tuning option").first).to_have_text(
        "LoRA adapter (the reference is the base model)"
    )
    page.check("input#method-orpo")
    expect(page.locator("input#orpo-beta")).to_have_value("0.3")  # each method keeps its own values

    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/api/jobs")) as sent:
        page.get_by_role("button", name="Start fine-tune").click()
    body = sent.value.post_data_json
    assert body["method"] == {"objective": "orpo", "tuning": "lora", "beta": 0.3, "lora_r": 4}, body
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"), timeout=20_000)
    job_id = page.url.rsplit("/", 1)[1]
    pairs["jobs"].append(job_id)
    with server.client() as client:
        job = client.get(f"/api/jobs/{job_id}").json()
        client.post(f"/api/jobs/{job_id}/pause")  # what it trains is the engine's to test
    assert (job["config"]["method"]["objective"], job["config"]["method"]["beta"]) == ("orpo", 0.3)
    expect(page.locator("#job-method")).to_have_text("ORPO (LoRA), beta 0.3")
    expect(page.locator("#reward-margin-chart")).to_be_visible()
    chart = next(c for c in orpo["charts"] if c["id"] == "reward-margin-chart")
    expect(page.locator("#reward-margin-chart")).to_have_attribute("label", chart["title"])
    expect(page.locator('section[data-chart="reward-margin-chart"] h2')).to_have_text(chart["title"])
    screenshot(page, "job-orpo")
