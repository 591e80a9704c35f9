"""The manual's example conventions checked over every page of docs/ (and README.md): markers,
relative links, the page reader and the shell the pages run in. The pages themselves run in
tests/docs/test_pages_*.py (tests/docs/runner.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.docs import examples
from tests.docs.runner import GROUPS, PAGES, RUNNABLE, Shell, group, group_of
from tests.utils import ROOT, child_env


def test_every_runnable_page_is_run_by_one_group() -> None:
    """Each page with something to run is in exactly one group's file, and each page a group names
    exists and has something to run (a renamed page is not silently dropped)."""
    names = {examples.relative(p) for p in RUNNABLE}
    named = [m for members in GROUPS.values() for m in members]
    assert sorted(set(named) - names) == [], "a group names a page that is gone or runs nothing"
    assert len(named) == len(set(named)), "a page is in two groups"
    covered = sorted(examples.relative(p) for g in (*GROUPS, "rest") for p in group(g))
    assert covered == sorted(names)
    for g in (*GROUPS, "rest"):
        assert (ROOT / "tests" / "docs" / f"test_pages_{g}.py").is_file(), f"no test file for the group {g}"
    assert group_of(ROOT / "docs" / "a-new-page.md") == "rest"


def test_markers_are_complete() -> None:
    """Each ``not run`` gives its reason, each ``run by`` names a test that exists, each marker
    stands just before a fence, and each page's fences close and its commands end."""
    problems: list[str] = []
    for page in PAGES:
        try:
            problems.extend(examples.marker_problems(page))
            for block in examples.parse(page)[0]:
                if block.role == "console":
                    block.commands()
        except ValueError as exc:
            problems.append(str(exc))
    assert problems == [], "\n".join(problems)


def test_relative_links_resolve() -> None:
    """Every relative link of docs/ and README.md names a file that exists (and a heading of it
    where it names one)."""
    problems = [p for page in PAGES for p in examples.broken_links(page)]
    assert problems == [], "\n".join(problems)


def test_the_reader_finds_markers_blocks_and_commands() -> None:
    """The page reader itself, on a page written here: fences, markers, commands, continuations."""
    text = "\n".join(
        [
            "# A page",
            "",
            "<!-- file: data/train.jsonl -->",
            "```jsonl",
            '{"text": "a"}',
            "```",
            "",
            "```console",
            "$ roundhouse validate-data data/train.jsonl \\",
            "    --model demo",
            "data/train.jsonl: format text, 1 rows, 0 errors",
            "$ echo done",
            "```",
            "",
            "<!-- not run: needs a GPU box -->",
            "````bash",
            "```",
            "make gpu-check",
            "````",
            "",
            "```yaml",
            "a: 1",
            "```",
        ]
    )
    page = ROOT / "docs" / "example.md"
    blocks, markers = examples.parse(page, text)
    assert [(b.line, b.info, b.role) for b in blocks] == [
        (4, "jsonl", "file"),
        (8, "console", "console"),
        (16, "bash", "not run"),
        (21, "yaml", "illustration"),
    ]
    assert blocks[0].value == "data/train.jsonl" and blocks[0].text == '{"text": "a"}\n'
    commands = blocks[1].commands()
    assert [(c.line, c.text) for c in commands] == [
        (9, "roundhouse validate-data data/train.jsonl \\\n    --model demo"),
        (12, "echo done"),
    ]
    assert blocks[2].text == "```\nmake gpu-check\n" and blocks[2].value == "needs a GPU box"
    assert [(m.line, m.kind, m.block) for m in markers] == [(3, "file", True), (15, "not run", True)]
    assert examples.missing_test("tests/docs/test_examples.py::test_markers_are_complete") is None
    assert examples.missing_test("tests/docs/test_examples.py::test_nothing") is not None
    assert examples.missing_test("tests/nowhere.py::test_x") == "no file tests/nowhere.py"
    with pytest.raises(ValueError, match="never closed"):
        examples.parse(page, "```console\n$ echo\n")


def test_a_shell_keeps_its_variables_and_reports_failures(tmp_path: Path) -> None:
    shell = Shell(tmp_path, child_env(PATH=os.environ["PATH"], HOME=str(tmp_path)))
    try:
        assert shell.run("export WORD=hello", timeout=10) == (0, "")
        assert shell.run('echo "$WORD" && echo oops >&2', timeout=10) == (0, "hello\noops\n")
        assert shell.run("false | cat", timeout=10)[0] == 1  # pipefail
        rc, output = shell.run("sleep 5", timeout=0.5)
        assert rc is None and "timed out" in output
    finally:
        shell.close()
