"""Managing jobs in the browser: a cancelled job resumed from its page runs to success; the times
(created N s ago, live; started, finished, duration), the disk use and the charts' tick labels on
both axes (the engine's Pipeline, Transfers and Optimizer charts too); deleting from the jobs list
and from the job page (with the confirmation), which removes the job's folder. Screenshots under
``test-artifacts/screenshots/``.

It leaves no job behind (the jobs-list test of ``test_ui.py`` counts the cancelled ones)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.jobs import start_job, wait_for_job
from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, ViewportSize, expect

ROWS = [
    {"messages": [{"role": "user", "content": f"count {i}"}, {"role": "assistant", "content": str(i % 7)}]}
    for i in range(32)
]
TIMEOUT_S = 180
NARROW: ViewportSize = {"width": 420, "height": 800}


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[dict[str, Any]]:
    """A dataset and the jobs the tests start; whatever is left is cancelled and deleted at the end."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("manage.jsonl", content)}, data={"name": "manage"})
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


# the job cancelled while it runs: long enough that an idle machine does not finish it first
STEPS = 100


def start(server: Server, made: dict[str, Any], *, steps: int) -> str:
    with server.client() as client:
        job = start_job(
            client, made["dataset_id"], hyper={"max_steps": steps}, checkpoint={"every_steps": 100}
        )
    made["jobs"].append(job["id"])
    return str(job["id"])


def wait(server: Server, job_id: str, done: Any) -> dict[str, Any]:
    with server.client() as client:
        return wait_for_job(client, job_id, done, timeout=TIMEOUT_S, logs=server.log_tail)


def texts(page: Page, selector: str) -> list[str]:
    return page.locator(selector).all_text_contents()


@pytest.mark.slow
def test_resume_a_cancelled_job_from_its_page_with_times_and_chart_ticks(
    page: Page, server: Server, made: dict[str, Any]
) -> None:
    job_id = start(server, made, steps=STEPS)
    wait(server, job_id, lambda j: j["status"] == "running" and j["step"] >= 2)
    with server.client() as client:  # setup: the cancel has its own test in test_ui.py
        assert client.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    job = wait(server, job_id, lambda j: j["status"] in ("cancelled", "succeeded", "failed"))
    assert job["status"] == "cancelled", "the job finished before the cancel took effect"
    assert re.fullmatch(r"tiny on manage \d\d:\d\d(:\d\d)?", job["name"]), job["name"]

    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    expect(page.locator("#job-status")).to_have_text("cancelled")
    resume, delete = page.locator("#resume-job"), page.locator("#delete-job")
    expect(resume).to_be_visible()
    expect(resume).to_have_text("Resume")
    expect(delete).to_be_visible()
    expect(page.locator("#cancel-job")).to_be_hidden()
    # times: created N ago (live), started and finished as clock times, the duration between them
    created = page.locator("#job-created")
    expect(created).to_have_text(re.compile(r"^created \d+ (s|min \d+ s) ago$"))
    first = created.text_content()
    expect(created).not_to_have_text(first or "", timeout=3000)  # the page's timer moves it on
    expect(page.locator("#job-started")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d$|, "))
    expect(page.locator("#job-finished")).to_have_text(re.compile(r"\d\d:\d\d:\d\d"))
    expect(page.locator("#job-duration")).to_have_text(re.compile(r"^\d+ s$|^\d+ min \d+ s$"))
    expect(page.locator("#job-disk")).to_have_text(re.compile(r"^\d+(\.\d)? (KB|MB)$"))
    # the loss against the step: labelled ticks on both axes, more than the ends
    expect(page.locator("#loss-chart path.series").first).to_be_attached()
    x_ticks = texts(page, "#loss-chart text.x-tick")
    y_ticks = texts(page, "#loss-chart text.y-tick")
    assert len(x_ticks) >= 2 and all(re.fullmatch(r"\d+", t) for t in x_ticks), x_ticks
    assert len(y_ticks) >= 3 and all(re.fullmatch(r"[\d.,]+", t) for t in y_ticks), y_ticks
    steps = [int(t) for t in x_ticks]
    assert len({b - a for a, b in itertools.pairwise(steps)}) == 1, steps  # evenly spaced
    assert texts(page, "#loss-chart text.y-label") == ["loss"]
    assert texts(page, "#loss-chart text.x-label") == ["step"]
    # the token accuracy of a supervised job's steps
    expect(page.locator("#token-accuracy-chart path.series").first).to_be_attached()
    assert texts(page, "#token-accuracy-chart text.y-label") == ["accuracy"]
    # where a step's time goes besides compute, against the step: one line per metric
    for chart, unit, count in (
        ("pipeline-chart", "seconds", 3),
        ("transfer-chart", "GB/s", 2),
        ("optimizer-chart", "seconds", 4),
    ):
        expect(page.locator(f"#{chart} path.series")).to_have_count(count)
        assert texts(page, f"#{chart} text.y-label") == [unit]
        assert texts(page, f"#{chart} text.x-label") == ["step"]
        assert len(texts(page, f"#{chart} text.y-tick")) >= 2
    for figure in ("#prefetch-hit-rate", "#idle-between-ratio"):
        expect(page.locator(figure)).to_have_text(re.compile(r"^[\d.,e+-]+%$"))
    # utilization and memory against time: seconds since the run started, percent and GB
    for chart, unit in (("gpu-chart", "utilization (%)"), ("memory-chart", "memory used (GB)")):
        drawn = page.locator(f"#{chart} svg .series, #{chart} svg .point")
        expect(drawn.first).to_be_attached(timeout=30_000)
        assert texts(page, f"#{chart} text.y-label") == [unit]
        assert texts(page, f"#{chart} text.x-label") == ["time since the run started"]
        assert len(texts(page, f"#{chart} text.y-tick")) >= 3
        x_labels = texts(page, f"#{chart} text.x-tick")
        assert x_labels and all(re.fullmatch(r"0|[\d.]+ (s|min|h)", t) for t in x_labels), x_labels
    assert texts(page, "#gpu-chart text.y-tick")[-1] == "100"
    screenshot(page, "job-manage-cancelled")

    stopped_at = job["step"]
    resume.click()
    expect(page.locator("#job-status")).to_have_text(re.compile("queued|running|succeeded"))
    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=TIMEOUT_S * 1000)
    expect(page.locator("#job-step")).to_have_text(f"step {STEPS} / {STEPS}")
    expect(resume).to_be_hidden()
    expect(delete).to_be_visible()
    expect(page.locator("#event-log li").filter(has_text=f"step {stopped_at}").first).to_be_attached()
    expect(page.locator("#loss-chart path.series").first).to_have_attribute("data-count", str(STEPS))
    expect(page.locator("#job-finished")).to_have_text(re.compile(r"\d\d:\d\d:\d\d"))
    screenshot(page, "job-manage-resumed")
    made["succeeded"] = job_id
    # a narrow window: the times, the buttons and the charts' ticks fit without a sideways scroll
    page.set_viewport_size(NARROW)
    page.wait_for_timeout(300)  # the charts redraw for the new width
    assert len(texts(page, "#loss-chart text.x-tick")) >= 2
    size = page.evaluate("() => ({scroll: document.documentElement.scrollWidth, inner: window.innerWidth})")
    assert size["scroll"] <= size["inner"] + 1, size
    screenshot(page, "job-manage-narrow")


