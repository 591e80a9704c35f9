"""Dataset pulls in the browser, against the local server that stands in for the Hub
(``Server.hub``): the Datasets page pulls a split by repo id with a transfer line (a worker
downloads it), lists the stored dataset; an unknown repo is the API's error at once, a split with
an invalid row fails with its line, and a slow pull is cancelled from its line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def jsonl(rows: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def repos(server: Server) -> Iterator[None]:
    server.hub.add(
        "org/web-data",
        {
            "data/train-00000-of-00002.jsonl": jsonl(ROWS[:3]),
            "data/train-00001-of-00002.jsonl": jsonl(ROWS[3:]),
        },
        kind="dataset",
    )
    broken: list[dict[str, object]] = [*ROWS[:2], {"messages": [{"role": "user", "content": "no answer"}]}]
    server.hub.add("org/web-broken", {"train.jsonl": jsonl(broken)}, kind="dataset")
    server.hub.add("org/web-slow", {"train.jsonl": jsonl(ROWS * 400)}, kind="dataset")
    yield
    with server.client() as client:
        for d in client.get("/api/datasets").json()["data"]:
            if (d.get("source") or {}).get("hub", "").startswith("org/web-"):
                client.delete(f"/api/datasets/{d['id']}")


def pull(page: Page, repo: str) -> None:
    form = page.locator("#dataset-pull-form")
    form.get_by_label("Repo id").fill(repo)
    form.get_by_role("button", name="Pull").click()


def test_pull_a_split_from_the_datasets_page(
    page: Page, server: Server, repos: None, console: ConsoleWatch
) -> None:
    console.allow(r"status of 404")  # the unknown repo below
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.get_by_label("Split")).to_have_value("train")

    pull(page, "org/web-missing")
    expect(page.locator("#dataset-pull-error")).to_contain_text("no repo 'org/web-missing' on the Hub")

    pull(page, "org/web-data")
    line = page.locator('#dataset-pulls .transfer[data-repo="org/web-data"]')
    expect(line.locator(".transfer-status")).to_have_text("succeeded", timeout=60_000)
    bar = line.locator("progress")
    assert bar.evaluate("p => p.value === p.max && p.max > 1"), bar.evaluate("p => [p.value, p.max]")
    expect(page.locator("#dataset-pull-notice")).to_have_text("Pulled org/web-data (train): 6 rows (chat).")
    expect(page.locator("#datasets-table tbody tr", has_text="org/web-data (train)")).to_have_count(1)
    expect(page.locator("#dataset-pull-error")).to_be_empty()
    screenshot(page, "datasets-pull")

    pull(page, "org/web-broken")
    line = page.locator('#dataset-pulls .transfer[data-repo="org/web-broken"]')
    expect(line.locator(".transfer-status")).to_have_text("failed", timeout=60_000)
    expect(line.locator(".transfer-error li")).to_have_text(["line 3: no assistant turn"])
    expect(page.locator("#datasets-table tbody tr", has_text="org/web-broken")).to_have_count(0)

    server.hub.bytes_per_s = 20_000  # about 4 s for its 70 KB: time to cancel it
    try:
        pull(page, "org/web-slow")
        line = page.locator('#dataset-pulls .transfer[data-repo="org/web-slow"]')
        expect(line.locator(".transfer-status")).to_have_text("running", timeout=30_000)
        line.get_by_role("button", name="Cancel").click()
        expect(line.locator(".transfer-status")).to_have_text("cancelled", timeout=30_000)
        expect(line.get_by_role("button", name="Cancel")).to_be_hidden()
    finally:
        server.hub.bytes_per_s = None
    expect(page.locator("#datasets-table tbody tr", has_text="org/web-slow")).to_have_count(0)
