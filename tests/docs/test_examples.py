"""Every command and request the manual shows runs here: one test per page of docs/ (and README.md)
that has a ```console or ```python block, run in its order in a folder of its own (tests/docs/
examples.py says how a page is read); and the pages' markers and relative links are checked.

``pytest tests/docs -k grpo`` runs one page; a failure names the page, the block's line, the
command and its output. Each page's commands and their whole output are kept in
test-artifacts/docs/<page>.txt (the sample output a page shows comes from there)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.docs import examples
from tests.docs.conftest import DEMO_FOLDER, SUMMARY, link_tree
from tests.utils import ROOT, child_env

# the interpreter the examples' ``python`` and ``roundhouse`` come from (the project's environment)
BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 600.0  # one command or python block (a job waited for on a busy machine)
SLOW_BLOCK_S = 5.0  # a block that takes longer is named in the summary with its seconds
# each page's commands and their whole output, for writing a page's sample output from a real run
TRANSCRIPTS = ROOT / "test-artifacts" / "docs"

PAGES = examples.pages()
RUNNABLE = [p for p in PAGES if examples.runnable(examples.parse(p)[0])]


class Shell:
    """One ``bash`` for a page: its commands run in it one after another, as typed in a terminal
    (a variable exported or a folder entered stays for the next), stdin from /dev/null, stdout and
    stderr together."""

    def __init__(self, cwd: Path, env: dict[str, str], transcript: Path | None = None) -> None:
        self.transcript = transcript
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.send("set -o pipefail")

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def run(self, command: str, *, timeout: float) -> tuple[int | None, str]:
        """The command's exit status (None: it timed out or ended the shell) and its output (kept in
        the transcript too, when the shell has one)."""
        rc, output = self._run(command, timeout=timeout)
        if self.transcript is not None:
            with self.transcript.open("a", encoding="utf-8") as out:
                out.write(f"$ {command}\n{output}[exit status: {rc}]\n\n")
        return rc, output

    def _run(self, command: str, *, timeout: float) -> tuple[int | None, str]:
        token = f"__done_{uuid.uuid4().hex}"
        self.send(f"{{\n{command}\n}} </dev/null 2>&1\nprintf '\\n{token} %d\\n' $?")
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, out.decode(errors="replace") + f"\n[timed out after {timeout:g} s]"
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None, out.decode(errors="replace") + "\n[the shell ended]"
            out += chunk
            text = out.decode(errors="replace")
            mark = text.rfind(f"\n{token} ")
            if mark >= 0 and text.endswith("\n"):
                return int(text[mark + len(token) + 2 :].strip()), text[:mark]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def page_id(page: Path) -> str:
    return examples.relative(page)


def substitute(text: str, base_url: str | None) -> str:
    """The example's service address replaced by the running service's."""
    if base_url is None:
        return text
    return text.replace(examples.EXAMPLE_ADDRESS, base_url.split("://", 1)[1])


def tail(text: str, chars: int = 6000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_page(
    page: Path,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    demo_models: Path,
    kernel_cache: Path,
) -> None:
    blocks, _ = examples.parse(page)
    folder = tmp_path / "page"
    folder.mkdir()
    link_tree(demo_models / DEMO_FOLDER, folder / "data" / "models" / DEMO_FOLDER)
    env = child_env(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        HOME=str(folder),
        HF_HUB_OFFLINE="1",
        ROUNDHOUSE_KERNEL_CACHE=str(kernel_cache),
    )
    env.pop("VIRTUAL_ENV", None)
    base_url = None
    if any(b.needs_service() for b in blocks):
        service = request.getfixturevalue("docs_service")
        env.update(service.environment())
        base_url = service.base_url
    scripts = folder / ".examples"
    scripts.mkdir()
    started = time.monotonic()
    counts = {"run": 0, "file": 0, "illustration": 0}
    not_run: list[str] = []
    slow: list[str] = []  # the blocks that took a while, with their seconds
    transcript = TRANSCRIPTS / f"{page_id(page)}.txt"
    transcript.parent.mkdir(parents=True, exist_ok=True)
    transcript.unlink(missing_ok=True)
    shell = Shell(folder, env, transcript)
    try:
        for block in blocks:
            role = block.role
            began = time.monotonic()
            if role == "file":
                target = folder / block.value
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(substitute(block.text, base_url), encoding="utf-8")
                counts["file"] += 1
            elif role in ("not run", "run by"):
                not_run.append(f"line {block.line}: {role}: {block.value}")
            elif role == "illustration":
                counts["illustration"] += 1
            elif role == "console":
                for command in block.commands():
                    run_one(shell, substitute(command.text, base_url), f"{block.where} (line {command.line})")
                counts["run"] += 1
            else:  # python: a script of its own, run by the page's shell (its folder and variables)
                script = scripts / f"{page.stem}-L{block.line}.py"
                script.write_text(substitute(block.text, base_url), encoding="utf-8")
                run_one(shell, f"python {script.relative_to(folder)}", f"{block.where} (python)")
                counts["run"] += 1
            took = time.monotonic() - began
            if took >= SLOW_BLOCK_S:
                slow.append(f"line {block.line}: {took:.1f} s")
    finally:
        shell.close()
        seconds = time.monotonic() - started
        summary = (
            f"{page_id(page)}: {counts['run']} run, {counts['file']} files, {len(not_run)} not run, "
            f"{counts['illustration']} illustrations; {seconds:.1f} s"
            + (f" ({', '.join(slow)})" if slow else "")
            + "".join(f"\n    not run: {n}" for n in not_run)
        )
        request.node.user_properties.append((SUMMARY, summary))


def run_one(shell: Shell, command: str, where: str) -> None:
    rc, output = shell.run(command, timeout=COMMAND_TIMEOUT_S)
    if rc != 0:
        status = "did not finish" if rc is None else f"exited with {rc}"
        pytest.fail(f"{where}: {status}:\n$ {command}\n{tail(output)}", pytrace=False)


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
