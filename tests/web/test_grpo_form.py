"""A GRPO job from the new-job page: the method listing's GRPO option with its grader editor (its
other options rendered from its schema), a bad grader refused as it is typed (the field named next
to it), the grader tried on the first rows of the prompts dataset (a reward per row), the plan with
its rollouts, and the job page with the method, the reward charts and the graded samples of the
run's steps. It leaves no job behind."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, method_entry, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_dpo_form import _post
from tests.web.test_job_manage import wait

PROMPTS = [
    {"messages": [{"role": "user", "content": f"What is {n} + {n}?"}], "reference_answer": str(2 * n)}
    for n in range(8)
]


@pytest.fixture(scope="module")
def prompts(server: Server) -> Iterator[dict[str, Any]]:
    state: dict[str, Any] = {"prompts": _post(server, "grpo-form prompts", PROMPTS)["id"], "jobs": []}
    yield state
    with server.client() as client:
        for job_id in state["jobs"]:
            if client.get(f"/api/jobs/{job_id}").status_code == 404:
                continue
            client.post(f"/api/jobs/{job_id}/cancel")
            wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled", "paused"))
            client.delete(f"/api/jobs/{job_id}")
        client.delete(f"/api/datasets/{state['prompts']}")


def test_a_grpo_job_from_the_new_job_page(
    page: Page, console: ConsoleWatch, server: Server, prompts: dict[str, Any]
) -> None:
    # the bad grader's check answers 400, and the plan of the job with it 422, as they should
    console.allow(r"status of 400 .*/v1/fine_tuning/alpha/graders/validate")
    console.allow(r"status of 422 .*/api/plan")
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    page.fill("input#max-steps", "2")
    page.fill("input#batch-size", "4")
    advanced = page.locator("details#advanced")
    if advanced.get_attribute("open") is None:
        advanced.locator("summary").click()
    page.fill("input#num-microbatches", "2")

    schema = method_entry(server, "grpo")["options_schema"]["properties"]
    page.check("input#method-grpo")
    options = page.locator("fieldset#grpo-options")
    expect(options).to_be_visible()
    expect(page.locator("#dpo-options")).to_be_hidden()
    # the 4-bit base is offered where the method's schema takes method.base_bits=4
    four_bits = page.locator("#base-4bit-field")
    expect(four_bits).to_be_visible() if 4 in schema["base_bits"]["enum"] else expect(
        four_bits
    ).to_be_hidden()
    expect(page.locator('label[for="batch-size"]')).to_have_text("Batch size (rows)")
    page.select_option("select#dataset", prompts["prompts"])
    expect(page.locator("#dataset-fit")).not_to_have_class(re.compile(r"\berror\b"))
    # the example grader, checked by the API
    grader = page.locator("textarea#grader")
    spec = json.loads(grader.input_value())
    assert spec["type"] == "string_check" and spec["reference"] == "{{item.reference_answer}}"
    check = page.locator("#grader-check")
    expect(check).to_have_text("Valid string_check grader.")

    # a bad operation: refused as it is typed, the field named next to the grader
    with page.expect_response(lambda r: r.url.endswith("/graders/validate") and r.status == 400):
        grader.fill(json.dumps(spec | {"operation": "equals"}))
    expect(check).to_contain_text("grader.operation")
    expect(check).to_contain_text("equals")
    expect(check).to_have_class(re.compile(r"\berror\b"))
    expect(grader).to_have_attribute("aria-invalid", "true")
    grader.fill("{not json")
    expect(check).to_contain_text("not JSON")
    grader.fill(json.dumps(spec, indent=2))
    expect(check).to_have_text("Valid string_check grader.")
    expect(grader).not_to_have_attribute("aria-invalid", "true")

    # tried on the first 5 rows: each row's own reference answer scores 1; a fixed answer only
    # where it is that row's
    page.get_by_role("button", name="Try the grader on 5 samples").click()
    rows = page.locator("table#grader-trial tr.trial-row")
    expect(rows).to_have_count(5, timeout=30_000)  # the preview loads the model's tokenizer
    expect(rows.locator(".trial-reward")).to_have_text(["1"] * 5)
    expect(rows.first.locator(".trial-prompt")).to_contain_text("What is 0 + 0?")
    page.fill("input#grader-sample", "4")
    with page.expect_response(lambda r: r.url.endswith("/graders/run")) as ran:
        page.get_by_role("button", name="Try the grader on 5 samples").click()
    assert ran.value.status == 200, ran.value.text()
    expect(rows.locator(".trial-reward")).to_have_text(["0", "0", "1", "0", "0"])
    expect(rows.locator(".trial-sample")).to_have_text(["4"] * 5)

    # a full fine-tune takes a KL term too (its reference: a copy of its initial weights)
    page.select_option("select#grpo-tuning", "full")
    expect(page.locator("input#grpo-beta")).to_be_enabled()
    assert float(page.locator("input#grpo-beta").input_value()) == schema["beta"]["default"]
    page.fill("input#grpo-beta", "0.04")
    page.select_option("select#grpo-tuning", "lora")
    expect(page.locator("input#grpo-num-iterations")).to_have_value("1")

    # the settings, and the plan of the job with its rollouts
    page.fill("input#grpo-group-size", "2")
    page.fill("input#grpo-max-completion-tokens", "8")
    page.select_option("select#grpo-loss-type", "dapo")
    page.fill("input#lora-r", "4")

    def grpo_plan(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("method", {}).get("temperature") == 0.7

    with page.expect_response(grpo_plan, timeout=30_000) as answer:
        page.fill("input#grpo-temperature", "0.7")
    assert answer.value.status == 200, answer.value.text()
    plan = answer.value.json()
    assert plan["assumptions"]["sequences_per_step"] == 8 and plan["rollout_s"] > 0
    expect(page.locator("#plan-rollout")).to_be_visible()
    expect(page.locator("#plan-grpo")).to_contain_text("GRPO: 8 completions of up to 8 tokens a step")
    expect(page.locator("#plan-dpo")).to_have_count(0)
    screenshot(page, "new-job-grpo")

    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/api/jobs")) as sent:
        page.get_by_role("button", name="Start fine-tune").click()
    body = sent.value.post_data_json
    chosen = {
        "objective": "grpo",
        "tuning": "lora",
        "grader": spec,
        "group_size": 2,
        "max_completion_tokens": 8,
        "temperature": 0.7,
        "beta": 0.04,
        "loss_type": "dapo",
        "num_iterations": 1,
        "lora_r": 4,
    }
    # every other option of its own is sent too, at the schema's default
    common = method_entry(server, "grpo")["common_fields"]
    defaults = {k: p["default"] for k, p in schema.items() if k not in common and k not in chosen}
    assert defaults, "GRPO has options the test did not set"
    assert body["method"] == chosen | defaults, body
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"), timeout=20_000)
    job_id = page.url.rsplit("/", 1)[1]
    prompts["jobs"].append(job_id)
    expect(page.locator("#job-method")).to_have_text("GRPO (LoRA), group 2, beta 0.04")
    expect(page.locator("#reward-chart")).to_be_visible()
    expect(page.locator("#token-accuracy-chart")).to_be_hidden()
    # the run's steps: rewards charted, each step's graded completions listed (newest first)
    job = wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed"))
    assert job["status"] == "succeeded", job["error"]
    expect(page.locator("#grpo-samples li.sample-step")).to_have_count(2, timeout=20_000)
    expect(page.locator("#grpo-samples li.sample-step").first).to_have_attribute("data-step", "2")
    first = page.locator("#grpo-samples li.sample-step").first.locator("tr.grpo-sample").first
    expect(first.locator(".grpo-prompt")).to_contain_text("What is")
    expect(first.locator(".grpo-reward")).to_have_text(re.compile(r"^[01]"))
    expect(page.locator("#reward-chart path.series").first).to_be_attached()
    expect(page.locator("#completion-finished")).to_have_text(re.compile(r"%$"))
    screenshot(page, "job-grpo")


def test_a_prompts_dataset_previews_its_prompts_and_grader_fields(
    page: Page, server: Server, tmp_path: Path, prompts: dict[str, Any]
) -> None:
    page.goto(f"{server.base_url}/#/datasets")
    expect(page.locator("#datasets-table")).to_be_visible()
    row = page.locator(f'#datasets-table tbody tr[data-dataset-id="{prompts["prompts"]}"]')
    expect(row).to_contain_text("prompts")
    row.get_by_role("button", name="Preview").click()
    preview = page.locator("section#preview")
    expect(preview).to_be_visible()
    page.select_option("select#preview-model", "tiny")
    first = preview.locator(".preview-row.prompts").first
    expect(first).to_be_visible(timeout=30_000)
    expect(first.get_by_role("heading", name="Prompt")).to_be_visible()
    prompt = "".join(first.locator(".prompt span.tok").all_text_contents())
    assert "What is 0 + 0?" in prompt and first.locator("span.tok.trained").count() == 0
    expect(first.get_by_role("heading", name="Grader fields (item)")).to_be_visible()
    assert json.loads(first.locator("pre.item").inner_text()) == {"reference_answer": "0"}
    expect(preview).to_contain_text("(the prompts)", timeout=30_000)
    screenshot(page, "datasets-prompts-preview")
