"""How a page of the manual is run (tests/docs/examples.py says how it is read): its blocks in
order, in a folder of its own, its commands one after another in one ``bash`` (a variable exported
or a folder entered stays for the next command), against the demo model and, where a block talks
to the API, the docs service (tests/docs/conftest.py).

The pages are shared among a few test files (``GROUPS``; a page no group names runs in
tests/docs/test_pages_rest.py) so that the suite's workers run them side by side; ``pytest
tests/docs -k grpo`` runs one page. A failure names the page, the block's line, the command and
its output. Each page's commands and their whole output are kept in test-artifacts/docs/<page>.txt
(the sample output a page shows comes from there)."""

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


# the page groups, each run by its own test file (tests/docs/test_pages_<group>.py): a page a group
# does not name is in "rest"; sized so that no file takes much longer than the others
GROUPS: dict[str, tuple[str, ...]] = {
    "start": (
        "README.md",
        "docs/getting-started.md",
        "docs/guides/fine-tuning.md",
        "docs/guides/playground.md",
        "docs/guides/openai-api.md",
    ),
    "methods": ("docs/guides/methods.md", "docs/guides/grpo.md"),
    "outputs": ("docs/guides/export.md", "docs/guides/evaluation.md"),
    "hub": ("docs/guides/hub.md", "docs/guides/tracking-and-sweeps.md"),
}
REST = "rest"


def group_of(page: Path) -> str:
    name = examples.relative(page)
    return next((g for g, members in GROUPS.items() if name in members), REST)


def group(name: str) -> list[Path]:
    """The runnable pages of a group, in the order of ``examples.pages()``."""
    return [p for p in RUNNABLE if group_of(p) == name]


def page_id(page: Path) -> str:
    return examples.relative(page)


def substitute(text: str, base_url: str | None) -> str:
    """The example's service address replaced by the running service's."""
    if base_url is None:
        return text
    return text.replace(examples.EXAMPLE_ADDRESS, base_url.split("://", 1)[1])


def tail(text: str, chars: int = 6000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


def run_page(
    page: Path,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    demo_models: Path,
    kernel_cache: Path,
) -> None:
    """Run every block of ``page``; fails the calling test at the first command that fails."""
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
