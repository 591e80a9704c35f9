"""Real processes for the service tests, the browser tests and the benchmarks: a free port, the
environment a child gets, the ``roundhouse`` command line, and a launcher that logs to a file,
waits for a line or a URL, and stops its whole process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
# what ``roundhouse serve`` prints: the one-time login link and, in it, its token (not a key)
LOGIN_LINE = r"Open: (http://\S+/login\?token=(rhl_\S+))"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def xdist_worker() -> int:
    """Which pytest-xdist worker runs this process (``gw3``: 3); 0 when the tests run in one process.
    Tests that share a server outside the test (a Redis database) keep apart by it."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def answers(host: str, port: int) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (within half a second)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def child_env(**variables: str) -> dict[str, str]:
    """This process's environment without any ``ROUNDHOUSE_*`` setting, offline, plus ``variables``:
    a child sees only the settings its caller gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDHOUSE_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(variables)
    return env


def roundhouse(*args: str) -> list[str]:
    """The ``roundhouse`` command line from this checkout, with this interpreter."""
    return [sys.executable, "-m", "server.cli", *args]


class Process:
    """A command run in its own process group, its output appended to a log file.

    ``start`` launches it; ``wait_for_line`` / ``wait_for_http`` wait until it is ready; ``stop``
    sends a signal and, past a grace period, SIGKILLs the whole group; ``kill_group`` ends whatever
    of the group outlived the main process."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: Path = ROOT) -> None:
        self.args, self.env, self.log, self.cwd = list(args), dict(env), log, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group, so stop() reaches its children
            )
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.args} was not started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        """The end of the log (empty before it exists)."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def descendants(self) -> list[psutil.Process]:
        """Its children and theirs (none once it has ended)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def wait_for_line(self, pattern: str, *, timeout: float) -> re.Match[str] | None:
        """The first match of ``pattern`` in the log; None if it exits or ``timeout`` s pass first."""
        deadline = time.monotonic() + timeout
        while True:
            alive = self.running()  # read before the log: a line written just before exiting counts
            found = re.search(pattern, self.log.read_text(errors="replace")) if self.log.exists() else None
            if found is not None or not alive or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def wait_for_http(self, url: str, *, timeout: float) -> None:
        """Poll ``url`` until it answers 200.

        Raises:
            RuntimeError: the process exited, or ``timeout`` s passed; with the log's tail.
        """
        deadline = time.monotonic() + timeout
        while self.running():
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout:g} s\n{self.tail()}")
            time.sleep(0.2)
        code = None if self.proc is None else self.proc.returncode
        raise RuntimeError(f"it exited with code {code} before {url} answered\n{self.tail()}")

    def stop(self, sig: signal.Signals = signal.SIGTERM, *, grace: float = 30.0) -> bool:
        """Send ``sig`` to the main process and wait up to ``grace`` s; past that, SIGKILL its group.

        Returns:
            True when it ended within the grace period (or had ended before), False when killed.
        """
        if self.proc is None or self.proc.poll() is not None:
            return True
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=grace)
            return True
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.proc.wait()
            return False

    def kill(self) -> None:
        """SIGKILL the main process alone, as a crash would: no shutdown; its children are left to
        notice that their parent is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def kill_group(self) -> None:
        """SIGKILL whatever is left of its process group (a child that outlived the main process)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
