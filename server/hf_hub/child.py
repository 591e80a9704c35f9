"""Running the Hub client (``client``) in a child process, from the API or a worker.

The child's environment is built from the settings alone: the Hub's address, offline mode off (a
pull refused by ``ROUNDHOUSE_HUB_OFFLINE`` never gets this far), no token from the environment
or a saved login (the token, when set, goes on stdin). Its errors come back as ``HubError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from server.settings import Settings

# the environment variables of the Hub client a parent must not pass on: they would override the
# settings (a token, another endpoint, offline mode, a different cache)
_HUB_VARIABLES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "HF_HUB_DISABLE_XET",
)


@dataclass
class HubError(Exception):
    """The Hub refused or failed: ``kind`` (gated, repo_not_found, revision_not_found, forbidden,
    unreachable, offline, ...), the Hub's HTTP status, and its message."""

    kind: str
    message: str
    status: int | None = None

    def __str__(self) -> str:
        return self.message


class Cancelled(Exception):
    """The child was stopped because its transfer was cancelled."""


def environment(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _HUB_VARIABLES}
    env.update(
        HF_ENDPOINT=settings.hub_endpoint.rstrip("/"),
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        HF_HOME=str(settings.cache_dir / "hf-home"),
        PYTHONUNBUFFERED="1",
    )
    if not settings.hub_xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    return env


def run(
    settings: Settings,
    command: str,
    *,
    on_progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Run one client command to its result.

    Args:
        on_progress: called with the bytes done each time the child reports them.
        on_total: called with the bytes to move, when the child knows them (a push).
        cancelled: polled while the child runs; when it says so the child is stopped.

    Raises:
        HubError: the Hub's refusal or failure, as the child reported it.
        Cancelled: ``cancelled`` said so.
    """
    if settings.hub_offline:
        raise HubError(
            "offline", "the Hub is off here (ROUNDHOUSE_HUB_OFFLINE=1): nothing was fetched or sent"
        )
    request = {"command": command, "endpoint": settings.hub_endpoint.rstrip("/"), **fields}
    if settings.hub_token is not None:
        request["token"] = settings.hub_token.get_secret_value()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.hf_hub.client"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=environment(settings),
        text=True,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.close()
    stop = threading.Event()
    if cancelled is not None:
        threading.Thread(target=_cancel_watch, args=(proc, cancelled, stop), daemon=True).start()
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    try:
        for event in _events(proc.stdout):
            if event.get("event") == "progress" and on_progress is not None:
                on_progress(int(event["done"]))
            elif event.get("event") == "total" and on_total is not None:
                on_total(int(event["total"]))
            elif event.get("event") == "result":
                result = event
            elif event.get("event") == "error":
                error = event
        proc.wait()
    finally:
        stop.set()
        if proc.poll() is None:
            _kill(proc)
    if cancelled is not None and cancelled() and result is None:
        raise Cancelled()
    if error is not None:
        raise HubError(str(error.get("kind")), str(error.get("message")), error.get("status"))
    if result is None:
        raise HubError("failed", f"the Hub client ended without an answer (exit status {proc.returncode})")
    result.pop("event", None)
    return result


def _events(stream: Any) -> Iterator[dict[str, Any]]:
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _cancel_watch(proc: subprocess.Popen[str], cancelled: Callable[[], bool], stop: threading.Event) -> None:
    while not stop.wait(0.3):
        try:
            if cancelled():
                _kill(proc)
                return
        except Exception:  # the database is away for a moment: ask again at the next tick
            continue
