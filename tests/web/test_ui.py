"""The web UI in a real browser against a real server, written to the element contract in
``web/CONTRACT.md``: login, datasets (upload, preview, errors by line), a LoRA job on the tiny
model from the new-job form (planned with the very request it sends) to its downloaded adapter,
cancelling, the jobs list and its filter, the GPUs page, keyboard reachability and narrow windows.

The tests share one server (see ``conftest.py``) and run in file order: the job tests use the
dataset uploaded through the datasets page, the jobs-list test the two jobs started before it.
Each page is saved as a screenshot under ``test-artifacts/screenshots/``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, VIEWPORT, ConsoleWatch, Server, open_page, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Browser, Page, expect

NARROW = {"width": 420, "height": 800}
TERMINAL = ("succeeded", "failed", "cancelled")
GOOD_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"what is {i} plus {i % 5}?"},
            {"role": "assistant", "content": f"the answer is {i + i % 5}."},
        ]
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    """What one test made for the later ones: the dataset id, the two jobs' ids."""
    return {}


def good_jsonl() -> str:
    return "".join(json.dumps(r) + "\n" for r in GOOD_ROWS)


def bad_jsonl() -> str:
    good = json.dumps(GOOD_ROWS[0])
    missing = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]})
    return "\n".join([good, '{"messages": [', good, missing, good]) + "\n"


def dataset_rows(page: Page) -> list[str]:
    rows = page.locator("#datasets-table tbody tr[data-dataset-id]")
    return [rows.nth(i).get_attribute("data-dataset-id") or "" for i in range(rows.count())]


def job_rows(page: Page) -> list[str]:
    rows = page.locator("#jobs-table tbody tr[data-job-id]")
    return [rows.nth(i).get_attribute("data-job-id") or "" for i in range(rows.count())]


def ensure_dataset(server: Server, shared: dict[str, Any], tmp_path: Path) -> str:
    """The dataset uploaded by the datasets test, or (when that test failed) one sent to the API."""
    if "dataset_id" not in shared:
        path = tmp_path / "chat.jsonl"
        path.write_text(good_jsonl())
        with server.client() as client, path.open("rb") as f:
            r = client.post("/api/datasets", files={"file": ("chat.jsonl", f)})
        assert r.status_code == 201, r.text
        shared["dataset_id"] = r.json()["id"]
    return str(shared["dataset_id"])


def fill_new_job(
    page: Page, server: Server, dataset_id: str, *, max_steps: int, every: int, name: str
) -> None:
    """Open the new-job page and fill the form: tiny model, the dataset, LoRA, 2 micro-batches."""
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.locator("#job-name").fill(name)
    page.select_option("select#base-model", "tiny")
    page.select_option("select#dataset", dataset_id)
    page.check("input[name=method][value=lora]")
    page.fill("input#max-steps", str(max_steps))
    page.fill("input#batch-size", "4")
    page.fill("input#checkpoint-every", str(every))
    advanced = page.locator("details#advanced")
    if advanced.get_attribute("open") is None:
        advanced.locator("summary").click()
    expect(page.locator("input#num-microbatches")).to_be_visible()
    page.fill("input#num-microbatches", "2")


def submit_job(page: Page) -> str:
    page.get_by_role("button", name="Start fine-tune").click()
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"), timeout=20_000)
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("#job-status")).to_be_visible()
    return job_id


def job_snapshot(page: Page) -> dict[str, Any]:
    """What the job page shows now: status, progress, loss points, checkpoint rows."""
    return page.evaluate(
        """() => {
          const progress = document.querySelector('#job-progress');
          const series = document.querySelector('#loss-chart path.series');
          return {
            status: (document.querySelector('#job-status') || {}).textContent || '',
            value: progress ? progress.value : null,
            max: progress ? progress.max : null,
            step: (document.querySelector('#job-step') || {}).textContent || '',
            count: series ? Number(series.getAttribute('data-count')) : 0,
            checkpoints: document.querySelectorAll('#checkpoints-table tbody tr[data-step]').length,
          };
        }"""
    )


def no_horizontal_overflow(page: Page) -> dict[str, int]:
    return page.evaluate("() => ({scroll: document.documentElement.scrollWidth, inner: window.innerWidth})")


