"""Hosts in the UI: the GPUs page shows every worker under its host name, and the new-job page pins
a job to a host and a GPU count (the request carries ``placement``; the job waits for that host and
says so). A second host is a worker row written into the service's database. It leaves no job or
row behind."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_job_manage import ROWS

HOST = "gpu-b"
DEVICE = {"name": "NVIDIA H200", "utilization": 40.0, "memory_used": 2e9, "memory_total": 141e9}
DEVICE |= {"temperature": 50.0, "power_w": 300.0}


@pytest.fixture
def second_host(server: Server) -> Iterator[dict[str, Any]]:
    """A worker row of host gpu-b with 2 GPUs, sampled now; the test's jobs removed at the end."""
    devices = [DEVICE | {"index": i} for i in range(2)]
    stamp = datetime.now(UTC).replace(tzinfo=None).isoformat(sep=" ")
    with sqlite3.connect(server.home / "roundhouse.db") as db:
        db.execute(
            "INSERT INTO workers (id, hostname, devices, cpu, message, sampled_at, heartbeat_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (f"roundhouse-1@{HOST}", HOST, json.dumps(devices), "{}", "2 GPU(s)", stamp, stamp),
        )
    state: dict[str, Any] = {"jobs": []}
    yield state
    with server.client() as client:
        for job_id in state["jobs"]:
            client.post(f"/api/jobs/{job_id}/cancel")
            client.delete(f"/api/jobs/{job_id}")
    with sqlite3.connect(server.home / "roundhouse.db") as db:
        db.execute("DELETE FROM workers WHERE hostname = ?", (HOST,))


def test_hosts_on_the_gpus_page_and_a_job_pinned_to_one(
    page: Page, server: Server, second_host: dict[str, Any]
) -> None:
    page.goto(f"{server.base_url}/#/gpus")
    card = page.locator(f'#gpu-hosts .host[data-host="{HOST}"]')
    expect(card.locator("h2")).to_have_text(HOST)
    expect(card.locator("tbody tr")).to_have_count(2)
    expect(page.locator("#gpu-hosts .host")).to_have_count(2)  # and this machine's worker
    screenshot(page, "gpus-two-hosts")

    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("pin.jsonl", content)}, data={"name": "pin rows"})
    assert r.status_code == 201, r.text
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    page.select_option("select#dataset", r.json()["id"])
    page.fill("#max-steps", "2")
    page.select_option("#placement-host", HOST)
    page.fill("#placement-gpus", "2")
    expect(page.locator("#request-preview")).to_contain_text('"placement": {')
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]{32}$"))
    job_id = page.url.rsplit("/", 1)[1]
    second_host["jobs"].append(job_id)
    with server.client() as client:
        job = client.get(f"/api/jobs/{job_id}").json()
    assert job["placement"] == {"host": HOST, "gpus": 2}
    assert job["status"] == "queued"  # no worker of gpu-b takes it
    # leave the job's page: the fixture deletes the job at teardown, and a page still polling it
    # would log the 404s as console errors
    page.goto(f"{server.base_url}/#/gpus")
    expect(page.locator("#gpu-hosts .host").first).to_be_visible()
