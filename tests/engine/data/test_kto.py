"""Unpaired preference rows (KTO): both accepted shapes, a label that must be a JSON boolean
(named by line), the encoding as one side of a pair (prompt ids, completion ids, label), the
token counts and the preview, and the refusal by supervised training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.data.encode import EncodedUnpaired, encode_pair, load_encoded, validate
from engine.data.formats import detect_format, family_of, get_format
from engine.data.read import Example, read_examples, to_example
from engine.errors import ConfigError
from tests.engine.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def jsonl(tmp_path: Path, rows: list[Any], name: str = "kto.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


HI = [msg("user", "what is one plus one?")]
STANDARD = {"prompt": "what is one plus one?", "completion": "two.", "label": True}
CHAT = {"prompt": HI, "completion": [msg("assistant", "three.")], "label": False}


@pytest.mark.parametrize(
    ("row", "want"),
    [
        (STANDARD, Example(1, messages=[*HI, msg("assistant", "two.")], label=True)),
        (CHAT, Example(1, messages=[*HI, msg("assistant", "three.")], label=False)),
    ],
    ids=["standard", "conversational"],
)
def test_both_shapes_become_the_prompt_with_the_completion_and_its_label(row: dict, want: Example) -> None:
    assert detect_format(row) == "kto" and family_of("kto") == "unpaired"
    assert to_example(1, row, "kto") == want


def test_a_row_without_a_label_is_still_prompt_completion() -> None:
    assert detect_format({"prompt": "p", "completion": "c"}) == "prompt_completion"
    assert detect_format({"prompt": "p", "chosen": "a", "rejected": "b", "label": True}) == "preference"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "p", "completion": "c", "label": "true"}, "line 2: field 'label' must be a JSON boolean"),
        ({"prompt": "p", "completion": "c", "label": 1}, "line 2: field 'label' must be a JSON boolean"),
        ({"prompt": "p", "completion": "c", "label": None}, "line 2: missing field 'label'"),
        ({"prompt": "", "completion": "c", "label": True}, "line 2: field 'prompt' is empty"),
        (
            {"prompt": "p", "completion": 5, "label": True},
            "line 2: field 'completion' must be a string or a list",
        ),
        (
            {"prompt": [msg("assistant", "a")], "completion": "c", "label": True},
            "line 2: prompt[0]: expected role",
        ),
        (
            {"prompt": HI, "completion": [msg("user", "c")], "label": True},
            "line 2: completion[0]: expected role 'assistant', got 'user'",
        ),
        (
            {"prompt": HI, "completion": [msg("assistant", "a"), msg("assistant", "b")], "label": True},
            "line 2: field 'completion' must hold one assistant message, got 2 messages",
        ),
    ],
)
def test_malformed_rows_are_named_by_line_and_field(tmp_path: Path, bad: dict, message: str) -> None:
    fmt, rows, examples, errors = read_examples(jsonl(tmp_path, [STANDARD, bad, CHAT]))
    assert (fmt, rows, len(examples)) == ("kto", 3, 2)
    assert len(errors) == 1 and str(errors[0]).startswith(message), errors


def test_a_label_given_as_a_string_says_what_it_got(tmp_path: Path) -> None:
    _, _, _, errors = read_examples(jsonl(tmp_path, [{"prompt": "p", "completion": "c", "label": "yes"}]))
    assert str(errors[0]) == (
        "line 1: field 'label' must be a JSON boolean, true (desirable) or false (undesirable), got str 'yes'"
    )


def test_csv_cells_are_strings_so_a_csv_label_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "kto.csv"
    p.write_text("prompt,completion,label\nhi,hello,true\n")
    fmt, _, examples, errors = read_examples(p)
    assert fmt == "kto" and not examples and "line 2: field 'label' must be a JSON boolean" in str(errors[0])


def test_parquet_booleans_are_labels(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "kto.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [True, False]}), p)
    fmt, _, examples, errors = read_examples(p)
    assert fmt == "kto" and not errors and [ex.label for ex in examples] == [True, False]


def test_a_row_encodes_as_one_side_of_a_pair(tok: Any) -> None:
    kto = get_format("kto")
    ex = to_example(1, STANDARD, "kto")
    item = kto.encode(ex, tok, 1024)
    assert isinstance(item, EncodedUnpaired) and item.label is True and item.line == 1
    # the same tokens and loss as the preferred side of a pair with this prompt and answer
    side = encode_pair(Example(1, messages=ex.messages, rejected="other."), tok, 1024).chosen
    assert item.sequence == side
    assert item.prompt_ids + item.completion_ids == side.input_ids
    assert tok.decode(item.completion_ids).startswith("two.") and "one plus one" in tok.decode(
        item.prompt_ids
    )
    trained = [t for t in item.sequence.labels if t != -100]
    assert trained == item.completion_ids  # the loss on the completion alone
    # cut before the completion: the prompt keeps its ids, nothing left to train on
    assert kto.encode(ex, tok, len(item.prompt_ids)).completion_ids == []  # type: ignore[union-attr]


def test_validation_counts_the_completions_and_names_one_cut_away(tmp_path: Path, tok: Any) -> None:
    p = str(jsonl(tmp_path, [STANDARD, CHAT]))
    report = validate(p, tokenizer=tok, max_length=1024)
    assert report.ok and report.format == "kto" and report.rows == 2 and report.tokens["total"] > 0
    cut = validate(p, tokenizer=tok, max_length=6)
    assert not cut.ok and cut.truncated_share == 1.0
    assert str(cut.errors[0]) == "line 1: no token of the completion left to train on within max_length=6"


def test_the_preview_shows_the_completion_trained_and_the_label(tok: Any) -> None:
    kto = get_format("kto")
    view = kto.preview(to_example(4, CHAT, "kto"), tok, 1024)
    assert view["line"] == 4 and view["label"] is False and not view["truncated"]
    trained = "".join(t["text"] for t in view["tokens"] if t["trained"])
    assert trained.startswith("three.") and "one plus one" not in trained


def test_supervised_training_refuses_kto_rows(tmp_path: Path, tok: Any) -> None:
    p = str(jsonl(tmp_path, [STANDARD]))
    with pytest.raises(
        ConfigError, match=r"data.train: .*kto.jsonl holds kto rows: lora and full train on"
    ) as c:
        load_encoded(p, tok)
    assert c.value.field == "data.train"
    with pytest.raises(ConfigError, match=r"data.format='kto' names unpaired rows") as c:
        load_encoded(p, tok, fmt="kto")
    assert c.value.field == "data.format"
