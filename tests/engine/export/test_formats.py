"""The export-format registry (``engine.export.formats``) is the one list: the GGUF quantizations
the writer knows, ``roundhouse export``'s choices, and the web UI (which reads the API) hold no
copy of it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.commands.cli import build_parser
from engine.export import gguf_model
from engine.export.formats import CHECKPOINT, FORMATS, GGUF, MERGED, VARIANTS, format_named
from engine.training.checkpoint_layout import CheckpointKind

ROOT = Path(__file__).resolve().parents[3]


def export_options() -> dict[str, argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a for a in commands.choices["export"]._actions for o in a.option_strings}


def test_the_gguf_variants_are_the_writer_s_quantizations() -> None:
    assert GGUF.variants is gguf_model.QUANTS
    assert VARIANTS == gguf_model.QUANTS  # no other format has variants yet
    assert GGUF.default_variant in GGUF.variants


def test_the_cli_choices_come_from_the_registry() -> None:
    options = export_options()
    assert list(options["--format"].choices or []) == list(FORMATS)
    assert options["--variant"] is options["--quant"]
    assert list(options["--variant"].choices or []) == list(VARIANTS)


def test_the_web_ui_holds_no_list_of_its_own() -> None:
    scripts = "".join(p.read_text() for p in (ROOT / "web").rglob("*.js") if "node_modules" not in p.parts)
    for quant in GGUF.variants:
        assert f'"{quant}"' not in scripts, quant


def test_refusals_and_names() -> None:
    assert MERGED.refusal(kind=CheckpointKind.FULL) == "only a LoRA adapter can be merged"
    assert MERGED.refusal(kind=CheckpointKind.ADAPTER) is None
    assert GGUF.refusal(kind=CheckpointKind.FULL, architecture="LlamaForCausalLM") is None
    refused = GGUF.refusal(kind=CheckpointKind.FULL, architecture="MambaForCausalLM")
    assert refused is not None and refused.startswith("MambaForCausalLM cannot be exported yet")
    assert CHECKPOINT.refusal(kind=CheckpointKind.FULL, architecture="MambaForCausalLM") is None
    assert [f.needs_base(CheckpointKind.ADAPTER) for f in FORMATS.values()] == [False, True, True]
    assert not GGUF.needs_base(CheckpointKind.FULL)
    tags = [f.tag(CheckpointKind.ADAPTER, f.variant_of(None)) for f in FORMATS.values()]
    assert tags == ["adapter", "merged", f"gguf-{GGUF.default_variant}"]


def test_bad_names_and_variants_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"format: one of checkpoint, merged, gguf \(got 'onnx'\)"):
        format_named("onnx")
    with pytest.raises(ValueError, match=r"variant: gguf has one of f16, bf16, q8_0, q4_k_m \(got 'q3'\)"):
        GGUF.variant_of("q3")
    with pytest.raises(ValueError, match="variant: merged has none"):
        MERGED.variant_of("q8_0")
    assert GGUF.variant_of("f16") == "f16" and MERGED.variant_of(None) is None


def test_the_format_info_the_api_serves() -> None:
    info = GGUF.info(refused="no")
    assert info.model_dump() == {
        "name": "gguf",
        "label": "GGUF",
        "summary": GGUF.summary,
        "variants": list(GGUF.variants),
        "default_variant": GGUF.default_variant,
        "adapter_only": False,
        "refused": "no",
    }
