"""The manual in ``docs/`` as HTML pages: what the service's ``/guide`` serves.

``/guide`` is ``docs/index.md`` and ``/guide/<path>`` is ``docs/<path>.md`` (a folder's
``index.md`` answers for the folder), rendered with Python-Markdown (tables, fenced code, heading
anchors as GitHub makes them). The pages link to each other with relative ``.md`` links, as they
read on GitHub; here each becomes its ``/guide`` URL, an image's relative source its
``/guide/<path>`` file, and a link that leaves ``docs/`` (to a source file of the repository)
plain text, since the service has no such page. Every page carries a list of the manual's pages,
in ``docs/index.md``'s order.

The folder is found beside the web UI's (``docs/`` next to ``web/``: the source tree, or
``/opt/roundhouse/`` in the image). A path is a page's name, never a file system path: a part
that is empty, ``.`` or ``..``, a backslash or a NUL is refused before any file is looked at.
"""

from __future__ import annotations

import html
import posixpath
import re
import xml.etree.ElementTree as etree
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import markdown
from markdown.extensions import Extension
from markdown.extensions.toc import TocExtension
from markdown.treeprocessors import Treeprocessor

PREFIX = "/guide"
SUFFIX = ".md"
# the other files a page may show or link to, and how they are served
FILE_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".svg": "image/svg+xml",
}
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


class BadPath(ValueError):
    """A guide path that names no page (traversal, an absolute path, an empty part)."""


def docs_folder(web_dir: Path) -> Path:
    """The manual's folder: ``docs/`` beside the web UI's folder."""
    return web_dir.resolve().parent / "docs"


def checked(path: str) -> str:
    """``path`` as a page name: parts joined by ``/``, one trailing ``/`` dropped.

    Raises:
        BadPath: an absolute path, a part that is empty, ``.`` or ``..``, a backslash or a NUL.
    """
    name = path[:-1] if path.endswith("/") else path
    if not name:
        return ""
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise BadPath(f"{path!r}: a guide path is relative, with no backslash")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise BadPath(f"{path!r}: a guide path has no empty, '.' or '..' part")
    return name


def github_slug(text: str, separator: str = "-") -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", separator)


def page_url(name: str) -> str:
    """The ``/guide`` URL of a page of the folder (``guides/methods.md`` -> ``/guide/guides/methods``)."""
    stem = name.removesuffix(SUFFIX)
    if stem == "index":
        return PREFIX
    return f"{PREFIX}/{stem.removesuffix('/index')}" if stem.endswith("/index") else f"{PREFIX}/{stem}"


def rewritten(url: str, page: str) -> str | None:
    """A link's or image's ``url`` as the service serves it, for the page ``page`` (its name in
    the folder, ``guides/methods.md``); None for a relative link out of the folder."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith(("/", "#")) or not parts.path:
        return url
    target = posixpath.normpath(posixpath.join(posixpath.dirname(page), unquote(parts.path)))
    if target == ".." or target.startswith("../"):
        return None
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    if target.endswith(SUFFIX):
        return page_url(target) + fragment
    return f"{PREFIX}/{target}{fragment}"


class _Links(Treeprocessor):
    """Rewrites the ``href`` of links and the ``src`` of images (``rewritten``)."""

    def __init__(self, md: markdown.Markdown, page: str) -> None:
        super().__init__(md)
        self.page = page

    def run(self, root: etree.Element) -> None:
        for element in root.iter():
            attribute = {"a": "href", "img": "src"}.get(element.tag)
            value = element.get(attribute) if attribute else None
            if attribute is None or value is None:
                continue
            url = rewritten(value, self.page)
            if url is not None:
                element.set(attribute, url)
                continue
            # a file of the repository, not of the manual: its text (an image's alt) and its path
            where = posixpath.normpath(posixpath.join("docs", posixpath.dirname(self.page), value))
            if element.tag == "img":
                element.text = element.get("alt", "")
            element.tag = "span"
            element.attrib.clear()
            element.set("class", "outside")
            element.set("title", f"in the repository: {where}")


class _LinkExtension(Extension):
    def __init__(self, page: str) -> None:
        super().__init__()
        self.page = page

    def extendMarkdown(self, md: markdown.Markdown) -> None:
        md.treeprocessors.register(_Links(md, self.page), "guide_links", 1)


@dataclass(frozen=True)
class Rendered:
    """One page: its title (its first heading) and its body as HTML."""

    title: str
    body: str


def render(text: str, page: str) -> Rendered:
    """The Markdown ``text`` of the page ``page`` (its name in the folder) as HTML."""
    md = markdown.Markdown(
        extensions=["tables", "fenced_code", TocExtension(slugify=github_slug), _LinkExtension(page)],
        output_format="html",
    )
    body = md.convert(text)
    title = next((m.group(2) for line in text.splitlines() if (m := HEADING.match(line))), page)
    return Rendered(title=title.replace("`", ""), body=body)


@dataclass(frozen=True)
class NavItem:
    """One entry of the pages' list: under ``section`` (a heading of the index, or "")."""

    section: str
    title: str
    url: str


