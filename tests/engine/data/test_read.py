"""Every malformed row gets an error naming its line (or row) and what is wrong."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.data.encode import validate
from engine.data.read import MAX_MESSAGE, detect_format, read_examples, read_records


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
            "line 2: messages[0].content must be a string or a list of parts, got int",
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
    assert str(tmp_path) not in str(errors[0])  # pyarrow's message names no server folder


def test_unsupported_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.txt: unsupported file type '.txt'"):
        read_examples(tmp_path / "data.txt")


def test_detect_format() -> None:
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"instruction": "", "output": ""}) == "instruction"
    assert detect_format({"prompt": "", "completion": ""}) == "prompt_completion"
    assert detect_format({"text": ""}) == "text"
    for key in ("chosen", "rejected", "preferred_output", "non_preferred_output"):
        assert detect_format({"prompt": "", key: ""}) == "preference"
    assert detect_format({"input": {"messages": []}, "preferred_output": []}) == "preference"
    assert detect_format({"question": ""}) is None


def peak_python_bytes(work: Callable[[], Any]) -> int:
    """The most memory Python objects took while ``work()`` ran."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_csv_is_read_row_by_row(tmp_path: Path) -> None:
    p = tmp_path / "big.csv"
    p.write_text("prompt,completion\n" + "a prompt,a completion\n" * 150_000)  # 3.4 MB
    assert sum(1 for _ in read_records(p)) == 150_000
    assert peak_python_bytes(lambda: sum(1 for _ in read_records(p))) < 2 << 20


def test_parquet_is_read_by_batches(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "big.parquet"
    rows = 200_000
    table = pa.table({"prompt": [f"p{i}" for i in range(rows)], "completion": ["c"] * rows})
    pq.write_table(table, p, row_group_size=20_000)
    del table
    locations = [n for n, _ in read_records(p)]
    assert locations == list(range(1, rows + 1))
    assert peak_python_bytes(lambda: sum(1 for _ in read_records(p))) < 4 << 20


def test_errors_are_all_counted_but_only_the_first_kept(tmp_path: Path) -> None:
    p = jsonl(tmp_path, [json.dumps({"k" * 5000: 1})] + ['{"text": 5}'] * 50_000)
    report = validate(str(p), max_errors=100)
    assert not report.ok and report.rows == 50_001
    assert report.errors_total == 50_001 and [e.line for e in report.errors] == list(range(1, 101))
    assert report.to_dict()["errors_total"] == 50_001 and len(report.to_dict()["errors"]) == 100
    # no message is longer than MAX_MESSAGE, however long the offending value
    first = report.errors[0].message
    assert (
        first.startswith("cannot tell the row format") and len(first) == MAX_MESSAGE and first.endswith("…")
    )
    # memory stays flat: the errors past the first 100 are counted, not kept
    assert peak_python_bytes(lambda: validate(str(p), max_errors=100)) < 2 << 20
    assert len(validate(str(p)).errors) == 50_001  # without max_errors, every error is kept
