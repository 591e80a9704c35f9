"""Pause and resume in the browser: Pause on a running job's page stops it at a step with a
checkpoint (shown paused, distinctly, on the page and in the jobs list), Resume runs it to success.
Screenshots under ``test-artifacts/screenshots/``. It leaves no job or dataset behind."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_job_manage import ROWS, TIMEOUT_S, start, wait


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[dict[str, Any]]:
    """A dataset and the jobs the test starts; whatever is left is cancelled and deleted at the end."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("pause.jsonl", content)}, data={"name": "pause"})
        assert r.status_code == 201, r.text
        state: dict[str, Any] = {"dataset_id": r.json()["id"], "jobs": []}
        yield state
        for job_id in state["jobs"]:
            if client.get(f"/api/jobs/{job_id}").status_code == 404:
                continue
            client.post(f"/api/jobs/{job_id}/cancel")
            wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled"))
            client.delete(f"/api/jobs/{job_id}")
        client.delete(f"/api/datasets/{state['dataset_id']}")


@pytest.mark.slow
def test_pause_a_running_job_from_its_page_then_resume_it(
    page: Page, server: Server, made: dict[str, Any]
) -> None:
    steps = 60
    job_id = start(server, made, steps=steps)
    wait(server, job_id, lambda j: j["status"] == "running" and j["step"] >= 2)
    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    status = page.locator("#job-status")
    expect(status).to_have_text("running")
    pause, resume = page.locator("#pause-job"), page.locator("#resume-job")
    expect(resume).to_be_hidden()
    expect(page.locator("#delete-job")).to_be_hidden()
    pause.click()
    expect(status).to_have_text(re.compile("pausing|paused|succeeded"))
    expect(status).to_have_text("paused", timeout=TIMEOUT_S * 1000)
    with server.client() as client:
        job = client.get(f"/api/jobs/{job_id}").json()
    paused_at = job["step"]
    assert 2 <= paused_at < steps, job
    expect(status).to_have_class(re.compile(r"\bstatus-paused\b"))
    expect(page.locator("#paused-note")).to_have_text(re.compile(rf"^Paused at step {paused_at}: Resume"))
    expect(page.locator("#job-step")).to_have_text(f"step {paused_at} / {steps}")
    expect(page.locator("#job-eta")).to_have_text("–")
    expect(pause).to_be_hidden()
    expect(resume).to_be_visible()
    expect(page.locator("#cancel-job")).to_be_visible()  # a paused job can be cancelled
    expect(page.locator("#delete-job")).to_be_visible()  # or deleted
    # its checkpoint at the step it reached, with its download
    saved = page.locator(f'#checkpoints-table tbody tr[data-step="{paused_at}"]')
    expect(saved).to_be_visible()
    expect(saved.locator("a.download-adapter")).to_be_visible()
    screenshot(page, "job-paused")

    # the jobs list shows it paused, and its filter finds it
    page.goto(f"{server.base_url}/#/jobs")
    row = page.locator(f'#jobs-table tbody tr[data-job-id="{job_id}"]')
    expect(row.locator(".status")).to_have_text("paused")
    expect(row.locator(".status")).to_have_class(re.compile(r"\bstatus-paused\b"))
    page.select_option("select#status-filter", "paused")
    expect(row).to_be_visible()
    expect(page.locator("#jobs-table tbody tr[data-job-id]")).to_have_count(1)
    screenshot(page, "jobs-paused")

    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    expect(status).to_have_text("paused")
    resume.click()
    expect(status).to_have_text(re.compile("queued|running|succeeded"))
    expect(page.locator("#paused-note")).to_be_hidden()
    expect(status).to_have_text("succeeded", timeout=TIMEOUT_S * 1000)
    expect(page.locator("#job-step")).to_have_text(f"step {steps} / {steps}")
    expect(resume).to_be_hidden()
    expect(pause).to_be_hidden()
    expect(page.locator("#event-log li").filter(has_text="pause relayed").first).to_be_attached()
    expect(
        page.locator("#event-log li").filter(has_text=f"checkpoint at step {paused_at}").first
    ).to_be_attached()
    with server.client() as client:
        events = client.get(f"/api/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    moves = [e["data"]["to"] for e in events if e["kind"] == "state"]
    assert moves[-5:] == ["pausing", "paused", "queued", "running", "succeeded"], moves
    screenshot(page, "job-resumed-after-pause")