def test_not_logged_in_then_login_through_the_token_url(browser: Browser, server: Server) -> None:
    console = ConsoleWatch()
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = open_page(context, console)
        page.goto(f"{server.base_url}/")
        expect(page.locator("#login-needed")).to_be_visible()
        expect(page.locator("#login-needed")).to_contain_text("login")
        expect(page.locator("#jobs-table")).to_have_count(0)
        screenshot(page, "login-needed")
        # only a network 401 from the not-logged-in API calls would be excused, nothing else
        bad = [m for m in console.unexpected() if not re.search(r"status of 401\b", m)]
        assert not bad, bad
        console.seen.clear()

        page.goto(server.login_url)
        page.wait_for_url(f"{server.base_url}/**")
        assert page.url.split("#", 1)[0] == f"{server.base_url}/", page.url
        expect(page.locator("#jobs-table")).to_be_visible()
        expect(page.locator("#login-needed")).to_be_hidden()
        expect(page.get_by_role("link", name="New job").first).to_be_visible()
        screenshot(page, "jobs-after-login")
        assert not console.unexpected(), console.unexpected()
        # the link works once: opened again it says so, and how to get a new one
        page.goto(server.login_url)
        expect(page.locator("h1")).to_contain_text("already used or has expired")
        expect(page.locator("body")).to_contain_text("roundhouse login-url")
        page.close()
        bad = [m for m in console.unexpected() if not re.search(r"status of 401\b", m)]
        assert not bad, bad
    finally:
        context.close()


def test_datasets_upload_preview_and_errors_by_line(
    page: Page, console: ConsoleWatch, server: Server, shared: dict[str, Any], tmp_path: Path
) -> None:
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.locator("input#dataset-file")).to_be_attached()
    expect(page.locator("#datasets-table")).to_be_visible()
    expect(page.get_by_label("Dataset file")).to_be_attached()
    before = dataset_rows(page)

    good = tmp_path / "chat.jsonl"
    good.write_text(good_jsonl())
    page.set_input_files("input#dataset-file", str(good))
    rows = page.locator("#datasets-table tbody tr[data-dataset-id]")
    expect(rows).to_have_count(len(before) + 1, timeout=30_000)
    (new_id,) = set(dataset_rows(page)) - set(before)
    shared["dataset_id"] = new_id
    row = page.locator(f'#datasets-table tbody tr[data-dataset-id="{new_id}"]')
    expect(row).to_contain_text("chat.jsonl")
    expect(row).to_contain_text("40")
    expect(page.locator("#upload-errors li")).to_have_count(0)

    row.get_by_role("button", name="Preview").click()
    preview = page.locator("section#preview")
    expect(preview).to_be_visible()
    page.select_option("select#preview-model", "tiny")
    expect(preview.locator(".preview-row").first).to_be_visible(timeout=30_000)
    expect(preview.locator("span.tok.trained").first).to_be_attached()
    trained = "".join(preview.locator("span.tok.trained").all_text_contents())
    context_text = "".join(preview.locator("span.tok:not(.trained)").all_text_contents())
    first = GOOD_ROWS[0]["messages"]
    assert first[1]["content"] in trained, trained
    # the question is context, not trained on
    assert first[0]["content"] not in trained and first[0]["content"] in context_text, context_text
    expect(page.locator("rh-histogram#token-histogram svg rect.bar").first).to_be_attached(timeout=30_000)
    screenshot(page, "datasets-preview")

    count = len(dataset_rows(page))
    bad = tmp_path / "broken.jsonl"
    bad.write_text(bad_jsonl())
    # the rejected upload is a 422 answer, which Chromium logs as a failed resource load
    console.allow(r"status of 422 .*/api/datasets\]$")
    page.set_input_files("input#dataset-file", str(bad))
    errors = page.locator("ul#upload-errors > li")
    expect(errors.first).to_be_visible(timeout=30_000)
    texts = errors.all_text_contents()
    lines = sorted(int(m.group(1)) for t in texts if (m := re.match(r"line (\d+): \S", t)))
    assert lines == [2, 4], texts
    expect(page.locator("#upload-status")).not_to_have_text("")
    page.wait_for_timeout(500)
    assert len(dataset_rows(page)) == count, "the bad file was stored"
    screenshot(page, "datasets-upload-errors")


