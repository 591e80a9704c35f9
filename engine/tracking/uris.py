"""Tracking URIs: the ones an MLflow run may log to, the path a ``file:`` one names, and URLs made
safe to show in a message.

The engine's rule (``problem``): ``http(s)://`` to a host, or a ``file:`` path (relative, or
absolute without ``..``); never userinfo, a query string or a fragment, since credentials come from
the settings or MLflow's environment variables, never from a run's config. The service adds its
own rule on top (a ``file:`` path inside its home: ``server.services.tracking``). No message here
repeats the URI: it may carry the very secret it is refused for.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import PurePosixPath
from urllib.parse import SplitResult, unquote, urlsplit

__all__ = ["file_path", "problem", "redact_url", "redact_urls"]

SCHEMES = ("http", "https", "file")
FILE_HOSTS = ("", "localhost")  # MLflow ignores a file: URI's host: any other would mislead
# a URL with a scheme, or a path with a query or fragment (requests: "with url: /api/...?a=b")
_URLS = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+|(?<![\w/])/[^\s'\"<>?#]*[?#][^\s'\"<>]*")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def _clean(text: str) -> bool:
    return all(c.isprintable() and not c.isspace() for c in text)


def _port_ok(parts: SplitResult) -> bool:
    try:
        return parts.port is not None or not parts.netloc.endswith(":")
    except ValueError:  # not a number, or out of range
        return False


def _host_problem(netloc: str, hostname: str | None) -> str | None:
    if not hostname:
        return "must name a host after http:// or https://"
    if netloc.startswith("["):
        try:
            ipaddress.IPv6Address(hostname)
        except ValueError:
            return "has a host in brackets that is not an IPv6 address"
    elif not all(c.isalnum() or c in "-._" for c in hostname):
        return "has a host with characters a host name cannot have"
    return None


def problem(uri: str) -> str | None:
    """What is wrong with ``uri`` as an MLflow tracking URI by the engine's rule (None: nothing).

    Allowed: ``http://host[:port][/path]``, ``https://...``, ``file:/abs/path`` (or ``file:///``,
    ``file://localhost/``) without ``..`` segments, and ``file:relative/path``. Refused: any other
    scheme, userinfo (``user:pass@``), a query string or fragment, spaces and control characters.
    The answer never repeats the URI.
    """
    if not _clean(uri):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "is not a URL: give http://host:port, https://host or a file: path"
    if parts.scheme not in SCHEMES:
        return "must be http://host, https://host or a file: path"
    if "?" in uri or "#" in uri:
        return (
            "must not have a query string or fragment: credentials come from the settings, never the config"
        )
    if "@" in parts.netloc:
        return "must not carry credentials (user:password@): they come from the settings, never the config"
    if parts.scheme != "file":
        if not _port_ok(parts):
            return "has a port that is not a number from 0 to 65535"
        return _host_problem(parts.netloc, parts.hostname)
    if parts.netloc not in FILE_HOSTS:
        return "a file: URI names a path on this machine (file:/path or file:///path), not a host"
    path = unquote(parts.path)
    if not path:
        return "must name a folder after file:"
    if not _clean(path):
        return "names a path with spaces or control characters"
    if path.startswith("/") and ".." in PurePosixPath(path).parts:
        return "an absolute file: path must not contain '..'"
    return None


def file_path(uri: str) -> str | None:
    """The path a ``file:`` URI names, percent-decoded as MLflow reads it (relative or absolute);
    None for another scheme. Use on URIs ``problem`` accepted."""
    parts = urlsplit(uri)
    return unquote(parts.path) if parts.scheme == "file" else None


def redact_url(url: str) -> str:
    """``url`` as a message may show it: its userinfo, query string and fragment replaced by
    ``***`` (``https://***@host/path?***``)."""
    shown = _USERINFO.sub(r"\1***@", url)
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else f"{shown[: cut + 1]}***"


def redact_urls(text: str) -> str:
    """``text`` (e.g. a tracker's exception) with each URL in it redacted (``redact_url``)."""
    return _URLS.sub(lambda m: redact_url(m.group(0)), text)
