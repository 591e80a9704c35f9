"""The job page's Evaluations card (``web/CONTRACT.md``): evaluate a finished job's checkpoint on a
dataset from the form, see the metrics appear in the table and the samples next to their
references. The job itself is started through the API (a setup shortcut)."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import Page, expect

from tests.utils.jobs import FINAL, start_job, wait_for_job
from tests.web.conftest import Server, screenshot

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 5}."},
            {"role": "assistant", "content": str(i % 5)},
        ]
    }
    for i in range(16)
]


def finished_job(server: Server) -> tuple[str, str]:
    """A tiny LoRA job run to success with a checkpoint at step 2; and its dataset's id."""
    with server.client() as api:
        content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        r = api.post("/api/datasets", files={"file": ("count.jsonl", content)}, data={"name": "eval counts"})
        assert r.status_code == 201, r.text
        dataset_id = r.json()["id"]
        job_id = start_job(api, dataset_id, name="ui evaluation", engine={"devices": ["cpu"]})["id"]
        job = wait_for_job(api, job_id, FINAL, timeout=180, logs=server.log_tail)
        assert job["status"] == "succeeded", (job, server.log_tail())
    return job_id, dataset_id


@pytest.mark.slow
def test_evaluate_a_checkpoint_from_the_job_page(page: Page, server: Server) -> None:
    job_id, dataset_id = finished_job(server)
    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    form = page.locator("form#evaluate-form")
    expect(form).to_be_visible()
    expect(page.locator("#eval-checkpoint option")).to_have_count(2)  # latest, step 2
    expect(page.locator("#eval-checkpoint")).to_have_value("latest")
    page.locator("#eval-dataset").select_option(dataset_id)
    page.get_by_label("Max rows").fill("5")
    page.get_by_label("Max new tokens").fill("4")
    page.get_by_role("button", name="Evaluate").click()

    row = page.locator("#evaluations-table tbody tr[data-evaluation-id]")
    expect(row).to_have_count(1)
    expect(row.locator(".eval-status")).to_have_text("succeeded", timeout=120_000)
    expect(row).to_have_attribute("data-step", "2")
    expect(row.locator(".eval-rows")).to_have_text("5")
    assert re.fullmatch(r"\d+(\.\d+)?", row.locator(".eval-loss").inner_text()), row.inner_text()
    assert re.fullmatch(r"[\d.,]+", row.locator(".eval-perplexity").inner_text())
    expect(row.locator(".eval-token-accuracy")).to_have_text(re.compile(r"^[\d.]+%$"))
    expect(row.locator(".eval-exact-match")).to_have_text(re.compile(r"^[\d.]+% \(\d/5\)$"))

    # the newest result's samples: prompt, reference and output side by side
    samples = page.locator("#evaluation-samples table.samples tbody tr.sample")
    expect(samples).to_have_count(5)
    first = samples.first
    expect(first.locator(".sample-prompt")).to_have_text("Count to 0.")
    expect(first.locator(".sample-reference")).to_have_text("0")
    expect(first.locator(".sample-match")).to_have_text(re.compile("^(yes|no)$"))
    boxes = [
        first.locator(c).bounding_box() for c in (".sample-prompt", ".sample-reference", ".sample-output")
    ]
    assert all(b is not None for b in boxes)
    lefts = [b["x"] for b in boxes if b is not None]
    assert lefts == sorted(lefts) and len({round(b["y"]) for b in boxes if b is not None}) == 1  # one line
    page.locator("#evaluations").scroll_into_view_if_needed()
    screenshot(page, "job-evaluation")