def test_datasets_drop_zone_uploads_and_delete_removes(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.locator("#drop-zone")).to_be_visible()
    expect(page.locator("#datasets-table")).to_be_visible()
    expect(page.locator("#datasets-table tbody tr").first).to_be_attached()  # listed (or "none yet")
    before = dataset_rows(page)
    page.evaluate(
        """(text) => {
          const data = new DataTransfer();
          data.items.add(new File([text], "dropped.jsonl", {type: "application/json"}));
          const zone = document.querySelector("#drop-zone");
          for (const type of ["dragenter", "dragover", "drop"]) {
            zone.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: data}));
          }
        }""",
        good_jsonl(),
    )
    rows = page.locator("#datasets-table tbody tr[data-dataset-id]")
    expect(rows).to_have_count(len(before) + 1, timeout=30_000)
    (dropped,) = set(dataset_rows(page)) - set(before)
    row = page.locator(f'#datasets-table tbody tr[data-dataset-id="{dropped}"]')
    expect(row).to_contain_text("dropped.jsonl")

    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Delete").click()
    expect(row).to_have_count(0)
    assert sorted(dataset_rows(page)) == sorted(before)


def test_new_job_runs_to_success_and_its_adapter_downloads(
    page: Page, server: Server, shared: dict[str, Any], tmp_path: Path
) -> None:
    dataset_id = ensure_dataset(server, shared, tmp_path)
    fill_new_job(page, server, dataset_id, max_steps=40, every=10, name="ui tiny lora")
    request = page.locator("pre#request-preview")
    expect(request).to_contain_text('"max_steps": 40')
    expect(request).to_contain_text('"num_microbatches": 2')
    expect(request).to_contain_text('"batch_size": 4')
    expect(request).to_contain_text(dataset_id)
    expect(request).to_contain_text("curl")
    expect(page.get_by_role("button", name="Copy request")).to_be_visible()
    # the plan before starting: fit, predicted throughput and an ETA for the 40 steps
    expect(page.locator("#plan-fits")).to_have_text("Fits on this box.")
    expect(page.locator("#plan")).not_to_contain_text("null")
    if shutil.which("nvidia-smi") is None:  # a CPU host reports no GPU: its CPU is planned
        expect(page.locator("#plan-hardware")).to_have_text("CPU host (no GPU reported)")
    expect(page.locator("#plan-tokens")).to_have_text(re.compile(r"\d"))
    expect(page.locator("#plan-eta")).to_have_text(re.compile(r"\d+ (s|min|h)"))
    screenshot(page, "new-job")

    job_id = submit_job(page)
    shared["succeeded_job"] = job_id
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        snap = job_snapshot(page)
        samples.append(snap)
        if snap["status"] == "running" and snap["value"] and "job-running" not in shared:
            shared["job-running"] = True
            screenshot(page, "job-running")
        if snap["status"] in TERMINAL:
            break
        page.wait_for_timeout(100)
    final = samples[-1]
    assert final["status"] == "succeeded", (final, server.log_tail())
    expect(page.locator("#job-status")).to_have_text("succeeded")

    values = [s["value"] for s in samples if s["value"]]
    counts = [s["count"] for s in samples if s["count"]]
    # seen while running: the progress bar and the loss chart grew in more than one step
    assert len(set(values)) >= 2 and values == sorted(values), values
    assert len(set(counts)) >= 2 and counts == sorted(counts), counts
    live_checkpoints = [s["checkpoints"] for s in samples if s["status"] == "running"]
    assert max(live_checkpoints, default=0) >= 1, "no checkpoint row appeared while the job ran"
    expect(page.locator("progress#job-progress")).to_have_attribute("max", "40")
    assert page.eval_on_selector("#job-progress", "p => p.value") == 40
    expect(page.locator("#job-step")).to_have_text(re.compile(r"step 40 / 40"))
    checkpoints = page.locator("#checkpoints-table tbody tr[data-step]")
    expect(checkpoints.first).to_be_visible(timeout=20_000)
    expect(page.locator('#checkpoints-table tbody tr[data-step="40"]')).to_be_visible(timeout=20_000)
    expect(page.locator("ol#event-log > li").first).to_be_attached()
    for stat in ("#tokens-per-s", "#learning-rate", "#bubble-ratio"):
        expect(page.locator(stat)).to_have_text(re.compile(r"\d"))
    for chart in ("gpu-chart", "memory-chart"):  # device history: utilization and memory
        drawn = f"rh-line-chart#{chart} svg .series, rh-line-chart#{chart} svg .point"
        expect(page.locator(drawn).first).to_be_attached(timeout=20_000)
    screenshot(page, "job-succeeded")

    link = page.locator('#checkpoints-table tbody tr[data-step="40"] a.download-adapter')
    expect(link).to_have_attribute("download", re.compile(".*"))
    with page.expect_download(timeout=60_000) as info:
        link.click()
    archive = tmp_path / "adapter.tar"
    info.value.save_as(archive)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()  # one top folder: its MANIFEST.sha256 first, then the files
        top = members[0].name
        assert members[0].isdir() and members[1].name == f"{top}/MANIFEST.sha256", [m.name for m in members]
        manifest = tar.extractfile(members[1])
        assert manifest is not None
        listed = {}
        for line in manifest.read().decode().splitlines():
            digest, name = line.split("  ", 1)
            listed[name] = digest
        files = {m.name.removeprefix(f"{top}/") for m in members[2:] if m.isfile()}
        assert listed and set(listed) == files, (sorted(listed), sorted(files))
        for name, digest in listed.items():
            data = tar.extractfile(f"{top}/{name}")
            assert data is not None
            assert hashlib.sha256(data.read()).hexdigest() == digest, name
    assert any("adapter" in name for name in listed), sorted(listed)

    before = job_snapshot(page)["count"]
    page.reload()
    page.wait_for_function(
        "() => Number((document.querySelector('#loss-chart path.series') || {getAttribute: () => 0})"
        ".getAttribute('data-count')) > 0",
        timeout=15_000,
    )
    page.wait_for_function(
        f"() => Number(document.querySelector('#loss-chart path.series').getAttribute('data-count')) "
        f"=== {before}",
        timeout=10_000,
    )
    expect(page.locator("#job-status")).to_have_text("succeeded")


