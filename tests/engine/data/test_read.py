"""Every malformed row gets an error naming its line (or row) and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.data.read import detect_format, read_examples


def jsonl(tmp_path: Path, lines: list[str | bytes]) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return p


def chat(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


GOOD = chat(("user", "hi"), ("assistant", "hello"))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"messages": [', "line 2: invalid JSON: Expecting value (column 15)"),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        (b'{"messages": "\xff\xfe"}', "line 2: not valid UTF-8 (byte 0xff at column 15)"),
        ('{"messages": []}', "line 2: field 'messages' is empty"),
        ('{"messages": "hello"}', "line 2: field 'messages' must be a list, got str"),
        (chat(("user", "hi"), ("robot", "beep")), "line 2: messages[1]: unknown role 'robot'"),
        (chat(("user", "hi")), "line 2: no assistant turn"),
        (chat(("user", "hi"), ("assistant", "")), "line 2: messages[1].content is empty"),
        (
            json.dumps({"messages": [{"role": "user", "content": 5}]}),
            "line 2: messages[0].content must be a string, got int",
        ),
        (
            chat(("user", "a"), ("user", "b"), ("assistant", "c")),
            "line 2: messages[1]: expected role 'assistant', got 'user'",
        ),
        (
            chat(("system", "s"), ("assistant", "a")),
            "line 2: messages[1]: expected role 'user', got 'assistant'",
        ),
        (
            chat(("user", "a"), ("assistant", "b"), ("user", "c")),
            "line 2: the last turn must be the assistant's",
        ),
    ],
)
def test_malformed_chat_rows(tmp_path: Path, bad: str | bytes, message: str) -> None:
    fmt, rows, examples, errors = read_examples(jsonl(tmp_path, [GOOD, bad, GOOD]))
    assert fmt == "chat" and rows == 3 and len(examples) == 2
    assert len(errors) == 1 and str(errors[0]).startswith(message), errors


@pytest.mark.parametrize(
    ("good", "bad", "message"),
    [
        ({"instruction": "a", "output": "b"}, {"instruction": "a"}, "line 2: missing field 'output'"),
        (
            {"question": "a"},
            {"instruction": "a", "output": "b"},
            "line 1: cannot tell the row format from its fields (question)",
        ),
        (
            {"instruction": "a", "output": "b"},
            {"instruction": "", "output": "b"},
            "line 2: field 'instruction' is empty",
        ),
        (
            {"instruction": "a", "output": "b"},
            {"instruction": "a", "output": 3},
            "line 2: field 'output' must be a string, got int",
        ),
        (
            {"prompt": "a", "completion": "b"},
            {"prompt": "a", "completion": None},
            "line 2: missing field 'completion'",
        ),
        ({"text": "a"}, {"text": ["a"]}, "line 2: field 'text' must be a string, got list"),
    ],
)
def test_malformed_rows_of_other_formats(tmp_path: Path, good: dict, bad: dict, message: str) -> None:
    _, _, examples, errors = read_examples(jsonl(tmp_path, [json.dumps(good), json.dumps(bad)]))
    assert len(examples) == 1
    assert len(errors) == 1 and str(errors[0]).startswith(message), errors


def test_every_error_is_reported_not_just_the_first(tmp_path: Path) -> None:
    lines = [GOOD, "{", GOOD, "[]", chat(("user", "x")), "", GOOD]
    _, rows, examples, errors = read_examples(jsonl(tmp_path, lines))
    assert [e.line for e in errors] == [2, 4, 5]
    assert rows == 6 and len(examples) == 3  # the blank line 6 is skipped


def test_explicit_format_overrides_detection(tmp_path: Path) -> None:
    _, _, examples, errors = read_examples(
        jsonl(tmp_path, [json.dumps({"text": "x", "prompt": "p"})]), "prompt_completion"
    )
    assert not examples and str(errors[0]) == "line 1: missing field 'completion'"


def test_csv_rows_are_numbered_by_file_line(tmp_path: Path) -> None:
    p = tmp_path / "d.csv"
    p.write_bytes(
        b"instruction,input,output\n"
        b'"say hi",,hello\n'
        b'"multi\nline",,ok\n'
        b'"three",cells,too,many\n'
        b'"bad \xff byte",,x\n'
        b'"",,empty instruction\n'
    )
    fmt, rows, examples, errors = read_examples(p)
    assert fmt == "instruction" and rows == 5
    assert [ex.line for ex in examples] == [2, 3]
    assert [str(e) for e in errors] == [
        "line 5: 4 cells, the header has 3 columns",
        "line 6: not valid UTF-8",
        "line 7: field 'instruction' is empty",
    ]


def test_csv_chat_rows_hold_json_messages(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    msgs = json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]).replace(
        '"', '""'
    )
    p.write_text(f'messages\n"{msgs}"\n"not json"\n')
    _, _, examples, errors = read_examples(p)
    assert examples[0].messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert str(errors[0]).startswith("line 3: column 'messages' is not valid JSON")


def test_parquet_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "completion": ["x", "", "z"]}), p)
    fmt, rows, examples, errors = read_examples(p)
    assert fmt == "prompt_completion" and rows == 3 and len(examples) == 2
    assert [str(e) for e in errors] == ["row 2: field 'completion' is empty"]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    _, _, _, errors = read_examples(tmp_path / "broken.parquet")
    assert str(errors[0]).startswith("row 1: not a readable Parquet file")


def test_unsupported_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.txt: unsupported file type '.txt'"):
        read_examples(tmp_path / "data.txt")


def test_detect_format() -> None:
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"instruction": "", "output": ""}) == "instruction"
    assert detect_format({"prompt": "", "completion": ""}) == "prompt_completion"
    assert detect_format({"text": ""}) == "text"
    assert detect_format({"question": ""}) is None
