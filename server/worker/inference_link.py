"""The worker's side of its inference service: start it, and tell it when a job takes the devices.

``start`` runs ``python -m server.worker.inference`` as a child of the worker's main process (a
fresh interpreter: the worker never imports torch), with a random token on its stdin; the
worker's housekeeping records the service's URL and token in its ``workers`` row, where the API
and the supervisor find them (``server.services.inference``). ``training`` posts a job's start or
end to it; it never raises, and a silent service cannot hold a job back longer than its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass

import httpx

from server.services.inference import Service
from server.settings import Settings
from server.worker.children import die_with_parent

log = logging.getLogger("roundhouse.worker")


@dataclass(frozen=True)
class Link:
    url: str
    token: str


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(settings: Settings) -> tuple[subprocess.Popen[bytes], Link]:
    """Start the service; returns the process and how to reach it (it answers once it has started)."""
    host = settings.inference_host
    port = settings.inference_port or _free_port(host)
    token = secrets.token_urlsafe(24)
    env = {**os.environ, **settings.child_environment()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.worker.inference", "--host", host, "--port", str(port)],
        stdin=subprocess.PIPE,
        env=env,
        preexec_fn=die_with_parent,
    )
    if proc.stdin is not None:
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.close()
    advertised = settings.inference_advertise or ("127.0.0.1" if host in ("0.0.0.0", "::") else host)
    return proc, Link(f"http://{advertised}:{port}", token)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def training(link: Link | Service | None, *, training: bool, timeout: float) -> None:
    """Tell the service a job starts (it unloads what is in the way first) or ended."""
    if link is None:
        return
    try:
        r = httpx.post(
            f"{link.url}/training",
            json={"training": training},
            headers={"Authorization": f"Bearer {link.token}"},
            timeout=timeout,
        )
        if r.status_code == 200:
            unloaded = r.json().get("unloaded") or []
            if unloaded:
                log.info("inference unloaded %s for a job", ", ".join(unloaded))
            return
        log.warning("the inference service answered %s to /training: %s", r.status_code, r.text[:200])
    except httpx.HTTPError as exc:  # not up yet, or gone: nothing of it holds the devices then
        with contextlib.suppress(Exception):
            log.warning("the inference service did not answer /training: %s", exc)
