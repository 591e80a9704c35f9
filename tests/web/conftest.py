"""Browser-test fixtures: one real ``roundhouse serve --with-worker`` (SQLite, the folder broker, a
tiny base model, a local server standing in for the Hugging Face Hub) shared by the whole UI
suite, headless Chromium through Playwright, a logged-in browser context, and pages that fail
their test on any console error."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest

from server.deps import COOKIE
from tests.engine.tiny import tiny_model_folder
from tests.utils import LOGIN_LINE, ROOT, Process, child_env, free_port, roundhouse
from tests.utils.fake_hub import FakeHub

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page, ViewportSize

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}


@dataclass
class Server:
    """The running service: where it answers, the one-time login link it printed, a key made with
    ``roundhouse keys create``, its home, its process and the Hub it talks to."""

    base_url: str
    login_url: str
    key: str
    home: Path
    process: Process
    hub: FakeHub

    def log_tail(self, chars: int = 4000) -> str:
        return self.process.tail(chars)

    def new_login_url(self) -> str:
        """A fresh one-time login link, from ``roundhouse login-url`` (each link works once)."""
        return run_cli(self.process, "login-url")

    def client(self) -> httpx.Client:
        """An API client with the login key (for setup shortcuts, never for what is under test)."""
        return httpx.Client(
            base_url=self.base_url, timeout=30, headers={"Authorization": f"Bearer {self.key}"}
        )


def method_entry(server: Server, name: str) -> dict[str, Any]:
    """A method's entry of GET /api/methods: what the new-job form and the job page render from."""
    with server.client() as client:
        r = client.get("/api/methods")
    assert r.status_code == 200, r.text
    return next(m for m in r.json()["data"] if m["name"] == name)


def run_cli(process: Process, *args: str) -> str:
    """What ``roundhouse ARGS`` prints on stdout, run with the server's environment."""
    done = subprocess.run(roundhouse(*args), env=process.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"roundhouse {' '.join(args)}:\n{done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``python -m server.cli serve --with-worker --new-login-key`` on a free port, stopped with SIGINT."""
    tmp = tmp_path_factory.mktemp("web")
    home = tmp / "home"
    tiny_model_folder(home / "models" / "tiny")
    hub = FakeHub().start()
    env = child_env(
        ROUNDHOUSE_HOME=str(home),
        ROUNDHOUSE_PORT=str(free_port()),
        ROUNDHOUSE_LEASE_SECONDS="5",
        ROUNDHOUSE_TELEMETRY_SECONDS="0.5",
        ROUNDHOUSE_HUB_ENDPOINT=hub.url,
        ROUNDHOUSE_HUB_TOKEN=hub.token,
        ROUNDHOUSE_HUB_XET="0",
        ROUNDHOUSE_HUB_KEEP_FREE_BYTES="0",
    )
    command = roundhouse("serve", "--with-worker", "--new-login-key")
    process = Process(command, env=env, log=tmp / "serve.log").start()
    children: list[psutil.Process] = []
    try:
        found = process.wait_for_line(LOGIN_LINE, timeout=90)
        assert found is not None, f"no login URL printed:\n{process.tail()}"
        login_url = found.group(1)
        base_url = login_url.split("/login?", 1)[0]
        process.wait_for_http(f"{base_url}/api/health", timeout=60)
        key = run_cli(process, "keys", "create", "--name", "web-tests")
        yield Server(base_url=base_url, login_url=login_url, key=key, home=home, process=process, hub=hub)
        children = process.descendants()
    finally:
        stopped = process.stop(signal.SIGINT, grace=60)
        hub.stop()
    assert stopped, f"the server did not stop within 60 s of SIGINT (killed):\n{process.tail()}"
    # the worker it started (and the worker's pool) went down with it
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        p.kill()
    assert alive == [], f"processes left running after the server stopped: {alive}"


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    sync_api = pytest.importorskip("playwright.sync_api")
    # a previous run's failures go; those of another pytest-xdist worker of this run stay
    started = psutil.Process().create_time()
    for stale in SCREENSHOTS.glob("FAILED-*.png"):
        if stale.stat().st_mtime < started:
            stale.unlink(missing_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def logged_in(browser: Browser, server: Server) -> Iterator[BrowserContext]:
    """A browser context holding the session cookie (set by opening a fresh login link)."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto(server.new_login_url())
    page.close()
    assert any(c["name"] == COOKIE for c in context.cookies()), context.cookies()
    try:
        yield context
    finally:
        context.close()


@dataclass
class ConsoleWatch:
    """Console errors and uncaught page errors of one page; ``allow`` excuses expected ones."""

    seen: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def attach(self, page: Page) -> None:
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.seen.append(f"pageerror: {exc}"))

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            where = msg.location.get("url", "") if msg.location else ""
            self.seen.append(f"console.error: {msg.text} [{where}]")

    def allow(self, pattern: str) -> None:
        """Excuse console errors matching ``pattern`` (a regex over 'console.error: text [url]')."""
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [m for m in self.seen if not any(p.search(m) for p in self.allowed)]


def open_page(context: BrowserContext, watch: ConsoleWatch) -> Page:
    page = context.new_page()
    watch.attach(page)
    return page


@pytest.fixture
def console() -> ConsoleWatch:
    return ConsoleWatch()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[FAILED] = report.failed
    return report


FAILED = pytest.StashKey[bool]()


@pytest.fixture
def page(request: pytest.FixtureRequest, logged_in: BrowserContext, console: ConsoleWatch) -> Iterator[Page]:
    """A fresh logged-in page at 1280×800; the test fails on any console error it logged.

    A failing test (or one with console errors) leaves a screenshot of the page as it was:
    screenshots/FAILED-<test>.png."""
    page = open_page(logged_in, console)
    yield page
    bad = console.unexpected()
    if request.node.stash.get(FAILED, False) or bad:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
        try:
            screenshot(page, f"FAILED-{name}")
        except Exception as exc:  # a page that crashed cannot be photographed; the failure says why
            print(f"no screenshot of the failed page: {exc}")
    page.close()
    bad = console.unexpected()
    assert not bad, "console errors on the page:\n" + "\n".join(bad)


def screenshot(page: Page, name: str, **kwargs: Any) -> Path:
    """Save a full-page screenshot as test-artifacts/screenshots/<name>.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True, **kwargs)
    return path
