"""The new-job form's methods come from GET /api/methods: each method but supervised fine-tuning is a
radio with a fieldset rendered from its options schema (label = title, hint = description, value =
default, the bounds as the inputs', an enum as a select, a boolean as a checkbox, a nullable option
empty for null); an option with no script of its own (GRPO's top_p, epsilon_high) is sent as set; a
method with no script of its own at all (KTO) is offered, fitted to its datasets, planned and
started, its job page drawing its charts; and the job page's one-line method label reads either
form of a method section. It leaves no job or dataset behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, ConsoleWatch, Server, method_entry

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, expect

from tests.web.test_dpo_form import _post
from tests.web.test_grpo_form import PROMPTS
from tests.web.test_job_manage import wait

# unpaired preference rows (the "kto" data format): a prompt, one completion, whether it is desirable
UNPAIRED = [
    {
        "prompt": f"Inventory: {n} figs. How many figs?",
        "completion": str(n) if n % 2 else "many",
        "label": n % 2 == 1,
    }
    for n in range(12)
]


def listing(server: Server) -> list[dict[str, Any]]:
    with server.client() as client:
        r = client.get("/api/methods")
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def own_options(method: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """The method's own options as the form reads them: name -> (schema, nullable)."""
    options = {}
    for name, prop in method["options_schema"]["properties"].items():
        if name in method["common_fields"] or "const" in prop:
            continue
        branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
        nullable = any(b.get("type") == "null" for b in prop.get("anyOf", []))
        options[name] = ({**(branches[0] if len(branches) == 1 else {}), **prop}, nullable)
    return options


def control_id(method: str, option: str) -> str:
    return "grader" if option == "grader" else f"{method}-{option.replace('_', '-')}"


