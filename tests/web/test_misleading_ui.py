"""In the browser: ``/docs`` renders its operations with no network but this server's, the nav
links to it, the plan card of this CPU-only box says it plans a CPU host, and the new-job form
preselects a training set (not a held-out one) and its held-out set as validation."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.web.conftest import Server, screenshot

pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, Route, expect


def test_docs_render_the_operations_offline(page: Page, server: Server) -> None:
    here = urlsplit(server.base_url).netloc
    elsewhere: list[str] = []

    def only_this_server(route: Route) -> Any:
        if urlsplit(route.request.url).netloc == here or route.request.url.startswith("data:"):
            return route.continue_()
        elsewhere.append(route.request.url)
        return route.abort()

    page.route("**/*", only_this_server)
    page.goto(f"{server.base_url}/#/jobs")
    link = page.get_by_role("link", name="API docs")
    expect(link).to_have_attribute("href", "/docs")
    page.goto(f"{server.base_url}/docs")
    operations = page.locator(".opblock")
    expect(operations.first).to_be_visible(timeout=30_000)
    assert operations.count() > 20
    expect(page.locator(".opblock-summary-path", has_text="/api/plan").first).to_be_visible()
    assert elsewhere == [], elsewhere
    screenshot(page, "docs-offline")


def test_the_plan_card_says_it_plans_this_cpu_host(page: Page, server: Server) -> None:
    hosts = server.client().get("/api/gpus").json()
    if any(h["gpu"] for h in hosts["data"] if h["online"]):
        pytest.skip("a worker here reports GPUs")
    page.goto(f"{server.base_url}/#/jobs/new")
    page.select_option("select#base-model", "tiny")
    expect(page.locator("#plan-hardware")).to_have_text("CPU host (no GPU reported)", timeout=30_000)
    expect(page.locator("#plan")).to_contain_text("GFLOP/s fp32 on the CPU")
    expect(page.locator("#plan")).not_to_contain_text("assumes 2 GPUs")
    screenshot(page, "plan-cpu-host")


def test_new_job_preselects_the_training_set_and_its_held_out_set(page: Page, server: Server) -> None:
    rows = [{"messages": [{"role": "user", "content": "2?"}, {"role": "assistant", "content": "2"}]}] * 8
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    ids = {}
    with server.client() as client:
        for name in ("preselect (train)", "other data", "preselect (held-out)"):  # the last is newest
            r = client.post("/api/datasets", files={"file": ("d.jsonl", content)}, data={"name": name})
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("select#dataset")).to_have_value(ids["other data"])  # newest not held out
    expect(page.locator("select#validation-dataset")).to_have_value("")  # it has no held-out set
    page.select_option("select#dataset", ids["preselect (train)"])
    expect(page.locator("select#validation-dataset")).to_have_value(ids["preselect (held-out)"])
    page.select_option("select#validation-dataset", "")  # the user's pick stays
    page.select_option("select#dataset", ids["other data"])
    page.select_option("select#dataset", ids["preselect (train)"])
    expect(page.locator("select#validation-dataset")).to_have_value("")
    with server.client() as client:
        client.delete(f"/api/datasets/{ids['other data']}")
    page.reload()
    expect(page.locator("select#dataset")).to_have_value(ids["preselect (train)"])
    expect(page.locator("select#validation-dataset")).to_have_value(ids["preselect (held-out)"])
    with server.client() as client:  # the other tests' forms start as before
        for name in ("preselect (train)", "preselect (held-out)"):
            client.delete(f"/api/datasets/{ids[name]}")
