"""A real ``mlflow server`` on a local port, from its own venv (``make mlflow-server``; built here
when missing: the full mlflow package's pins conflict with the service's). It can be stopped and
started again on the same port and database, as an outage."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = ROOT / ".venv-mlflow" / "bin" / "mlflow"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """One server: its database and artifacts in ``folder``, on ``port``."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        if not MLFLOW.exists():
            subprocess.run(["make", "-C", str(ROOT), "mlflow-server"], check=True, timeout=900)
        self.folder, self.port = folder, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Launch it (returns at once; ``wait`` for it to answer)."""
        command = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        command += ["--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db"]
        command += ["--artifacts-destination", str(self.folder / "art")]
        # no job runner: its consumer processes only slow the start down
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.starts += 1
        with open(self.folder / f"server-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def up(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.up():
                return
            if self.proc is None or self.proc.poll() is not None:
                break
            time.sleep(0.25)
        raise AssertionError(f"mlflow server did not answer:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return (self.folder / f"server-{self.starts}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop it and its workers; the port refuses connections when this returns."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the rest of its session (the uvicorn worker)
        deadline = time.monotonic() + 10
        while answers(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)


def answers(port: int) -> bool:
    """Whether something accepts connections on ``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