def test_new_job_plans_the_very_request_it_would_send(
    page: Page, server: Server, shared: dict[str, Any], tmp_path: Path
) -> None:
    dataset_id = ensure_dataset(server, shared, tmp_path)
    with server.client() as client:
        rows = client.get(f"/api/datasets/{dataset_id}").json()["rows"]
    fill_new_job(page, server, dataset_id, max_steps=40, every=10, name="ui plan only")
    expect(page.locator("#plan-fits")).to_have_text("Fits on this box.")

    def by_epochs(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("hyper", {}).get("epochs") == 2

    with page.expect_response(by_epochs) as answer:
        page.fill("input#max-steps", "")
        page.fill("input#epochs", "2")
    response = answer.value
    assert response.status == 200, response.text()
    # POST /api/plan got exactly the POST /api/jobs body the page shows (and would send)
    preview = page.locator("pre#request-preview").text_content() or ""
    assert response.request.post_data_json == json.loads(preview.split("-d '", 1)[1].rsplit("'", 1)[0])
    # 2 epochs of the dataset's rows at 4 sequences per step: an ETA without max_steps
    plan = response.json()
    assert plan["eta_s"] == plan["iteration_s"] * max(1, 2 * (rows // 4))
    expect(page.locator("#plan-eta")).to_have_text(re.compile(r"\d+ (s|min|h)"))
    # the longest sequence that fits this job on the box, and what limits it
    longest = re.compile(rf"^{plan['max_seq_len']:,} tokens \((GPU memory|host RAM|model context)\)$")
    expect(page.locator("#plan-max-seq-len")).to_have_text(longest)


def test_new_job_form_shows_an_api_error(
    page: Page, console: ConsoleWatch, server: Server, shared: dict[str, Any], tmp_path: Path
) -> None:
    dataset_id = ensure_dataset(server, shared, tmp_path)
    fill_new_job(page, server, dataset_id, max_steps=10, every=5, name="ui rejected")
    # more micro-batches than sequences in a batch: the API refuses the config
    page.fill("input#num-microbatches", "8")
    expect(page.locator("pre#request-preview")).to_contain_text('"num_microbatches": 8')
    console.allow(r"status of 422 .*/api/jobs\]$")
    console.allow(r"status of 422 .*/api/plan\]$")  # the plan card refuses the same body
    page.get_by_role("button", name="Start fine-tune").click()
    expect(page.locator("#form-error")).to_contain_text("num_microbatches", timeout=15_000)
    assert page.url.endswith("#/jobs/new"), page.url
    screenshot(page, "new-job-error")


def test_cancel_a_running_job(page: Page, server: Server, shared: dict[str, Any], tmp_path: Path) -> None:
    dataset_id = ensure_dataset(server, shared, tmp_path)
    fill_new_job(page, server, dataset_id, max_steps=2000, every=500, name="ui long run")
    expect(page.locator("pre#request-preview")).to_contain_text('"max_steps": 2000')
    job_id = submit_job(page)
    shared["cancelled_job"] = job_id
    status = page.locator("#job-status")
    expect(status).to_have_text("running", timeout=90_000)
    page.wait_for_function("() => document.querySelector('#job-progress').value > 0", timeout=60_000)
    cancel = page.locator("#cancel-job")
    expect(cancel).to_be_visible()
    expect(cancel).to_have_text("Cancel job")
    cancel.click()
    expect(status).to_have_text("cancelled", timeout=90_000)
    expect(cancel).to_be_hidden()
    screenshot(page, "job-cancelled")


def test_jobs_page_lists_both_jobs_and_filters_by_status(
    page: Page, server: Server, shared: dict[str, Any]
) -> None:
    if "succeeded_job" not in shared or "cancelled_job" not in shared:
        pytest.skip("needs the two jobs started by the tests before")
    done, cancelled = shared["succeeded_job"], shared["cancelled_job"]
    page.goto(f"{server.base_url}/#/jobs")
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{done}"]')).to_be_visible()
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{cancelled}"]')).to_be_visible()
    expect(page.locator(f'tr[data-job-id="{done}"] .status')).to_have_text("succeeded")
    expect(page.locator(f'tr[data-job-id="{cancelled}"] .status')).to_have_text("cancelled")
    expect(page.locator(f'tr[data-job-id="{done}"] progress')).to_have_attribute("max", "40")
    screenshot(page, "jobs")

    page.select_option("select#status-filter", "cancelled")
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{done}"]')).to_have_count(0)
    # other browser tests share this server and may have left jobs of their own: every row the
    # filter keeps has the status, and these two jobs are where they belong
    statuses = page.locator("#jobs-table tbody tr[data-job-id] .status")
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{cancelled}"]')).to_have_count(1)
    assert set(statuses.all_inner_texts()) == {"cancelled"}
    # still so after the page's periodic refresh (every 3 s)
    page.wait_for_timeout(3500)
    assert cancelled in job_rows(page) and set(statuses.all_inner_texts()) == {"cancelled"}
    screenshot(page, "jobs-filter-cancelled")
    page.select_option("select#status-filter", "succeeded")
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{cancelled}"]')).to_have_count(0)
    expect(page.locator(f'#jobs-table tbody tr[data-job-id="{done}"]')).to_have_count(1)
    assert set(statuses.all_inner_texts()) == {"succeeded"}


def test_gpus_page_shows_this_host(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/#/gpus")
    host = page.locator("#gpu-hosts .host")
    expect(host.first).to_be_visible(timeout=30_000)
    expect(host).to_have_count(1)
    if shutil.which("nvidia-smi") is None:
        expect(host).to_contain_text("No GPU on this host")
    else:
        expect(host.locator("table")).to_be_visible()
    screenshot(page, "gpus")


def test_keyboard_reaches_the_new_job_form(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("select#base-model")).to_be_visible()
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    visited = []
    for _ in range(20):
        page.keyboard.press("Tab")
        visited.append(page.evaluate("() => document.activeElement.id || document.activeElement.tagName"))
        if visited[-1] == "base-model":
            break
    assert visited[-1] == "base-model", visited
    # and onwards to the submit button without a trap
    for _ in range(60):
        page.keyboard.press("Tab")
        label = page.evaluate("() => document.activeElement.textContent.trim()")
        if label == "Start fine-tune":
            break
    else:
        pytest.fail("Tab never reached the 'Start fine-tune' button")


@pytest.mark.parametrize("name", ["jobs", "job", "new-job", "datasets", "gpus"])
def test_narrow_window_has_no_horizontal_overflow(
    page: Page, server: Server, shared: dict[str, Any], name: str
) -> None:
    page.set_viewport_size(NARROW)
    ready = {
        "jobs": ("#/jobs", "#jobs-table tbody tr[data-job-id]"),
        "job": (f"#/jobs/{shared.get('succeeded_job')}", "#loss-chart path.series"),
        "new-job": ("#/jobs/new", "form#new-job-form"),
        "datasets": ("#/datasets", "#datasets-table tbody tr[data-dataset-id]"),
        "gpus": ("#/gpus", "#gpu-hosts .host"),
    }
    if name == "job" and "succeeded_job" not in shared:
        pytest.skip("needs the job run by the new-job test")
    route, selector = ready[name]
    page.goto(f"{server.base_url}/{route}")
    expect(page.locator(selector).first).to_be_visible(timeout=30_000)
    if name == "job":
        expect(page.locator('#checkpoints-table tbody tr[data-step="40"]')).to_be_visible()
    page.wait_for_timeout(300)  # the charts redraw for the new width
    screenshot(page, f"{name}-narrow")
    size = no_horizontal_overflow(page)
    assert size["scroll"] <= size["inner"] + 1, f"{name} at 420 px: {size}"
