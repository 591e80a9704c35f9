"""docs/reference/ is what the code makes now: each generated page is compared with the committed
one, and a page that differs fails naming itself and the command that writes it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.guide import reference
from tests.utils import ROOT


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    return reference.pages()


def test_every_generated_page_is_committed_as_the_code_makes_it(built: dict[str, str]) -> None:
    stale = reference.stale(reference.REFERENCE, built)
    assert not stale, (
        f"docs/reference/ is stale: {', '.join(stale)} differ from what the code makes; "
        f"run `{reference.COMMAND}` and commit the pages"
    )
    written = {p.name for p in reference.REFERENCE.glob("*.md")}
    assert written == set(built), f"pages no generator makes: {sorted(written - set(built))}"


def test_the_pages_say_what_the_code_says(built: dict[str, str]) -> None:
    """Spot checks against the sources: a bound, a setting, a subcommand's flag, a route."""
    from engine import HyperSpec
    from engine.methods import METHODS

    config = built["config.md"]
    assert "| `learning_rate` | number | `0.0002` | > 0, ≤ 10 |" in config
    assert HyperSpec.model_fields["batch_size"].description in config
    for name in METHODS:
        assert f"\n### {name}\n" in config, name
    assert "| `ROUNDHOUSE_MAX_UPLOAD_BYTES` | integer | `2147483648` (2 GiB) | ≥ 1 |" in built["settings.md"]
    assert "\n## roundhouse keys revoke\n" in built["cli.md"]
    assert "| `--processes PROCESSES` | `1` | server processes" in built["cli.md"]
    assert "| `POST` | `/api/jobs` |" in built["api.md"] and "| `GET` | `/guide` |" in built["api.md"]
    assert "\n## string_check\n" in built["graders.md"]
    assert "- `server.guide.reference`: The pages of" in built["modules.md"]
    for name in ("config.md", "settings.md", "cli.md", "graders.md", "api.md", "modules.md"):
        assert f"]({name})" in built["index.md"], name


def test_every_argument_and_every_grader_field_is_described(built: dict[str, str]) -> None:
    """A row whose Description cell is "—" is a flag or a field the code says nothing of; an argument
    hidden from --help is not listed; a grader that holds graders (multi) lists its fields too."""
    for page in ("cli.md", "graders.md"):
        rows = [line for line in built[page].splitlines() if line.startswith("| `")]
        assert rows, page
        bare = [row.split(" | ", 1)[0].removeprefix("| ") for row in rows if row.endswith("| — |")]
        assert not bare, f"{page}: no description for {', '.join(bare)}"
    assert "SUPPRESS" not in built["cli.md"]
    multi = built["graders.md"].split("\n## multi\n", 1)[1]
    assert "| `calculate_output` | string | required |" in multi and "| `graders` |" in multi


def test_no_machine_or_environment_leaks_into_the_pages(
    built: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The service's variables set to other values change nothing (serve's --host default is one)."""
    monkeypatch.setenv("ROUNDHOUSE_HOST", "0.0.0.0")
    monkeypatch.setenv("ROUNDHOUSE_PORT", "9999")
    monkeypatch.setenv("ROUNDHOUSE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "40")
    again = {name: reference.PAGES[name][1]() for name in ("cli.md", "api.md", "settings.md")}
    for name, text in again.items():
        assert text == built[name], name
    assert str(ROOT) not in "".join(built.values())


def test_a_module_without_a_docstring_fails_the_generation_by_name(tmp_path: Path) -> None:
    for package in reference.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "server" / "bare.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"server\.bare \(server/bare\.py\)"):
        reference.module_docs(tmp_path)
    (tmp_path / "server" / "bare.py").write_text('"""Now it says what it is.\n\nMore."""\nX = 1\n')
    assert reference.module_docs(tmp_path)["server.bare"] == "Now it says what it is."


def test_check_names_a_stale_page_and_write_brings_it_back(tmp_path: Path, built: dict[str, str]) -> None:
    folder = tmp_path / "reference"
    folder.mkdir()
    for name, text in built.items():
        (folder / name).write_text(text)
    (folder / "cli.md").write_text(built["cli.md"].replace("roundhouse", "rh", 1))
    check = subprocess.run(
        [sys.executable, "-m", "server.guide.reference", "--check", "--folder", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 1 and "cli.md" in check.stderr and "make docs" in check.stderr, check.stderr
    assert "config.md" not in check.stderr
    assert reference.write(folder) == ["cli.md"]
    assert reference.stale(folder, built) == []


def test_the_makefile_target_runs_the_generator() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "-m server.guide.reference --write" in recipe, recipe