def number_text(value: float) -> str:
    """A schema number as the form writes it into an attribute (JavaScript's String(n))."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def test_each_method_fieldset_is_rendered_from_its_schema(page: Page, server: Server) -> None:
    methods = [m for m in listing(server) if m["name"] != "sft"]
    assert methods, "no method besides supervised fine-tuning to render"
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    expect(page.locator("input[name=method]")).to_have_count(2 + len(methods))
    for method in methods:
        name = method["name"]
        page.check(f"input#method-{name}")
        fieldset = page.locator(f"fieldset#{name}-options")
        expect(fieldset).to_be_visible()
        expect(page.locator("fieldset.method-options:visible")).to_have_count(1)
        expect(fieldset.locator("legend")).to_have_text(method["title"])
        tunings = fieldset.locator(f"select#{name}-tuning option")
        expect(tunings).to_have_count(len(method["tunings"]))
        assert [tunings.nth(i).get_attribute("value") for i in range(tunings.count())] == method["tunings"]
        for option, (p, nullable) in own_options(method).items():
            control = fieldset.locator(f"#{control_id(name, option)}")
            expect(control).to_have_count(1)
            if option == "grader":  # its own editor: the JSON, checked as it is typed
                expect(control).to_have_js_property("tagName", "TEXTAREA")
                continue
            expect(fieldset.locator(f'label[for="{control_id(name, option)}"]')).to_have_text(p["title"])
            if p.get("description"):
                expect(fieldset.locator(f"#{control_id(name, option)}-hint")).to_have_text(p["description"])
            default = p.get("default")
            if "enum" in p:
                values = ([""] if nullable else []) + [str(v) for v in p["enum"]]
                shown = control.locator("option")
                assert [shown.nth(i).get_attribute("value") for i in range(shown.count())] == values, option
                expect(control).to_have_value("" if default is None else str(default))
            elif p.get("type") == "boolean":
                expect(control).to_have_attribute("type", "checkbox")
                expect(control).to_be_checked(checked=bool(default))
            elif p.get("type") in ("integer", "number"):
                expect(control).to_have_attribute("type", "number")
                value = control.input_value()
                assert value == "" if default is None else float(value) == default, (option, value)
                for bound, attribute in (("minimum", "min"), ("maximum", "max")):
                    if bound in p:
                        expect(control).to_have_attribute(attribute, number_text(p[bound]))
                for bound, attribute, step in (
                    ("exclusiveMinimum", "min", 1),
                    ("exclusiveMaximum", "max", -1),
                ):
                    if bound in p and p["type"] == "integer":  # the next integer inside
                        expect(control).to_have_attribute(attribute, number_text(p[bound] + step))
                    elif bound in p:  # a float's open bound: no attribute says it (validity does)
                        assert control.get_attribute(attribute) is None, (option, bound)


def test_grpo_options_take_their_bounds_and_are_sent_without_js_of_their_own(
    page: Page, console: ConsoleWatch, server: Server, made: dict[str, Any]
) -> None:
    console.allow(r"status of 422 .*/api/plan\]$")  # the plan of a job with a refused option
    schema = method_entry(server, "grpo")["options_schema"]["properties"]
    page.goto(f"{server.base_url}/#/jobs/new")
    page.check("input#method-grpo")
    expect(page.locator("select#dataset")).to_have_value(made["prompts"]["id"])
    temperature = page.locator("input#grpo-temperature")
    # the schema's bounds: 0 < temperature <= 10; no hand-copied 0.01 minimum
    assert "exclusiveMinimum" in schema["temperature"] and "minimum" not in schema["temperature"]
    expect(temperature).to_have_attribute("max", number_text(schema["temperature"]["maximum"]))
    assert temperature.get_attribute("min") is None
    valid = "e => e.validity.valid"
    for text, ok in (
        ("0", False),
        ("0.01", True),
        (number_text(schema["temperature"]["maximum"]), True),
        ("11", False),
    ):
        temperature.fill(text)
        assert temperature.evaluate(valid) is ok, text
    temperature.fill("0")
    message = temperature.evaluate("e => e.validationMessage")
    assert message == f"must be greater than {number_text(schema['temperature']['exclusiveMinimum'])}", (
        message
    )
    temperature.fill("0.7")

    # options the page has no script of its own for: rendered, and sent as set
    for option in ("top_p", "epsilon_high", "scale_rewards"):
        assert option in schema, option
    expect(page.locator('label[for="grpo-top-p"]')).to_have_text(schema["top_p"]["title"])
    expect(page.locator("input#grpo-epsilon-high")).to_have_value("")  # nullable, no default: empty

    def planned(check: Any) -> Any:
        return lambda r: r.url.endswith("/api/plan") and check((r.post_data_json or {}).get("method", {}))

    with page.expect_request(planned(lambda m: m.get("top_p") == 0.9), timeout=15_000) as sent:
        page.fill("input#grpo-top-p", "0.9")
    method = (sent.value.post_data_json or {})["method"]
    assert method["epsilon_high"] is None and method["scale_rewards"] is schema["scale_rewards"]["default"]
    assert (method["objective"], method["temperature"]) == ("grpo", 0.7)
    with page.expect_request(planned(lambda m: m.get("epsilon_high") == 0.28), timeout=15_000):
        page.fill("input#grpo-epsilon-high", "0.28")
    with page.expect_request(planned(lambda m: m.get("scale_rewards") is False), timeout=15_000):
        page.uncheck("input#grpo-scale-rewards")
    with page.expect_request(
        planned(lambda m: "epsilon_high" in m and m["epsilon_high"] is None), timeout=15_000
    ):
        page.fill("input#grpo-epsilon-high", "")

    # the API's refusal of one of its options marks that option's control
    console.allow(r"status of 422 .*/api/jobs\]$")
    page.fill("input#max-length", "8")  # no room for the prompt beside 64 completion tokens
    page.get_by_role("button", name="Start fine-tune").click()
    expect(page.locator("#form-error")).to_contain_text("method.max_completion_tokens")
    expect(page.locator("input#grpo-max-completion-tokens")).to_have_attribute("aria-invalid", "true")


def test_the_job_pages_method_label_reads_both_forms_of_a_method_section(page: Page, server: Server) -> None:
    entries = {m["name"]: m for m in listing(server)}
    page.goto(f"{server.base_url}/#/jobs")
    cases = [
        (
            {"objective": "grpo", "tuning": "lora", "group_size": 4, "beta": 0.04},
            "grpo",
            "GRPO (LoRA), group 4, beta 0.04",
        ),
        ({"objective": "dpo", "tuning": "lora", "beta": 0.1}, "dpo", "DPO (LoRA), beta 0.1"),
        (
            {"objective": "kto", "tuning": "full", "beta": 0.1, "desirable_weight": 1.0},
            None,
            "KTO (full), beta 0.1",
        ),
        ({"objective": "sft", "tuning": "lora", "lora_r": 16}, "sft", "LoRA (r 16)"),
        ({"objective": "sft", "tuning": "full"}, "sft", "Full fine-tune"),
        # an older job's section: the one-word kind, dpo_tuning, and every method's fields
        (
            {"kind": "orpo", "dpo_tuning": "full", "beta": 0.3, "group_size": 4},
            "orpo",
            "ORPO (full), beta 0.3",
        ),
        ({"kind": "lora", "lora_r": 8, "base_bits": 4}, "sft", "LoRA (r 8), 4-bit base"),
        ({"kind": "full"}, "sft", "Full fine-tune"),
        # an option the section lacks: the schema's default
        ({"objective": "grpo", "tuning": "full"}, "grpo", None),
    ]
    for section, name, label in cases:
        entry = entries.get(name) if name else None
        got = page.evaluate(
            "([m, e]) => import('/static/js/pages/job.js').then((job) => job.methodLabel(m, e))",
            [section, entry],
        )
        if label is None:
            props = entries["grpo"]["options_schema"]["properties"]
            group, beta = props["group_size"]["default"], number_text(props["beta"]["default"])
            label = f"GRPO (full), group {group}, beta {beta}"
        assert got == label, (section, got)


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[dict[str, Any]]:
    """A prompts dataset and one of unpaired rows; they and the jobs the tests start are removed at
    the end."""
    state: dict[str, Any] = {
        "prompts": _post(server, "method-forms prompts", PROMPTS),
        "unpaired": _post(server, "method-forms unpaired", UNPAIRED),
        "jobs": [],
    }
    yield state
    with server.client() as client:
        for job_id in state["jobs"]:
            if client.get(f"/api/jobs/{job_id}").status_code == 404:
                continue
            client.post(f"/api/jobs/{job_id}/cancel")
            wait(server, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled", "paused"))
            client.delete(f"/api/jobs/{job_id}")
        for dataset in (state["prompts"], state["unpaired"]):
            client.delete(f"/api/datasets/{dataset['id']}")


def test_a_method_with_no_script_of_its_own_is_offered_planned_and_charted(
    page: Page, server: Server, made: dict[str, Any]
) -> None:
    entries = {m["name"]: m for m in listing(server)}
    if "kto" not in entries:
        pytest.skip("GET /api/methods lists no KTO")
    kto = entries["kto"]
    dataset = made["unpaired"]
    assert dataset["format"] == "kto", dataset
    page.goto(f"{server.base_url}/#/jobs/new")
    page.select_option("select#base-model", "tiny")
    page.fill("input#max-steps", "2")
    page.fill("input#batch-size", "4")
    advanced = page.locator("details#advanced")
    if advanced.get_attribute("open") is None:
        advanced.locator("summary").click()
    page.fill("input#num-microbatches", "2")
    option = page.locator(f'select#dataset option[value="{dataset["id"]}"]')
    expect(option).to_have_attribute("data-fits", "false")  # not for supervised fine-tuning

    page.check("input#method-kto")
    expect(page.locator("fieldset#kto-options legend")).to_have_text(kto["title"])
    expect(page.locator("select#dataset")).to_have_value(dataset["id"])  # moved to the one that fits
    expect(option).to_have_attribute("data-fits", "true")
    expect(page.locator("#dataset-fit")).to_contain_text("This method trains on a KTO dataset")
    page.fill("input#lora-r", "4")

    def kto_plan(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("method", {}).get("desirable_weight") == 1.5

    with page.expect_response(kto_plan, timeout=30_000) as answer:
        page.fill("input#kto-desirable-weight", "1.5")
    assert answer.value.status == 200, answer.value.text()
    own = {
        k: p["default"]
        for k, p in kto["options_schema"]["properties"].items()
        if k not in kto["common_fields"]
    }
    expected = {"objective": "kto", "tuning": "lora", "lora_r": 4} | own | {"desirable_weight": 1.5}
    assert answer.value.request.post_data_json["method"] == expected
    # the plan says what a KTO example is and trains as (the plan's assumptions, from its method)
    assumptions = answer.value.json()["assumptions"]
    assert (assumptions["example"], assumptions["needs_reference"]) == ("row", True)
    note = page.locator("#plan-dpo")
    expect(note).to_contain_text(f"KTO: {assumptions['example_sequences']} per row")
    expect(note).to_contain_text("reference pass over")

    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/api/jobs")) as sent:
        page.get_by_role("button", name="Start fine-tune").click()
    assert (sent.value.post_data_json or {})["method"] == expected
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f]+$"), timeout=20_000)
    job_id = page.url.rsplit("/", 1)[1]
    made["jobs"].append(job_id)
    with server.client() as client:
        client.post(f"/api/jobs/{job_id}/pause")  # what it trains is the engine's to test
    beta = number_text(kto["options_schema"]["properties"]["beta"]["default"])
    expect(page.locator("#job-method")).to_have_text(f"KTO (LoRA), beta {beta}")
    for chart in kto["charts"]:  # its charts as the listing names them, shown from the start
        card = page.locator(f'section[data-chart="{chart["id"]}"]')
        expect(card).to_be_visible()
        expect(card.locator("h2")).to_have_text(chart["title"])
        expect(card.locator(f"rh-line-chart#{chart['id']}")).to_have_attribute("ylabel", chart["ylabel"])
    expect(page.locator("#token-accuracy-chart")).to_be_hidden()
    expect(page.locator("section#samples")).to_be_hidden()  # no sampled completions