class Guide:
    """The manual of one folder: its pages, files and list of pages."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()

    def _inside(self, name: str) -> Path | None:
        path = (self.folder / name).resolve()
        return path if path.is_relative_to(self.folder) else None

    def page(self, path: str) -> tuple[str, Path] | None:
        """The page ``path`` names: its name in the folder and its file (None: no such page).

        Raises:
            BadPath: see ``checked``.
        """
        name = checked(path)
        candidates = [f"{name}{SUFFIX}", f"{name}/index{SUFFIX}"] if name else [f"index{SUFFIX}"]
        for candidate in candidates:
            file = self._inside(candidate)
            if file is not None and file.is_file():
                return candidate, file
        return None

    def file(self, path: str) -> tuple[Path, str] | None:
        """The image or other file ``path`` names and its media type (None: none, or a kind not
        served).

        Raises:
            BadPath: see ``checked``.
        """
        name = checked(path)
        media = FILE_TYPES.get(posixpath.splitext(name)[1].lower())
        file = self._inside(name) if media and name else None
        return (file, media) if file is not None and media and file.is_file() else None

    def nav(self) -> list[NavItem]:
        """The pages in ``index.md``'s order: each ``.md`` link under its heading; every page of
        the folder, by path, when there is no index."""
        index = self.folder / f"index{SUFFIX}"
        if not index.is_file():
            return [
                NavItem(
                    "", p.relative_to(self.folder).as_posix(), page_url(p.relative_to(self.folder).as_posix())
                )
                for p in sorted(self.folder.rglob(f"*{SUFFIX}"))
            ]
        items = [NavItem("", "Contents", PREFIX)]
        section = ""
        for line in index.read_text(encoding="utf-8").splitlines():
            heading = HEADING.match(line)
            if heading and len(heading.group(1)) > 1:
                section = heading.group(2).replace("`", "")
                continue
            for text, url in LINK.findall(line):
                target = rewritten(url, f"index{SUFFIX}")
                if target and target.startswith(PREFIX) and urlsplit(url).path.endswith(SUFFIX):
                    items.append(NavItem(section, text.replace("`", "").replace("*", ""), target))
        return items


def document(guide: Guide, *, title: str, body: str, current: str | None) -> str:
    """A whole HTML page: the app's header, the list of pages, and ``body``."""
    groups: dict[str, list[NavItem]] = {}
    for item in guide.nav():
        groups.setdefault(item.section, []).append(item)
    nav = []
    for section, items in groups.items():
        if section:
            nav.append(f"<h2>{html.escape(section)}</h2>")
        nav.append("<ul>")
        for item in items:
            here = ' aria-current="page"' if item.url == current else ""
            nav.append(f'<li><a href="{html.escape(item.url)}"{here}>{html.escape(item.title)}</a></li>')
        nav.append("</ul>")
    return f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>{html.escape(title)} · Roundhouse guide</title>
  <link rel="icon" href="data:,">
  <link rel="stylesheet" href="/static/css/app.css">
  <link rel="stylesheet" href="/static/css/guide.css">
</head>
<body class="guide">
  <header class="top">
    <a class="brand" href="/">Roundhouse</a>
    <nav aria-label="Main">
      <a href="/#/jobs">Jobs</a>
      <a href="{PREFIX}" aria-current="page">Guide</a>
      <a href="/docs">API docs</a>
    </nav>
  </header>
  <div class="guide-layout">
    <nav class="guide-nav" aria-label="Guide pages">
{chr(10).join("      " + line for line in nav)}
    </nav>
    <article class="guide-page" id="guide-page">
{body}
    </article>
  </div>
</body>
</html>
"""
