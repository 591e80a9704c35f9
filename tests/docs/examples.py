"""The examples of the manual: every page of docs/ (and README.md) read into its fenced blocks, each
with the line of its opening fence and the marker on the line before it, and what running a page
means.

The conventions (docs/internals/testing.md tells them to writers):

- a ```console block is run: each line starting with ``$ `` is a command (a trailing ``\\``
  continues it on the next line), every other line is sample output, shown and not compared;
- a ```python block is run as a script;
- ``<!-- file: NAME -->`` before a fence writes the block to NAME in the page's folder (any info
  string), for a later command to read;
- ``<!-- not run: REASON -->`` before a fence: the block is shown and not run, for the reason given;
- ``<!-- run by: tests/path/test_file.py::test_name -->``: an existing test runs that command;
- any other block is an illustration.

A page's blocks run in their order, in one scratch folder per page; commands run one by one in
one ``bash`` for the page (tests/docs/runner.py: a file an earlier command wrote stays, and so does
a variable it exported or a folder it entered).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tests.utils import ROOT

DOCS = ROOT / "docs"
# where examples say the service answers; the runner puts its own service's address there
EXAMPLE_ADDRESS = "127.0.0.1:8000"
# what in a runnable block says it talks to the service
NEEDS_SERVICE = (EXAMPLE_ADDRESS, "ROUNDHOUSE_KEY")

MARKER = re.compile(r"^\s*<!--\s*(file|not run|run by)\s*:\s*(.*?)\s*-->\s*$")
ANY_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
FENCE = re.compile(r"^( *)(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
RUN_BY = re.compile(r"^(tests/[\w/.-]+\.py)::([\w:]+)$")

Role = Literal["console", "python", "file", "not run", "run by", "illustration"]


@dataclass(frozen=True)
class Command:
    """One ``$ `` command of a console block: its text (continuation lines joined by the shell's
    backslash-newline) and the line of the page it starts on."""

    text: str
    line: int


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: ``line`` is its opening fence's (1-based), ``info`` the first word
    of its info string, ``marker`` and ``value`` the comment before it (None, "file", "not run",
    "run by"; the name, reason or test), ``text`` its content."""

    page: Path
    line: int
    info: str
    text: str
    marker: str | None = None
    value: str = ""

    @property
    def role(self) -> Role:
        if self.marker in ("file", "not run", "run by"):
            return self.marker  # type: ignore[return-value]
        if self.info == "console":
            return "console"
        if self.info == "python":
            return "python"
        return "illustration"

    @property
    def where(self) -> str:
        return f"{relative(self.page)}:{self.line}"

    def commands(self) -> list[Command]:
        """A console block's commands, in order.

        Raises:
            ValueError: a continued command runs into the end of the block.
        """
        out: list[Command] = []
        lines = self.text.split("\n")
        i = 0
        while i < len(lines):
            text = lines[i]
            if not text.startswith("$ "):
                i += 1
                continue
            start = self.line + 1 + i
            parts = [text[2:]]
            while parts[-1].endswith("\\"):
                i += 1
                if i >= len(lines):
                    raise ValueError(f"{relative(self.page)}:{start}: the command's last line ends with '\\'")
                parts.append(lines[i])
            out.append(Command("\n".join(parts), start))
            i += 1
        return out

    def needs_service(self) -> bool:
        return self.role in ("console", "python") and any(s in self.text for s in NEEDS_SERVICE)


@dataclass(frozen=True)
class Marker:
    """An example marker found on a page; ``block`` is False when no fence follows it."""

    page: Path
    line: int
    kind: str
    value: str
    block: bool


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)


