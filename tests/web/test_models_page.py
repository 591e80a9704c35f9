"""The Hub in the browser, against the local server that stands in for it (``Server.hub``): the
Models page lists the local models, pulls a tiny model by repo id with a progress bar (a worker
downloads it), lists it as pulled from the Hub, and deletes it showing the bytes freed; a
checkpoint's row pushes it to a Hub repo and shows the push's progress and the repo's link, then
pushes it as a GGUF in the format and variant chosen in its form."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.tiny import tiny_model_folder
from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_job_manage import ROWS, start, wait

REPO = "org/web-tiny"


@pytest.fixture(scope="module")
def made(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    server.hub.add_folder(REPO, tiny_model_folder(tmp_path_factory.mktemp("hub") / "web-tiny"))
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("push.jsonl", content)}, data={"name": "push"})
        assert r.status_code == 201, r.text
        state: dict[str, Any] = {"dataset_id": r.json()["id"], "jobs": []}
        yield state
        for job_id in state["jobs"]:
            client.delete(f"/api/jobs/{job_id}")
        client.delete(f"/api/datasets/{state['dataset_id']}")
        client.delete(f"/api/models/{REPO}")


def test_pull_a_model_from_the_models_page_then_delete_it(
    page: Page, server: Server, made: dict[str, Any], console: ConsoleWatch
) -> None:
    console.allow(r"status of 404")  # the unknown repo below
    page.goto(f"{server.base_url}/#/models")
    tiny = page.locator('#models-table tr[data-model="tiny"]')
    expect(tiny.locator(".model-source")).to_have_text("models folder")
    expect(tiny.locator(".model-supported")).to_have_text("yes")
    expect(tiny.locator(".model-family")).not_to_have_text("–")
    expect(page.locator('nav a[data-nav="models"]')).to_have_attribute("aria-current", "page")

    page.get_by_label("Repo id").fill("org/missing")
    page.get_by_role("button", name="Pull").click()
    expect(page.locator("#pull-error")).to_contain_text("no repo 'org/missing' on the Hub")

    page.get_by_label("Repo id").fill(REPO)
    page.get_by_role("button", name="Pull").click()
    line = page.locator(f'.transfer[data-repo="{REPO}"]')
    expect(line.locator(".transfer-status")).to_have_text("succeeded", timeout=60_000)
    bar = line.locator("progress")
    assert bar.evaluate("p => p.value === p.max && p.max > 1"), bar.evaluate("p => [p.value, p.max]")
    pulled = page.locator(f'#models-table tr[data-model="{REPO}"]')
    expect(pulled.locator(".model-source")).to_have_text("Hugging Face Hub")
    expect(pulled.locator(".model-supported")).to_have_text("yes")
    screenshot(page, "models-page")
    assert (server.home / "models" / "org" / "web-tiny" / "config.json").is_file()

    page.once("dialog", lambda dialog: dialog.accept())
    pulled.locator("button.delete-model").click()
    expect(page.locator("#models-notice")).to_contain_text(f"Deleted {REPO}:")
    expect(page.locator("#models-notice")).to_contain_text("freed")
    expect(pulled).to_have_count(0)
    assert not (server.home / "models" / "org" / "web-tiny").exists()


@pytest.mark.slow
def test_push_a_checkpoint_from_its_row(page: Page, server: Server, made: dict[str, Any]) -> None:
    job_id = start(server, made, steps=2)
    wait(server, job_id, lambda j: j["status"] == "succeeded")
    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    row = page.locator('#checkpoints-table tbody tr[data-step="2"]')
    expect(row).to_be_visible(timeout=20_000)
    row.locator("button.push-checkpoint").click()
    panel = page.locator("#checkpoints-table tr.push-panel").first
    panel.locator("input.push-repo").fill("me/web-push")
    panel.locator("button.push-submit").click()
    expect(panel.locator(".transfer-status")).to_have_text("succeeded", timeout=90_000)
    expect(panel.locator("a.push-link")).to_have_attribute("href", f"{server.hub.url}/me/web-push")
    screenshot(page, "checkpoint-push")
    pushed = server.hub.repos[("model", "me/web-push")]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(pushed.files)
    assert pushed.private and b"library_name: peft" in pushed.files["README.md"]

    # the formats the job's listing allows, as the downloads offer them; a GGUF in the chosen variant
    choice = panel.locator("select.push-format")
    expect(choice.locator("option")).to_have_count(3)
    assert choice.locator("option").evaluate_all("os => os.map(o => o.value)") == [
        "checkpoint",
        "merged",
        "gguf",
    ]
    expect(panel.locator("select.push-variant")).to_be_hidden()
    choice.select_option("gguf")
    expect(panel.locator("select.push-variant")).to_have_value("q8_0")  # the format's default
    panel.locator("select.push-variant").select_option("f16")
    panel.locator("input.push-repo").fill("me/web-gguf")
    screenshot(page, "checkpoint-push-gguf")
    panel.locator("button.push-submit").click()
    line = panel.locator('.transfer[data-repo="me/web-gguf"]')
    expect(line.locator(".transfer-status")).to_have_text("succeeded", timeout=120_000)
    pushed = server.hub.repos[("model", "me/web-gguf")]
    assert {"model-f16.gguf", "adapter-f32.gguf", "Modelfile", "README.md"} <= set(pushed.files), sorted(
        pushed.files
    )
    assert b"library_name: gguf" in pushed.files["README.md"]
    assert not any(name.endswith(".safetensors") for name in pushed.files)
