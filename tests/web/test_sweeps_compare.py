"""The sweep and compare pages in the browser: a two-trial sweep run by the worker shows its
trials' table, overlaid loss curves and the best trial with its links; Compare from the sweep and
from the jobs list (ticking jobs) overlays the runs, shows only the config rows that differ and
the final metrics side by side; the step or token axis. Screenshots under
``test-artifacts/screenshots/``; the page fixture fails on any console error.

It deletes the trials it ran (the jobs-list test of ``test_ui.py`` counts the cancelled ones)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.jobs import job_body, wait_for
from tests.web.conftest import CHROMIUM, VIEWPORT, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, ViewportSize, expect

NARROW: ViewportSize = {"width": 420, "height": 800}
ROWS = [
    {"messages": [{"role": "user", "content": f"add {i}"}, {"role": "assistant", "content": str(i % 5)}]}
    for i in range(30)
]


def no_overflow(page: Page) -> bool:
    size = page.evaluate("() => ({scroll: document.documentElement.scrollWidth, inner: window.innerWidth})")
    return bool(size["scroll"] <= size["inner"] + 1)


@pytest.fixture(scope="module")
def sweep(server: Server) -> Iterator[dict[str, Any]]:
    """A finished two-trial sweep (learning rates 0.001 and 0.3); its jobs deleted at the end."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    with server.client() as client:
        r = client.post("/api/datasets", files={"file": ("sweep.jsonl", content)}, data={"name": "sweep"})
        assert r.status_code == 201, r.text
        dataset_id = r.json()["id"]
        body = {
            "name": "lr sweep",
            "job": job_body(
                dataset_id, hyper={"max_steps": 3}, eval={"every_steps": 1}, data={"validation_fraction": 0.2}
            ),
            "parameters": {"learning_rate": [0.001, 0.3]},
            "metric": "loss/val",
        }
        r = client.post("/api/sweeps", json=body)
        assert r.status_code == 201, r.text
        made = r.json()
        try:
            done = wait_for(
                lambda: client.get(f"/api/sweeps/{made['id']}").json(),
                timeout=300,
                until=lambda s: s["status"] == "finished",
                what="the sweep's trials",
                details=server.log_tail,
            )
            assert {t["status"] for t in done["trials"]} == {"succeeded"}, server.log_tail()
            yield done
        finally:
            client.post(f"/api/sweeps/{made['id']}/cancel")
            for trial in made["trials"]:
                wait_for(
                    lambda t=trial: client.get(f"/api/jobs/{t['job_id']}").json()["status"],
                    timeout=120,
                    until=lambda s: s in ("succeeded", "failed", "cancelled"),
                )
                client.delete(f"/api/jobs/{trial['job_id']}")
            client.delete(f"/api/datasets/{dataset_id}")