def pages() -> list[Path]:
    """README.md and every page under docs/, README first."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))] if DOCS.is_dir() else [ROOT / "README.md"]


def parse(page: Path, text: str | None = None) -> tuple[list[Block], list[Marker]]:
    """A page's fenced blocks and its example markers.

    Raises:
        ValueError: a fence is never closed.
    """
    lines = (page.read_text(encoding="utf-8") if text is None else text).split("\n")
    blocks: list[Block] = []
    markers: list[Marker] = []
    i = 0
    while i < len(lines):
        found = MARKER.match(lines[i])
        if found is not None:
            follows = i + 1 < len(lines) and FENCE.match(lines[i + 1]) is not None
            markers.append(Marker(page, i + 1, found.group(1), found.group(2), follows))
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = opening.groups()
        before = MARKER.match(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        closing = re.compile(rf"^ *{fence[0]}{{{len(fence)},}}\s*$")
        while j < len(lines) and closing.match(lines[j]) is None:
            # content lines lose the opening fence's indentation, as CommonMark reads them
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{relative(page)}:{i + 1}: the fence is never closed")
        blocks.append(
            Block(
                page=page,
                line=i + 1,
                info=info.lower(),
                text="\n".join(body) + ("\n" if body else ""),
                marker=before.group(1) if before else None,
                value=before.group(2) if before else "",
            )
        )
        i = j + 1
    return blocks, markers


def runnable(blocks: list[Block]) -> bool:
    """Whether a page has anything to run (a console or python block)."""
    return any(b.role in ("console", "python") for b in blocks)


def marker_problems(page: Path) -> list[str]:
    """What is wrong with a page's markers: a marker with no fence after it, a ``not run`` with no
    reason, a ``run by`` naming no existing test, a file name that leaves the page's folder, an
    HTML comment before a fence that is no marker."""
    blocks, markers = parse(page)
    problems: list[str] = []
    for m in markers:
        where = f"{relative(page)}:{m.line}"
        if not m.block:
            problems.append(f"{where}: '<!-- {m.kind}: -->' is not on the line just before a fence")
        if m.kind == "not run" and len(m.value) < 3:
            problems.append(f"{where}: 'not run' gives no reason")
        if m.kind == "run by":
            wrong = missing_test(m.value)
            if wrong:
                problems.append(f"{where}: run by {m.value!r}: {wrong}")
        if m.kind == "file" and not _plain_name(m.value):
            problems.append(f"{where}: file {m.value!r} is not a relative path inside the page's folder")
    lines = page.read_text(encoding="utf-8").split("\n")
    for b in blocks:
        above = lines[b.line - 2] if b.line >= 2 else ""
        if ANY_COMMENT.match(above) and MARKER.match(above) is None:
            problems.append(f"{b.where}: {above.strip()!r} before a fence is no example marker")
    return problems


def _plain_name(name: str) -> bool:
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def missing_test(reference: str) -> str | None:
    """Why ``tests/path.py::name`` (or ``::Class::name``) names no test here; None when it does."""
    found = RUN_BY.match(reference)
    if found is None:
        return "not of the form tests/path/test_file.py::test_name"
    path = ROOT / found.group(1)
    if not path.is_file():
        return f"no file {found.group(1)}"
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    defined = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    for name in found.group(2).split("::"):
        match = next((n for n in scope if isinstance(n, defined) and n.name == name), None)
        if match is None:
            return f"{found.group(1)} defines no {name}"
        scope = match.body if isinstance(match, ast.ClassDef) else []
    return None


# ---- links --------------------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def code_lines(page: Path) -> set[int]:
    """The lines of a page inside its fenced blocks, fences included."""
    return {n for b in parse(page)[0] for n in range(b.line, b.line + b.text.count("\n") + 2)}


def links(page: Path) -> list[tuple[int, str]]:
    """The relative link targets of a page with their lines, code blocks and code spans left out."""
    inside = code_lines(page)
    out: list[tuple[int, str]] = []
    for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), start=1):
        if n in inside:
            continue
        line = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        ref = REFERENCE_LINK.match(line)
        if ref is not None:
            targets.append(ref.group(1))
        out.extend((n, t) for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE))
    return out


def heading_slugs(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (lowercase, punctuation dropped,
    spaces as hyphens, ``-1``, ``-2`` for repeats)."""
    inside = code_lines(page)
    seen: dict[str, int] = {}
    slugs: set[str] = set()
    for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), start=1):
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None or n in inside:
            continue
        # emphasis marks and code fences go, a link keeps its text; an underscore inside a word
        # (string_check) is text, and GitHub keeps it
        text = re.sub(
            r"[`*]|(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])|\[([^\]]*)\]\([^)]*\)",
            lambda m: m.group(1) or "",
            heading.group(1),
        )
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file does not exist, or whose ``#anchor`` names no
    heading of the Markdown page it points to."""
    problems: list[str] = []
    for line, target in links(page):
        path_part, _, anchor = target.partition("#")
        # a path from / is from the repository's root, as GitHub reads it (the service's /docs: docs/)
        base = ROOT if path_part.startswith("/") else page.parent
        dest = (base / path_part.lstrip("/")).resolve() if path_part else page
        where = f"{relative(page)}:{line}"
        if not dest.exists():
            problems.append(f"{where}: {target} -> no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_slugs(dest):
            problems.append(f"{where}: {target} -> {relative(dest)} has no heading #{anchor}")
    return problems
