"""``/guide``: the manual of docs/ rendered by the service. A made-up manual beside a web folder
checks the rendering (tables, code, the pages' list), the links rewritten to /guide URLs, images
served, traversal refused and a missing page's 404; the real docs/ is then rendered page by page,
and the image's layout (docs/ beside the web UI's folder) is checked against the Dockerfile."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.guide.pages import Guide, docs_folder, github_slug, rewritten
from server.settings import Settings
from tests.utils import ROOT
from tests.utils.aio import run_coroutine

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
SECRET = "the file outside the manual"
INDEX = """# The manual

One line per page.

## Guides

- [Fine-tuning `methods`](guides/methods.md): every method
- [Reference](reference/index.md): generated

## Elsewhere

- [The front door](../README.md)
"""
METHODS = """# Methods

See [the hyper section](../reference/config.md#hyper), [the contents](../index.md),
[a heading](#the-plan-command) and [the settings module](../../server/settings.py); [a site](https://example.org/page.md).

![the job page](../images/job.png)

| Field | Default |
|---|---|
| `beta` | `0.1` |

```console
$ roundhouse plan --cpu
```

## The `plan` command
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A web folder with a manual beside it, and a file outside both."""
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "index.html").write_text("<!doctype html><title>Roundhouse</title>")
    docs = tmp_path / "docs"
    for name, text in {
        "index.md": INDEX,
        "guides/methods.md": METHODS,
        "reference/index.md": "# Reference\n\n- [Config](config.md)\n",
        "reference/config.md": "# Config\n\n## hyper\n",
    }.items():
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text(text)
    (docs / "images").mkdir()
    (docs / "images" / "job.png").write_bytes(PNG)
    (docs / "notes.txt").write_text("not a page")
    (tmp_path / "secret.md").write_text(f"# {SECRET}\n")
    return tmp_path


def client_for(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        yield client


@pytest.fixture
def guide(site: Path) -> Iterator[TestClient]:
    yield from client_for(Settings(home=site / "home", web_dir=site / "web", hub_offline=True))


def test_pages_render_with_the_list_of_pages(guide: TestClient) -> None:
    r = guide.get("/guide")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<h1 id="the-manual">The manual</h1>' in r.text
    assert "<title>The manual · Roundhouse guide</title>" in r.text
    assert '<link rel="stylesheet" href="/static/css/guide.css">' in r.text
    nav = r.text.split('<nav class="guide-nav"', 1)[1].split("</nav>", 1)[0]
    assert re.findall(r'<a href="([^"]+)"', nav) == ["/guide", "/guide/guides/methods", "/guide/reference"]
    assert "<h2>Guides</h2>" in nav and ">Fine-tuning methods</a>" in nav
    assert '<a href="/guide" aria-current="page">Contents</a>' in nav

    page = guide.get("/guide/guides/methods")
    assert page.status_code == 200
    assert '<a href="/guide/guides/methods" aria-current="page">' in page.text
    assert "<table>" in page.text and "<td><code>beta</code></td>" in page.text
    assert '<pre><code class="language-console">$ roundhouse plan --cpu\n</code></pre>' in page.text
    assert '<h2 id="the-plan-command">The <code>plan</code> command</h2>' in page.text
    # a folder answers with its index page
    assert (
        "<h1" in guide.get("/guide/reference").text and "Reference</h1>" in guide.get("/guide/reference").text
    )


def test_links_are_rewritten_to_guide_urls(guide: TestClient) -> None:
    text = guide.get("/guide/guides/methods").text
    hrefs = re.findall(r'href="([^"]+)"', text.split('<article class="guide-page"', 1)[1])
    assert hrefs == [
        "/guide/reference/config#hyper",
        "/guide",
        "#the-plan-command",
        "https://example.org/page.md",
    ]
    # a link out of the manual (a source file) is shown as text, naming the file
    assert (
        '<span class="outside" title="in the repository: server/settings.py">the settings module</span>'
        in text
    )
    assert '<img alt="the job page" src="/guide/images/job.png">' in text
    # the index's link out of docs/ is not a page of the list
    assert "README" not in guide.get("/guide").text.split('<nav class="guide-nav"', 1)[1].split("</nav>")[0]
    # a link written as on GitHub (with .md) is sent to its page
    r = guide.get("/guide/guides/methods.md", follow_redirects=False)
    assert r.status_code == 308 and r.headers["location"] == "/guide/guides/methods"


def test_images_are_served(guide: TestClient) -> None:
    r = guide.get("/guide/images/job.png")
    assert r.status_code == 200 and r.content == PNG
    assert r.headers["content-type"] == "image/png"
    assert r.headers["content-security-policy"] == "default-src 'none'"
    # only pages and images: another file of the folder is not served
    assert guide.get("/guide/notes.txt").status_code == 404


@dataclass
class Answer:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def raw_get(client: TestClient, raw_path: bytes) -> Answer:
    """A GET of ``raw_path`` exactly as sent, handed to the app as uvicorn hands it (``path``
    percent-decoded): an HTTP client would resolve a literal ``..`` before sending."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(raw_path.decode("ascii")),
        "raw_path": raw_path,
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"authorization", client.headers["Authorization"].encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    run_coroutine(client.app(scope, receive, send))  # type: ignore[arg-type]
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Answer(start["status"], body.decode("utf-8", "replace"))


@pytest.mark.parametrize(
    "raw_path",
    [
        b"/guide/../secret",
        b"/guide/guides/../../secret",
        b"/guide/%2e%2e/secret",
        b"/guide/%2E%2E/secret.md",
        b"/guide/..%2fsecret",
        b"/guide/images/%2e%2e/%2e%2e/secret.md",
        b"/guide//etc/passwd",
        b"/guide/%2Fetc%2Fpasswd",
        b"/guide/..%5csecret",
        b"/guide/./index",
    ],
)
def test_traversal_is_refused(guide: TestClient, raw_path: bytes) -> None:
    r = raw_get(guide, raw_path)
    assert r.status == 400, (raw_path, r.status, r.text[:200])
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "path", error
    assert SECRET not in r.text


def test_the_literal_dots_reach_the_route(guide: TestClient) -> None:
    """The traversal cases above test the route, not the client: the raw path arrives as sent."""
    assert guide.get("/guide/../secret").status_code == 404  # the client made it /secret: no route
    assert raw_get(guide, b"/guide/guides/methods").status == 200
    assert raw_get(guide, b"/guide/guides/%6Dethods").status == 200  # decoded as uvicorn does


def test_a_missing_page_is_a_404_in_json_or_html(guide: TestClient) -> None:
    r = guide.get("/guide/guides/nope")
    assert r.status_code == 404
    assert r.json() == {
        "error": {"code": "not_found", "message": "no guide page 'guides/nope'", "param": "path"}
    }
    page = guide.get("/guide/<script>x", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert '<p id="not-found">no guide page &#x27;&lt;script&gt;x&#x27;' in page.text
    assert "<script>" not in page.text and '<nav class="guide-nav"' in page.text


def test_the_guide_is_behind_the_key_like_the_api_docs(guide: TestClient) -> None:
    anonymous = TestClient(guide.app)
    for path in ("/guide", "/guide/guides/methods", "/guide/images/job.png", "/docs"):
        r = anonymous.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", path


def test_a_slug_is_githubs() -> None:
    assert github_slug("The `plan` command: a test") == "the-plan-command-a-test"
    assert github_slug("tracking.mlflow") == "trackingmlflow"
    assert github_slug("roundhouse login-url") == "roundhouse-login-url"
    assert rewritten("../images/a.png", "guides/x.md") == "/guide/images/a.png"
    assert rewritten("../../README.md", "guides/x.md") is None


# -- the real manual ---------------------------------------------------------------------------


@pytest.fixture
def manual(tmp_path: Path) -> Iterator[TestClient]:
    """The app of a checkout: web/ of the source tree, docs/ beside it."""
    yield from client_for(Settings(home=tmp_path / "home", hub_offline=True))


def test_every_page_of_docs_renders_with_its_links_rewritten(manual: TestClient) -> None:
    folder = ROOT / "docs"
    pages = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.md"))
    assert "index.md" in pages and "reference/config.md" in pages, pages
    for name in pages:
        url = "/guide" if name == "index.md" else "/guide/" + name.removesuffix(".md")
        r = manual.get(url)
        assert r.status_code == 200, (name, r.status_code)
        article = r.text.split('<article class="guide-page"', 1)[1]
        for href in re.findall(r'href="([^"]+)"', article):
            assert href.startswith(("/guide", "/docs", "#", "http://", "https://")), (name, href)
            assert not href.split("#")[0].endswith(".md") or href.startswith("http"), (name, href)
        for src in re.findall(r'<img[^>]* src="([^"]+)"', article):
            assert manual.get(src).status_code == 200, (name, src)
    shot = manual.get("/guide/images/job-page.png")
    assert shot.status_code == 200 and shot.content.startswith(b"\x89PNG")


def test_the_image_has_docs_beside_its_web_folder() -> None:
    """docs/ is found beside the web UI's folder: the checkout's, and the image's (the Dockerfile
    copies both, and points ROUNDHOUSE_WEB_DIR at the web one)."""
    assert Guide(docs_folder(ROOT / "web")).folder == (ROOT / "docs").resolve()
    text = (ROOT / "Dockerfile").read_text()
    web_dir = re.search(r"ROUNDHOUSE_WEB_DIR=(\S+)", text)
    assert web_dir is not None
    copies = [
        shlex.split(line)[1:]
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from" not in line
    ]
    assert ["web", web_dir.group(1)] in copies
    assert ["docs", str(Path(web_dir.group(1)).parent / "docs")] in copies, copies
