"""The data-format registry: the one list of formats, what each format module provides, the base
reader that knows none of them, and a new format added as one module's worth of code."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from engine.commands.cli import build_parser
from engine.config import TrainConfig
from engine.data import formats
from engine.data.encode import load_encoded, validate
from engine.data.formats import (
    FAMILIES,
    DataFormat,
    detect_format,
    family_of,
    format_names,
    get_format,
    register,
    titles,
)
from engine.data.formats import base as registry
from engine.data.read import read_examples
from engine.data.rows import Example, text_field
from tests.engine.tiny import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
BUILT_IN = ("chat", "sharegpt", "instruction", "prompt_completion", "text", "preference", "prompts", "kto")


class QuestionAnswer(DataFormat):
    """A throwaway format: ``{"question": str, "answer": str}``, trained on the answer."""

    name = "qa"
    title = "question/answer"
    family = "supervised"
    description = "question/answer"

    def detect(self, record: dict[str, Any]) -> bool:
        return "question" in record and "answer" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        question = text_field(record, "question")
        return Example(line, prompt=f"Q: {question}\nA: ", completion=text_field(record, "answer"))


@pytest.fixture
def qa(monkeypatch: pytest.MonkeyPatch) -> DataFormat:
    """The throwaway format, registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    return register(QuestionAnswer())


def test_the_registry_lists_the_built_in_formats_in_order() -> None:
    assert format_names() == BUILT_IN
    assert [m.__name__.rpartition(".")[2] for m in formats.MODULES] == list(BUILT_IN)
    assert {family_of(n) for n in format_names()} == set(FAMILIES)
    assert titles("supervised") == "chat, ShareGPT/LLaVA, instruction, prompt/completion or text"
    for name in format_names():
        listing = get_format(name).listing()
        assert listing["name"] == name and listing["family"] in FAMILIES and listing["description"]


def test_the_cli_lists_the_registrys_formats() -> None:
    parser = build_parser()
    for name in ["auto", *format_names()]:
        assert parser.parse_args(["validate-data", "d.jsonl", "--format", name]).format == name
    with pytest.raises(SystemExit):
        parser.parse_args(["validate-data", "d.jsonl", "--format", "nope"])


# engine/config.py's DataSpec.format still spells the names out as a Literal, without "kto"; it
# becomes ``format: FormatChoice = "auto"`` (engine.data.formats), and this test then passes
def test_the_run_configuration_takes_the_registrys_formats() -> None:
    schema = TrainConfig.model_json_schema()
    assert schema["$defs"]["DataSpec"]["properties"]["format"]["enum"] == ["auto", *format_names()]


def test_an_unknown_format_names_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown format 'nope'; use auto or one of chat, sharegpt, instruction, "
    ):
        get_format("nope")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "a"}) + "\n")
    _, _, examples, errors = read_examples(p, "nope")
    assert not examples and str(errors[0]).startswith("line 1: unknown format 'nope'; use auto or one of")


def test_the_base_reader_imports_no_format_and_names_none() -> None:
    source = (ROOT / "engine/data/read.py").read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert {m for m in imported if m.startswith("engine.")} == {
        "engine.data.archives",
        "engine.data.formats",
        "engine.data.images",
        "engine.data.rows",
    }
    for name in format_names():
        assert f'"{name}"' not in source and f"'{name}'" not in source, name


def test_register_refuses_a_taken_name_auto_and_an_unknown_family(qa: DataFormat) -> None:
    with pytest.raises(ValueError, match="format 'qa' is registered already"):
        register(QuestionAnswer())

    class Auto(QuestionAnswer):
        name = "auto"

    class Odd(QuestionAnswer):
        name = "odd"
        family = "graded"  # type: ignore[assignment]

    with pytest.raises(ValueError, match="not 'auto'"):
        register(Auto())
    with pytest.raises(ValueError, match="unknown family 'graded'"):
        register(Odd())


def test_a_new_format_is_one_module(qa: DataFormat, tmp_path: Path) -> None:
    rows = [
        {"question": "one plus one?", "answer": "two"},
        {"question": "hi?"},
        {"question": "x", "answer": "y"},
    ]
    p = tmp_path / "qa.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # listed, detected, checked by line and field, with no other change anywhere
    assert format_names()[-1] == "qa" and detect_format(rows[0]) == "qa"
    fmt, count, examples, errors = read_examples(p)
    assert (fmt, count, len(examples)) == ("qa", 3, 2)
    assert [str(e) for e in errors] == ["line 2: missing field 'answer'"]
    # encoded and validated like any supervised format: the loss on the answer
    tok = tiny_tokenizer()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], rows[2])))
    report = validate(str(good), tokenizer=tok, max_length=64)
    assert report.ok and report.format == "qa" and report.tokens["total"] > 0
    (first, _) = load_encoded(str(good), tok, max_length=64)
    assert tok.decode([t for t in first.labels if t != -100]).startswith("two")
    # and previewed: the answer's tokens marked trained, the question's not
    view = qa.preview(examples[0], tok, 64)
    trained = "".join(t["text"] for t in view["tokens"] if t["trained"])
    assert view["line"] == 1 and trained.startswith("two") and "one plus one" not in trained


def test_a_format_registered_in_a_test_is_gone_after_it() -> None:
    assert "qa" not in format_names() and detect_format({"question": "q", "answer": "a"}) is None