def test_delete_from_the_jobs_list_and_from_the_job_page(
    page: Page, server: Server, made: dict[str, Any]
) -> None:
    done = made.get("succeeded")
    if done is None:
        pytest.skip("needs the job resumed by the test before")
    queued = start(server, made, steps=2000)
    with server.client() as client:
        client.post(f"/api/jobs/{queued}/cancel")
    wait(server, queued, lambda j: j["status"] == "cancelled")
    folder = server.home / "runs" / done
    assert folder.is_dir()

    page.goto(f"{server.base_url}/#/jobs")
    row = page.locator(f'#jobs-table tbody tr[data-job-id="{done}"]')
    expect(row).to_be_visible()
    expect(page.locator("#disk-total")).to_have_text(re.compile(r" on disk in \d+ jobs? · .* free$"))
    expect(row.locator(".duration")).to_have_text(re.compile(r"^\d+ s$|^\d+ min \d+ s$"))
    expect(row.locator(".disk")).to_have_text(re.compile(r"^\d+(\.\d)? (KB|MB)$"))
    expect(row.locator(".created")).to_have_text(re.compile(r" ago$"))
    screenshot(page, "jobs-manage")
    dialogs: list[str] = []

    def accept(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    row.locator("button.delete-job").click()
    expect(row).to_have_count(0)
    assert dialogs and "Delete job" in dialogs[0], dialogs
    assert not folder.exists()

    page.goto(f"{server.base_url}/#/jobs/{queued}")
    expect(page.locator("#job-status")).to_have_text("cancelled")
    # the page's panels have loaded (their requests would meet a deleted job otherwise: a 404)
    expect(page.locator("#checkpoints-table tbody tr")).not_to_have_count(0)
    expect(page.locator("#evaluations-table tbody tr")).not_to_have_count(0)
    page.wait_for_load_state("load")
    page.locator("#delete-job").click()
    page.wait_for_url(re.compile(r"#/jobs$"))
    expect(page.locator("#jobs-table")).to_be_visible()
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{queued}"]')).to_have_count(0)
    assert len(dialogs) == 2
    with server.client() as client:
        assert client.get(f"/api/jobs/{queued}").status_code == 404
        assert client.get(f"/api/jobs/{done}").status_code == 404
