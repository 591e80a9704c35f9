"""The new-job page's base model picker in a real browser: each model shows its family (and, for a
mixture of experts, "MoE · K of N experts"); a folder the engine cannot train is listed as a
disabled option with its reason, in a list under the picker too, and cannot be picked.

The model folders are written into the shared server's models folder for this test only (a listing
needs just a config.json) and removed afterwards."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Error, Page, expect

# a small Qwen3-MoE shape (listed before "tiny": the keyboard walk below starts at "tiny" and
# never lands on it, so this test does not depend on how a MoE model is planned)
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
FOLDERS = {
    "aa-web-moe": json.dumps(QWEN3_MOE),
    "zz-web-bert": json.dumps({"architectures": ["BertForMaskedLM"]}),
    "zz-web-broken": '{"architectures": [',
    "zz-web-long": json.dumps({"architectures": ["Very" + "Long" * 45 + "ForCausalLM"]}),
}
NARROW = {"width": 420, "height": 800}


@pytest.fixture
def extra_models(server: Server) -> Iterator[list[Path]]:
    """The folders of FOLDERS, for one test. Request it before ``page``: the page then closes
    before they go (a plan refresh of a removed model would log a 404)."""
    made = []
    try:
        for name, config in FOLDERS.items():
            folder = server.home / "models" / name
            folder.mkdir(parents=True)
            made.append(folder)
            (folder / "config.json").write_text(config)
        yield made
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def test_picker_shows_family_and_experts_and_refuses_unsupported_models(
    extra_models: list[Path], page: Page, server: Server
) -> None:
    page.goto(f"{server.base_url}/#/jobs/new")
    picker = page.get_by_label("Base model")  # the select, through its label
    picker.select_option("tiny")  # planned on this box as the other UI tests do
    expect(picker).to_have_id("base-model")
    expect(picker.locator('option[value="tiny"]')).to_have_text(re.compile(r"^tiny — Llama, "))
    moe = picker.locator('option[value="aa-web-moe"]')
    expect(moe).to_have_text(re.compile(r"^aa-web-moe — Qwen3-MoE, MoE · 8 of 128 experts, "))
    expect(moe).to_be_enabled()

    # a mixture of experts offers LoRA on its experts and the router loss; other models do not
    options = page.locator("fieldset#moe-options")
    expect(options).to_be_hidden()
    picker.select_option("aa-web-moe")
    expect(options).to_be_visible()
    page.get_by_label("LoRA on the experts too").check()
    page.get_by_label("Router load-balancing loss").check()
    preview = page.locator("pre#request-preview")
    expect(preview).to_contain_text('"target_parameters": [')
    expect(preview).to_contain_text('"router_aux_loss": true')
    picker.select_option("tiny")
    expect(options).to_be_hidden()
    expect(preview).not_to_contain_text("target_parameters")
    expect(preview).not_to_contain_text("router_aux_loss")

    bert = picker.locator('option[value="zz-web-bert"]')
    expect(bert).to_be_disabled()
    expect(bert).to_have_text("zz-web-bert — Bert: not supported")
    expect(bert).to_have_attribute("title", re.compile(r"^unsupported architecture BertForMaskedLM: "))
    broken = picker.locator('option[value="zz-web-broken"]')
    expect(broken).to_be_disabled()
    expect(broken).to_have_attribute("title", re.compile(r"^config\.json is not valid JSON: "))
    assert picker.locator("optgroup option:not([disabled])").count() == 0  # the group holds only those

    # the reasons are readable on the page too, not only in a tooltip
    reasons = page.locator("details#unsupported-models")
    expect(reasons.locator("summary")).to_have_text("3 model folders cannot be fine-tuned")
    reasons.locator("summary").click()
    expect(reasons.locator('li[data-model="zz-web-bert"]')).to_contain_text(
        "zz-web-bert: unsupported architecture BertForMaskedLM: the engine supports LlamaForCausalLM"
    )
    expect(reasons.locator('li[data-model="zz-web-broken"]')).to_be_visible()

    # a disabled option cannot be picked
    with pytest.raises(Error):
        picker.select_option("zz-web-bert", timeout=2_000)
    assert picker.input_value() != "zz-web-bert"
    # the keyboard stops at the last one that can be picked (other tests of the shared server may
    # have added model folders after "tiny")
    pickable = picker.locator("option:not([disabled])")
    last = pickable.nth(pickable.count() - 1).get_attribute("value")
    picker.focus()
    for _ in range(pickable.count() + 3):
        page.keyboard.press("ArrowDown")
    assert picker.input_value() == last
    page.keyboard.press("ArrowDown")
    assert picker.input_value() == last
    expect(page.locator("pre#request-preview")).to_contain_text(f'"base_model": "{last}"')
    expect(page.locator("pre#request-preview")).not_to_contain_text("zz-web-bert")
    screenshot(page, "new-job-unsupported-models")

    # a reason quoting a 200-character class name wraps in a narrow window
    page.set_viewport_size(NARROW)
    page.wait_for_timeout(300)
    size = page.evaluate("() => ({scroll: document.documentElement.scrollWidth, inner: window.innerWidth})")
    assert size["scroll"] <= size["inner"] + 1, size
