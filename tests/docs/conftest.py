"""What the manual's examples run against: the demo model, prepared once and linked into each
page's folder, and — for the pages that talk to the API — one real ``roundhouse serve
--with-worker --demo`` (SQLite, the no-server broker, the demo model and datasets, and a local
Hub to pull from and push to: ``tests/docs/hub.py``), started the first time a page needs it and
stopped at the end of the session.

The examples' summary (blocks run and not run per page, and the seconds each page took) is printed
at the end of the run from what each page's test recorded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.docs.hub import docs_hub, hub_settings
from tests.utils import LOGIN_LINE, Process, child_env, free_port, roundhouse

DEMO_FOLDER = "smollm2-135m-instruct"  # what prepare_demo_model makes under a models folder
SUMMARY = "docs-examples"  # the user property a page's test records its summary under


@dataclass
class Service:
    """The running service: its address, a key made with ``roundhouse keys create``, and the
    settings its CLI commands need to reach the same database."""

    base_url: str
    key: str
    home: Path
    process: Process
    hub: dict[str, str]  # the Hub settings (tests/docs/hub.py), which the CLI's transfers read too

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def environment(self) -> dict[str, str]:
        """What a page's commands see of it: the key, and the home and port ``roundhouse keys
        create`` or ``roundhouse login-url`` read."""
        return {
            "ROUNDHOUSE_KEY": self.key,
            "ROUNDHOUSE_HOME": str(self.home),
            "ROUNDHOUSE_PORT": str(self.port),
            **self.hub,
        }


def link_tree(source: Path, target: Path) -> None:
    """``target`` as a copy of ``source`` made of hard links (a real folder, no bytes copied);
    a symbolic link where hard links cannot be made."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        target.symlink_to(source, target_is_directory=True)


@pytest.fixture(scope="session")
def demo_models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding the prepared demo model: kept in pytest's cache between runs
    (converting it takes half a minute), else prepared once for this session."""
    cache = getattr(request.config, "cache", None)
    models = cache.mkdir("roundhouse-demo-models") if cache is not None else tmp_path_factory.mktemp("models")
    # another pytest run of this checkout may be preparing the same folder: one at a time
    with (models / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (models / DEMO_FOLDER / "config.json").is_file():
            done = subprocess.run(
                roundhouse("prepare-demo", "--models-dir", str(models)),
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, f"roundhouse prepare-demo failed:\n{done.stdout}\n{done.stderr}"
    return models


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the host optimizer's compiled kernels, shared by every page (each page's
    HOME is its own folder: without it each would build them again)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="session")
def docs_service(tmp_path_factory: pytest.TempPathFactory, demo_models: Path) -> Iterator[Service]:
    """``roundhouse serve --with-worker --demo --new-login-key`` on a free port, as ``make run``
    starts it; stopped with SIGINT at the end of the session."""
    tmp = tmp_path_factory.mktemp("docs-service")
    home = tmp / "home"
    link_tree(demo_models / DEMO_FOLDER, home / "models" / DEMO_FOLDER)
    hub = docs_hub(demo_models / DEMO_FOLDER)  # a local Hub: docs/guides/hub.md pulls and pushes
    env = child_env(
        ROUNDHOUSE_HOME=str(home),
        ROUNDHOUSE_PORT=str(free_port()),
        ROUNDHOUSE_TELEMETRY_SECONDS="1",
        **hub_settings(hub),
    )
    process = Process(
        roundhouse("serve", "--with-worker", "--demo", "--new-login-key"), env=env, log=tmp / "serve.log"
    ).start()
    children: list[psutil.Process] = []
    try:
        found = process.wait_for_line(LOGIN_LINE, timeout=180)
        assert found is not None, f"no login URL printed:\n{process.tail()}"
        base_url = found.group(1).split("/login?", 1)[0]
        process.wait_for_http(f"{base_url}/api/health", timeout=60)
        done = subprocess.run(
            roundhouse("keys", "create", "--name", "docs-examples"),
            env=process.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"roundhouse keys create:\n{done.stderr}"
        yield Service(
            base_url=base_url, key=done.stdout.strip(), home=home, process=process, hub=hub_settings(hub)
        )
        children = process.descendants()
    finally:
        stopped = process.stop(signal.SIGINT, grace=60)
        hub.stop()
    assert stopped, f"the service did not stop within 60 s of SIGINT (killed):\n{process.tail()}"
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        p.kill()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per page: the blocks run, those not run with their reasons, and the seconds it took."""
    lines: list[str] = []
    for kind in ("passed", "failed"):
        for report in terminalreporter.stats.get(kind, []):
            if getattr(report, "when", None) != "call":
                continue
            lines.extend(str(v) for k, v in getattr(report, "user_properties", []) if k == SUMMARY)
    if lines:
        terminalreporter.write_sep("-", "docs examples")
        for line in sorted(lines):
            terminalreporter.write_line(line)
