"""The GGUF export from a checkpoint's row in the browser: choose a quantization, download the
folder for llama.cpp and Ollama (model GGUF, adapter GGUF, Modelfile)."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_job_manage import ROWS, start, wait


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[dict[str, Any]]:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("gguf.jsonl", content)}, data={"name": "gguf"})
        assert r.status_code == 201, r.text
        state: dict[str, Any] = {"dataset_id": r.json()["id"], "jobs": []}
        yield state
        for job_id in state["jobs"]:
            client.delete(f"/api/jobs/{job_id}")
        client.delete(f"/api/datasets/{state['dataset_id']}")


@pytest.mark.slow
def test_download_a_checkpoint_as_gguf(
    page: Page, server: Server, made: dict[str, Any], tmp_path: Path
) -> None:
    job_id = start(server, made, steps=2)
    wait(server, job_id, lambda j: j["status"] == "succeeded")
    page.goto(f"{server.base_url}/#/jobs/{job_id}")
    row = page.locator('#checkpoints-table tbody tr[data-step="2"]')
    expect(row).to_be_visible(timeout=20_000)
    link = row.locator("a.download-gguf")
    # the table is redrawn while the job's past events replay (a redrawn row keeps the choice); a
    # choice made on a row just replaced is made again on the new one
    for _ in range(10):
        row.locator("select.variant-gguf").select_option("q4_k_m")
        if (
            link.get_attribute("href")
            == f"/api/jobs/{job_id}/checkpoints/2/download?format=gguf&variant=q4_k_m"
        ):
            break
        page.wait_for_timeout(300)
    expect(link).to_have_attribute(
        "href", f"/api/jobs/{job_id}/checkpoints/2/download?format=gguf&variant=q4_k_m"
    )
    expect(row.locator("select.variant-gguf")).to_have_value("q4_k_m")
    row.locator("select.variant-gguf").select_option("q8_0")
    screenshot(page, "checkpoint-gguf")
    with page.expect_download(timeout=120_000) as info:
        link.click()
    archive = tmp_path / "gguf.tar"
    info.value.save_as(archive)
    with tarfile.open(archive) as tar:
        names = {m.name.split("/", 1)[-1] for m in tar.getmembers()}
        modelfile = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/Modelfile")))
        assert modelfile is not None
        text = modelfile.read().decode()
    assert {"model-q8_0.gguf", "adapter-f32.gguf", "Modelfile", "MANIFEST.sha256"} <= names
    assert "FROM ./model-q8_0.gguf" in text
