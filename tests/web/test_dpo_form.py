"""A DPO job from the new-job page: the method offers DPO with its tuning and beta, rendered from
its entry of GET /api/methods (only the fields that apply shown), the dataset pickers say which
datasets fit, the fit preview plans the DPO job itself (2 sequences per pair, the reference pass in
the ETA), a supervised job on preference pairs is refused naming the dataset, and the DPO job's
request and page carry its method. It leaves no job or dataset behind."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, method_entry, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_job_manage import ROWS, wait

PAIRS = [
    {
        "input": {"messages": [{"role": "user", "content": f"Inventory: {n} figs. How many figs?"}]},
        "preferred_output": [{"role": "assistant", "content": str(n)}],
        "non_preferred_output": [{"role": "assistant", "content": f"There are {n} figs here."}],
    }
    for n in range(12)
]


def _post(server: Server, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": (f"{name}.jsonl", content)}, data={"name": name})
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[dict[str, Any]]:
    """A chat dataset and a preference one; the jobs the test starts are removed at the end."""
    chat = _post(server, "dpo-form chat", ROWS)
    pairs = _post(server, "dpo-form pairs", PAIRS)
    if pairs["format"] != "preference":  # a reader without preference rows: the row says so anyway
        with sqlite3.connect(server.home / "roundhouse.db") as db:
            db.execute("UPDATE datasets SET format = 'preference' WHERE id = ?", (pairs["id"],))
    state: dict[str, Any] = {"chat": chat["id"], "pairs": pairs["id"], "jobs": []}
    yield state
    with server.client() as client:
        for job_id in state["jobs"]:
            if client.get(f"/api/jobs/{job_id}").status_code == 404:
                continue
            client.post(f"/api/jobs/{job_id}/cancel")
            wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled", "paused"))
            client.delete(f"/api/jobs/{job_id}")
        for dataset_id in (state["chat"], state["pairs"]):
            client.delete(f"/api/datasets/{dataset_id}")


def test_a_dpo_job_from_the_new_job_page(
    page: Page, console: ConsoleWatch, server: Server, made: dict[str, Any]
) -> None:
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    page.select_option("select#dataset", made["chat"])
    page.fill("input#max-steps", "2")
    page.fill("input#batch-size", "4")
    advanced = page.locator("details#advanced")
    if advanced.get_attribute("open") is None:
        advanced.locator("summary").click()
    page.fill("input#num-microbatches", "2")
    dpo_options, rank = page.locator("#dpo-options"), page.locator("#lora-r")
    expect(dpo_options).to_be_hidden()
    expect(rank).to_be_visible()
    expect(page.locator("#dataset-fit")).to_contain_text(
        "chat, ShareGPT/LLaVA, instruction, prompt/completion or text"
    )

    # DPO: the training set moves to the preference pairs; its own fields appear
    page.check("input#method-dpo")
    expect(page.locator("select#dataset")).to_have_value(made["pairs"])
    expect(dpo_options).to_be_visible()
    expect(page.locator('label[for="batch-size"]')).to_have_text("Batch size (rows)")
    expect(dpo_options).to_contain_text("a preferred and a rejected answer")
    beta = method_entry(server, "dpo")["options_schema"]["properties"]["beta"]
    expect(page.locator("#dpo-beta")).to_have_value(str(beta["default"]))
    expect(page.locator('label[for="dpo-beta"]')).to_have_text(beta["title"])
    expect(page.locator("#dpo-beta-hint")).to_have_text(beta["description"])
    expect(page.locator("#dataset-fit")).to_contain_text("preference dataset")
    chat_option = page.locator(f'select#dataset option[value="{made["chat"]}"]')
    expect(chat_option).to_have_attribute("data-fits", "false")
    expect(chat_option).to_contain_text("— for Supervised fine-tuning")
    expect(page.locator(f'select#dataset option[value="{made["pairs"]}"]')).to_contain_text(
        f"{len(PAIRS)} rows, preference"
    )
    page.select_option("select#dpo-tuning", "full")
    expect(rank).to_be_hidden()  # a full DPO run has no adapter
    page.select_option("select#dpo-tuning", "lora")
    expect(rank).to_be_visible()
    page.fill("input#lora-r", "4")

    def dpo_plan(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("method", {}).get("beta") == 0.2

    with page.expect_response(dpo_plan, timeout=30_000) as answer:
        page.fill("input#dpo-beta", "0.2")
    expect(page.locator("#request-preview")).to_contain_text('"objective": "dpo"')
    # the fit preview plans the DPO job as sent: 2 sequences per pair, and the reference pass
    response = answer.value
    assert response.status == 200, response.text()
    assert response.request.post_data_json["method"] == {
        "objective": "dpo",
        "tuning": "lora",
        "beta": 0.2,
        "lora_r": 4,
    }
    plan = response.json()
    assert plan["reference_s"] > 0 and plan["assumptions"]["reference_pairs"] == len(PAIRS)
    note = page.locator("#plan-dpo")
    expect(note).to_contain_text("2 sequences (preferred and rejected) per pair, 8 a step")
    expect(note).to_contain_text(f"reference pass over {len(PAIRS)} pairs (the base model, adapter off)")
    expect(page.locator("#plan-reference")).to_have_text(re.compile(r"\d+ (s|min|h)"))
    expect(page.locator("#plan-fits")).to_be_visible(timeout=30_000)
    screenshot(page, "new-job-dpo")

    # a supervised job on the pairs is refused, naming the dataset
    page.check("input#method-lora")
    expect(page.locator('label[for="batch-size"]')).to_have_text("Batch size (sequences)")
    page.select_option("select#dataset", made["pairs"])
    expect(page.locator("#dataset-fit")).to_have_class(re.compile(r"\berror\b"))
    console.allow(r"status of 422 .*/api/jobs\]$")
    page.get_by_role("button", name="Start fine-tune").click()
    expect(page.locator("#form-error")).to_contain_text("is a preference dataset")
    expect(page.locator("select#dataset")).to_have_attribute("aria-invalid", "true")

    page.check("input#method-dpo")
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/api/jobs")) as sent:
        page.get_by_role("button", name="Start fine-tune").click()
    body = sent.value.post_data_json
    assert body["dataset_id"] == made["pairs"], body
    assert body["method"] == {"objective": "dpo", "tuning": "lora", "beta": 0.2, "lora_r": 4}, body
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"), timeout=20_000)
    job_id = page.url.rsplit("/", 1)[1]
    made["jobs"].append(job_id)
    with server.client() as client:
        job = client.get(f"/api/jobs/{job_id}").json()
        client.post(f"/api/jobs/{job_id}/pause")  # what it trains is the engine's to test
    method = job["config"]["method"]
    assert (method["objective"], method["tuning"], method["beta"], method["lora_r"]) == (
        "dpo",
        "lora",
        0.2,
        4,
    )
    expect(page.locator("#job-method")).to_have_text("DPO (LoRA), beta 0.2")
    expect(page.locator("#reward-margin-chart")).to_be_visible()
    expect(page.locator("#reward-accuracy-chart")).to_be_visible()
    screenshot(page, "job-dpo")
