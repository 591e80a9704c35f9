"""The playground in a real browser against a real server: a LoRA job on the tiny model trains
through the API, then the page asks its base model and its checkpoint the same prompt and both
answers stream side by side; the conversation goes on with a second prompt. Screenshot:
``test-artifacts/screenshots/playground.png``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.utils.jobs import FINAL, start_job, wait_for_job
from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"what is {i} plus {i % 5}?"},
            {"role": "assistant", "content": f"the answer is {i + i % 5}."},
        ]
    }
    for i in range(24)
]


def trained_job(server: Server) -> str:
    """A LoRA job of the tiny model with a checkpoint, trained by the server's worker."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS)
    with server.client() as client:
        r = client.post(
            "/api/datasets", files={"file": ("playground.jsonl", content)}, data={"name": "playground"}
        )
        assert r.status_code == 201, r.text
        hyper, checkpoint = {"max_steps": 6}, {"every_steps": 3}
        job = start_job(client, r.json()["id"], name="playground-lora", hyper=hyper, checkpoint=checkpoint)
        job_id = str(job["id"])
        status = wait_for_job(client, job_id, FINAL, timeout=180, logs=server.log_tail)["status"]
        assert status == "succeeded", f"the job ended {status}:\n{server.log_tail()}"
    return job_id


@pytest.mark.slow
def test_the_playground_streams_both_answers_side_by_side(page: Page, server: Server) -> None:
    job_id = trained_job(server)
    page.goto(f"{server.base_url}/#/playground/{job_id}")
    expect(page.get_by_role("link", name="Playground")).to_have_attribute("aria-current", "page")
    expect(page.locator("select#playground-job")).to_have_value(job_id)
    expect(page.locator("select#playground-step")).to_have_value("6")
    expect(page.locator("select#playground-base")).to_have_value("tiny")
    # every control has a label
    for name in ("Job", "Checkpoint", "Base model", "Temperature", "Top-p", "Max tokens", "Seed", "Message"):
        expect(page.get_by_label(name, exact=True)).to_be_visible()
    page.get_by_label("Temperature", exact=True).fill("1")
    page.get_by_label("Max tokens", exact=True).fill("6")
    page.get_by_label("Seed", exact=True).fill("3")

    # keyboard only: the prompt, then Enter sends it
    prompt = page.get_by_label("Message", exact=True)
    prompt.focus()
    page.keyboard.type("hi")
    page.keyboard.press("Enter")
    for side in ("base", "tuned"):
        chat = page.locator(f"#{side}-chat")
        expect(chat.locator("li.turn.user")).to_have_text("hi")
        answer = chat.locator("li.turn.assistant").last
        expect(answer).not_to_have_attribute("data-state", "running", timeout=60_000)
        assert answer.get_attribute("data-state") == "done", answer.text_content()
        expect(answer).to_have_attribute("data-finish", re.compile("^(stop|length)$"))
        expect(answer.locator(".meta")).to_contain_text("tokens")
    assert page.locator("#base-chat li.turn.assistant .text").text_content() != ""
    assert page.locator("#tuned-chat li.turn.assistant .text").text_content() != ""
    expect(page.locator("#tuned-model-name")).to_contain_text("step 6")
    expect(page.locator("#playground-send")).to_be_enabled()

    # the conversation goes on: a second turn on each side
    prompt.fill("ok")
    page.locator("#playground-send").click()
    for side in ("base", "tuned"):
        answers = page.locator(f"#{side}-chat li.turn.assistant")
        expect(answers).to_have_count(2)
        expect(answers.last).not_to_have_attribute("data-state", "running", timeout=60_000)
        assert answers.last.get_attribute("data-state") == "done", answers.last.text_content()
    screenshot(page, "playground")

    # a new conversation empties both sides
    page.get_by_role("button", name="New conversation").click()
    expect(page.locator("#base-chat li")).to_have_count(0)
    expect(page.locator("#tuned-chat li")).to_have_count(0)
