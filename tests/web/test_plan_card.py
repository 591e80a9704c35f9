"""The new-job page's plan card puts a LoRA job with a 16-bit and a 4-bit base side by side: the
host RAM each needs (and the host's), PCIe bytes an iteration and the longest sequence, as
``POST /api/plan`` answers them; a model whose 16-bit base does not fit the host's RAM reads
"fits in ... with a 4-bit base, needs ... without"."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.web.conftest import CHROMIUM, Server, screenshot

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

from playwright.sync_api import Page, Route, expect

from tests.engine.test_planner_quantized import QWEN3_32B

FIGURE = r"([\d.,]+(?:e[-+]?\d+)?)"


def _figure(text: str) -> float:
    return float(text.replace(",", ""))


def _plan_of(bits: int) -> Any:
    def matches(response: Any) -> bool:
        sent = response.request.post_data_json or {}
        return response.url.endswith("/api/plan") and sent.get("method", {}).get("base_bits", 16) == bits

    return matches


def test_the_plan_card_shows_a_16_bit_and_a_4_bit_base(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/#/jobs/new")
    expect(page.locator("form#new-job-form")).to_be_visible()
    page.select_option("select#base-model", "tiny")
    with page.expect_response(_plan_of(4), timeout=30_000) as answer:
        page.check("input#base-4bit")
    expect(page.locator("#request-preview")).to_contain_text('"base_bits": 4')
    plan = answer.value.json()
    sixteen, four = plan["base_variants"]
    note = page.locator("#plan-base-bits")
    expect(note).to_contain_text("with a 4-bit base", timeout=30_000)
    text = note.inner_text()
    # both fit this host: the RAM each needs, and the host's
    found = re.search(
        rf"Host RAM: {FIGURE} GB with a 4-bit base, {FIGURE} GB without \(the host has {FIGURE} GB\)", text
    )
    assert found, text
    shown = [_figure(g) for g in found.groups()]
    expected = [four["host_ram_gb"], sixteen["host_ram_gb"], plan["assumptions"]["host_ram_gb"]]
    assert shown == pytest.approx(expected, rel=5e-3, abs=5e-4), text  # 3 digits, 3 decimals at most
    found = re.search(rf"PCIe per iteration: {FIGURE} GB with a 4-bit base, {FIGURE} GB without", text)
    assert found, text
    shown = [_figure(g) for g in found.groups()]
    pcie = [four["pcie_gb_per_iteration"], sixteen["pcie_gb_per_iteration"]]
    assert shown == pytest.approx(pcie, rel=5e-3, abs=5e-4), text
    longest = f"{four['max_seq_len']:,} tokens with a 4-bit base, {sixteen['max_seq_len']:,} without"
    assert f"Longest sequence: {longest}" in text

    # a model whose 16-bit weights do not fit the host's RAM (the page's own request, planned for
    # Qwen3-32B's sizes on 8 GPUs and 64 GB of RAM)
    def bigger(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        body |= {"config": QWEN3_32B, "hardware": {"num_gpus": 8, "gpu_memory_gb": 24, "host_ram_gb": 64}}
        route.continue_(post_data=json.dumps(body))

    page.route("**/api/plan", bigger)
    with page.expect_response(_plan_of(16), timeout=30_000) as answer:
        page.uncheck("input#base-4bit")
    plan = answer.value.json()
    sixteen, four = plan["base_variants"]
    assert not sixteen["fits"] and four["fits"]
    expect(page.locator("#plan-fits")).to_have_text("Does not fit.")
    expect(note).to_contain_text(
        f"Fits in 64 GB of RAM with a 4-bit base, needs {sixteen['host_ram_gb']:.3g} GB without."
    )
    expect(page.locator("#plan")).to_contain_text("Try: a 4-bit base")
    screenshot(page, "new-job-4bit-base")
    page.unroute("**/api/plan")


def test_a_model_stored_in_4_bits_is_labelled_and_starts_with_a_4_bit_base(
    page: Page, server: Server
) -> None:
    """A bitsandbytes 4-bit folder in the models folder: the pickers name its quantization, and
    picking it checks "4-bit base" (its weights then stay packed as stored); unchecking it asks
    for a 16-bit base (decoded on load)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tiny = server.home / "models" / "tiny"
    folder = server.home / "models" / "tiny-bnb-4bit"
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    AutoModelForCausalLM.from_pretrained(
        tiny, quantization_config=quantization, dtype=torch.bfloat16
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    try:
        page.goto(f"{server.base_url}/#/jobs/new")
        expect(page.locator("form#new-job-form")).to_be_visible()
        option = page.locator("select#base-model option[value='tiny-bnb-4bit']")
        expect(option).to_contain_text("bitsandbytes 4-bit (nf4)")
        expect(page.locator("#base-4bit-stored")).to_be_hidden()
        page.select_option("select#base-model", "tiny-bnb-4bit")
        expect(page.locator("input#base-4bit")).to_be_checked()
        expect(page.locator("#base-4bit-stored")).to_contain_text("stored bitsandbytes 4-bit (nf4)")
        expect(page.locator("#request-preview")).to_contain_text('"base_bits": 4')
        page.uncheck("input#base-4bit")  # the user's choice stands
        expect(page.locator("#request-preview")).not_to_contain_text("base_bits")
        page.select_option("select#base-model", "tiny")
        expect(page.locator("#base-4bit-stored")).to_be_hidden()
        screenshot(page, "new-job-stored-4bit")
        page.goto(f"{server.base_url}/#/models")
        expect(page.locator("main")).to_contain_text("bitsandbytes 4-bit (nf4)")
    finally:
        shutil.rmtree(folder)