@pytest.mark.slow
def test_the_sweep_page_shows_trials_curves_and_the_best(
    page: Page, server: Server, sweep: dict[str, Any]
) -> None:
    page.goto(f"{server.base_url}/#/sweeps")
    expect(page.locator(f'#sweeps-table tr[data-sweep-id="{sweep["id"]}"]')).to_contain_text("lr sweep")
    page.locator(f'#sweeps-table tr[data-sweep-id="{sweep["id"]}"] a').click()
    expect(page.locator("#sweep-name")).to_have_text("lr sweep")
    expect(page.locator("#sweep-status")).to_have_text("finished")
    expect(page.locator("#sweep-summary")).to_contain_text("grid search over learning_rate · 2 trials")
    rows = page.locator("#trials-table tbody tr")
    expect(rows).to_have_count(2)
    expect(page.locator("#trials-head th")).to_have_text(
        ["#", "learning_rate", "loss/val", "Status", "Step", "Time", ""]
    )
    expect(rows.nth(0).locator("td.param")).to_have_text("0.001")
    expect(rows.nth(1).locator("td.param")).to_have_text("0.3")
    for i in range(2):
        expect(rows.nth(i)).to_contain_text("succeeded")
        shown = rows.nth(i).locator("td.metric").text_content() or ""
        assert float(shown.replace(",", "")) == pytest.approx(
            sweep["trials"][i]["metric"], rel=1e-3, abs=1e-3
        )
    best = sweep["best_job_id"]
    expect(page.locator(f'#trials-table tr.best[data-job-id="{best}"] .best-mark')).to_have_text("★ best")
    expect(page.locator("#sweep-loss-chart path.series")).to_have_count(2)
    expect(page.locator("#sweep-loss-chart .legend")).to_contain_text("(best)")
    expect(page.locator("#best-checkpoints")).to_have_attribute("href", f"#/jobs/{best}")
    expect(page.locator("#best-playground")).to_have_attribute("href", f"#/playground/{best}")
    expect(page.locator("#best-export")).to_have_attribute("href", f"/api/jobs/{best}/checkpoints/3/download")
    expect(page.locator("#cancel-sweep")).to_be_hidden()
    screenshot(page, "sweep-page")
    page.set_viewport_size(NARROW)  # the nav, the table and the chart fit without a sideways scroll
    page.wait_for_timeout(300)
    assert no_overflow(page), "the sweep page scrolls sideways at 420 px"
    screenshot(page, "sweep-page-narrow")
    page.set_viewport_size(VIEWPORT)

    page.locator("#compare-trials").click()
    expect(page).to_have_url(
        f"{server.base_url}/#/compare/{sweep['trials'][0]['job_id']},{sweep['trials'][1]['job_id']}"
    )
    expect(page.locator("#compare-loss-train path.series")).to_have_count(2)


@pytest.mark.slow
def test_compare_from_the_jobs_list_shows_only_differences(
    page: Page, server: Server, sweep: dict[str, Any]
) -> None:
    a, b = (t["job_id"] for t in sweep["trials"])
    page.goto(f"{server.base_url}/#/jobs")
    compare = page.locator("#compare-jobs")
    page.locator(f'#jobs-table tr[data-job-id="{a}"] input.pick-job').check()
    expect(compare).to_be_hidden()  # one job is nothing to compare
    page.locator(f'#jobs-table tr[data-job-id="{b}"] input.pick-job').check()
    expect(compare).to_have_text("Compare 2")
    compare.click()
    expect(page.locator("#app h1")).to_have_text("Compare jobs")
    # the trials differ in their learning rate and name only (and their outputs, left out)
    expect(page.locator("#config-diff tbody tr")).to_have_count(1)
    expect(page.locator('#config-diff tr[data-field="hyper.learning_rate"] td')).to_have_text(
        ["0.001", "0.3"]
    )
    for chart in ("#compare-loss-train", "#compare-loss-val", "#compare-throughput-tokens-per-s"):
        expect(page.locator(f"{chart} path.series")).to_have_count(2)
    finals = page.locator("#final-metrics tbody tr")
    expect(finals.filter(has_text="Final validation loss").locator("td")).to_have_count(2)
    shown = finals.filter(has_text="Final validation loss").locator("td").all_text_contents()
    val = [t["last_metric"] for t in sweep["trials"]]
    assert [float(v.replace(",", "")) for v in shown] == pytest.approx(val, rel=1e-3, abs=1e-3)
    expect(finals.filter(has_text="Steps").locator("td")).to_have_text(["3/3", "3/3"])
    steps = page.locator("#compare-loss-train text.x-label")
    expect(steps).to_have_text("step")
    page.select_option("#compare-axis", "tokens")
    expect(steps).to_have_text("tokens trained")
    expect(page.locator("#compare-loss-train path.series")).to_have_count(2)
    screenshot(page, "compare-page")
    page.set_viewport_size(NARROW)
    page.wait_for_timeout(300)
    assert no_overflow(page), "the compare page scrolls sideways at 420 px"
    page.set_viewport_size(VIEWPORT)

    page.goto(f"{server.base_url}/#/compare/{a}")
    expect(page.locator("#compare-error")).to_have_text("Compare takes 2 to 6 jobs (got 1).")
