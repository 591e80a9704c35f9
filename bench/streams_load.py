"""Event streams under load: ``GET /api/datasets`` with 0 and 200 idle event streams open, and how
long SIGTERM takes to stop the server while they are open.

Everything runs as real processes on loopback, on a fresh data folder per database:
``roundhouse serve`` (uvicorn, one process), the folder broker, the tiny test model as base model
``tiny``, and no worker, so the jobs stay queued and their streams stay open and idle. The
database is SQLite (the default) and, when one answers on 127.0.0.1:5432, a fresh PostgreSQL
database (the connection pool is the same: 5 + 10 connections).

For each database, one after the other on the same server:

- ``baseline``: no stream open; a probe sends ``GET /api/datasets`` on ``PROBE_CONNECTIONS``
  keep-alive connections, each one request every ``PERIOD_S`` (paced, so the figure is service
  time plus contention, not a queue), for ``PHASE_S`` seconds;
- ``streams``: ``--streams`` event streams are opened at once (three in four on a job,
  ``GET /api/jobs/{id}/stream``, spread over ``JOBS`` queued jobs; one in four on
  ``GET /api/gpus/stream``), each until its first bytes arrive; then ``IDLE_S`` seconds with only
  the streams open (the server's CPU then is what waiting streams cost), then the same probe;
- ``shutdown``: SIGTERM with the streams still open: seconds until the server exits, its exit
  code, and how many streams the server ended (it is killed after ``GRACE_S``).

A request not answered within ``REQUEST_TIMEOUT_S`` counts as unanswered and enters the
percentiles as that timeout (a lower bound). Streams and probe speak HTTP/1.1 on asyncio streams
(a full async client would take CPU the server needs). Target: p99 of ``GET /api/datasets``
below 100 ms with 200 streams open, no error. Figures go to ``bench/results/streams_load.json``.

    python bench/streams_load.py [--streams 200] [--database sqlite|postgresql|both]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
# run as ``python bench/streams_load.py``: the checkout's root, where ``tests`` is, is not on the path
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.utils import Process, answers, child_env, free_port, postgres_database, roundhouse  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POSTGRES_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
JOBS = 8
PROBE_CONNECTIONS = 4
PERIOD_S = 0.2  # per connection: 20 requests/s in all
PHASE_S = 15.0
IDLE_S = 5.0
OPEN_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 10.0
GRACE_S = 15.0
P99_TARGET_MS = 100.0
ROWS = [{"text": f"line {i} of a small corpus"} for i in range(16)]


def stats(latencies_s: list[float]) -> dict[str, Any]:
    """Count and nearest-rank percentiles in milliseconds."""
    values = sorted(x * 1000 for x in latencies_s)
    if not values:
        return {"count": 0}

    def pct(p: float) -> float:
        return values[max(0, math.ceil(p / 100 * len(values)) - 1)]

    return {
        "count": len(values),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": values[-1],
    }


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def read_head(reader: asyncio.StreamReader) -> tuple[int, int | None]:
    """The status and Content-Length (None: chunked or absent) of a response."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return int(lines[0].split(" ", 2)[1]), length


class Stream:
    """One open event stream: its status, when its first bytes came, and whether the server ended it."""

    def __init__(self, port: int, key: str, path: str) -> None:
        self.port, self.key, self.path = port, key, path
        self.status = 0
        self.opened_s: float | None = None
        self.ended = asyncio.Event()
        self.bytes = 0
        self.task: asyncio.Task[None] | None = None

    async def open(self, t0: float) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            self.ended.set()
            return
        head = f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.key}\r\n\r\n"
        writer.write(head.encode())
        try:
            self.status, _ = await read_head(reader)
            self.bytes += len(await reader.read(4096))
            self.opened_s = time.perf_counter() - t0
            self.task = asyncio.create_task(self._drain(reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            writer.close()
            self.ended.set()
            raise

    async def _drain(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                self.bytes += len(chunk)
        except OSError:
            pass
        finally:
            self.ended.set()
            writer.close()


async def probe(port: int, key: str, *, seconds: float) -> dict[str, Any]:
    """``GET /api/datasets`` on ``PROBE_CONNECTIONS`` connections, one request per ``PERIOD_S`` each."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    unanswered = 0
    request = f"GET /api/datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n".encode()

    async def connection(index: int) -> None:
        nonlocal unanswered
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.perf_counter() + index * PERIOD_S / PROBE_CONNECTIONS
        try:
            for n in range(int(seconds / PERIOD_S)):
                await asyncio.sleep(max(0.0, start + n * PERIOD_S - time.perf_counter()))
                t = time.perf_counter()
                writer.write(request)
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        status, length = await read_head(reader)
                        await reader.readexactly(length or 0)
                except TimeoutError:
                    unanswered += 1
                    latencies.append(REQUEST_TIMEOUT_S)
                    return  # the connection is stuck behind this request: stop using it
                latencies.append(time.perf_counter() - t)
                if status != 200:
                    errors[str(status)] = errors.get(str(status), 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(connection(i) for i in range(PROBE_CONNECTIONS)))
    return stats(latencies) | {"errors": errors, "unanswered": unanswered}


async def streams_phase(server: Process, port: int, key: str, jobs: list[str], n: int) -> dict[str, Any]:
    assert server.proc is not None
    paths = [
        "/api/gpus/stream" if i % 4 == 3 else f"/api/jobs/{jobs[i % len(jobs)]}/stream" for i in range(n)
    ]
    streams = [Stream(port, key, p) for p in paths]
    t0 = time.perf_counter()
    opening = [asyncio.create_task(s.open(t0)) for s in streams]
    _, late = await asyncio.wait(opening, timeout=OPEN_TIMEOUT_S)
    for task in late:
        task.cancel()
    opened = [s.opened_s for s in streams if s.opened_s is not None and s.status == 200]
    out: dict[str, Any] = {
        "streams": n,
        "job_streams": sum("/jobs/" in p for p in paths),
        "gpu_streams": sum(p.endswith("/gpus/stream") for p in paths),
        "opened": len(opened),
        "not_open_within_s": {"seconds": OPEN_TIMEOUT_S, "count": n - len(opened)},
        "open_statuses": sorted({s.status for s in streams}),
        "open_s": stats(opened),
    }
    before = cpu_s(server.proc.pid)
    await asyncio.sleep(IDLE_S)
    out["server_cores_while_idle"] = (cpu_s(server.proc.pid) - before) / IDLE_S
    before, t = cpu_s(server.proc.pid), time.perf_counter()
    out["datasets"] = await probe(port, key, seconds=PHASE_S)
    out["server_cores_during_probe"] = (cpu_s(server.proc.pid) - before) / (time.perf_counter() - t)
    out["still_open"] = sum(not s.ended.is_set() for s in streams)
    # SIGTERM with the streams open: how long until the server exits
    t = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    code = None
    while time.perf_counter() - t < GRACE_S:
        code = server.proc.poll()
        if code is not None:
            break
        await asyncio.sleep(0.05)
    exit_s = time.perf_counter() - t if code is not None else None
    await asyncio.sleep(0.2)
    out["shutdown"] = {
        "sigterm_to_exit_s": exit_s,
        "exit_code": code,
        "killed_after_s": None if code is not None else GRACE_S,
        "streams_ended_by_server": sum(s.ended.is_set() for s in streams if s.opened_s is not None),
    }
    for s in streams:
        if s.task is not None:
            s.task.cancel()
    return out


@contextlib.contextmanager
def database(kind: str, folder: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'roundhouse.db'}"
        return
    with postgres_database(POSTGRES_ADMIN, prefix="roundhouse_bench") as url:
        yield url


def run(kind: str, folder: Path, n: int) -> dict[str, Any]:
    from tests.engine.tiny import tiny_model_folder  # imports torch: not needed for --help

    home = folder / kind
    tiny_model_folder(home / "models" / "tiny")
    (home / "hf-cache").mkdir(parents=True)
    with database(kind, folder) as url:
        env = child_env(
            ROUNDHOUSE_HOME=str(home), ROUNDHOUSE_HF_CACHE=str(home / "hf-cache"), ROUNDHOUSE_DATABASE_URL=url
        )
        made = subprocess.run(
            roundhouse("keys", "create", "--name", "bench"), env=env, cwd=ROOT, capture_output=True, text=True
        )
        made.check_returncode()
        key = made.stdout.strip().splitlines()[0]
        port = free_port()
        server = Process(roundhouse("serve", "--port", str(port)), env=env, log=home / "server.log").start()
        try:
            server.wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=120)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as http:
                content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
                ds = http.post("/api/datasets", files={"file": ("rows.jsonl", content)}).json()["id"]
                body = {"base_model": "tiny", "dataset_id": ds, "hyper": {"max_steps": 2, "batch_size": 4}}
                jobs = [http.post("/api/jobs", json=body).json()["id"] for _ in range(JOBS)]
            out: dict[str, Any] = {"baseline": asyncio.run(probe(port, key, seconds=PHASE_S))}
            out["streams"] = asyncio.run(streams_phase(server, port, key, jobs, n))
        finally:
            stopped = server.stop(grace=5)
            server.kill_group()
        out["server_log_errors"] = [
            line[:200] for line in server.log.read_text(errors="replace").splitlines() if "Error" in line
        ][:20]
        out["stopped_before_kill"] = stopped
    return out


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("fastapi", "starlette", "uvicorn", "sqlalchemy", "psycopg", "anyio", "httpx"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def summary(result: dict[str, Any]) -> str:
    def line(label: str, s: dict[str, Any]) -> str:
        return (
            f"  {label:24s} n={s['count']:4d}  p50 {s['p50_ms']:8.1f}  p99 {s['p99_ms']:8.1f}  "
            f"max {s['max_ms']:8.1f} ms  errors {sum(s['errors'].values())}  unanswered {s['unanswered']}"
        )

    out = []
    for kind, r in result["databases"].items():
        s = r["streams"]
        sd = s["shutdown"]
        out += [
            f"{kind}:",
            line("datasets, no stream", r["baseline"]),
            line(f"datasets, {s['opened']} streams", s["datasets"]),
            f"  streams opened {s['opened']}/{s['streams']}"
            f" (p99 {s['open_s'].get('p99_ms', math.nan):.0f} ms);"
            f" server cores idle with them {s['server_cores_while_idle']:.3f}",
            f"  SIGTERM with {s['still_open']} streams open: "
            + (
                f"exit {sd['exit_code']} after {sd['sigterm_to_exit_s']:.2f} s"
                if sd["exit_code"] is not None
                else f"still running after {GRACE_S:g} s (killed)"
            )
            + f", {sd['streams_ended_by_server']} streams ended by the server",
        ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--streams", type=int, default=200, help="event streams held open (default 200)")
    parser.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    kinds = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    if "postgresql" in kinds and not answers("127.0.0.1", 5432):
        print("no PostgreSQL on 127.0.0.1:5432: SQLite only", file=sys.stderr)
        kinds.remove("postgresql")
    load_before = os.getloadavg()
    folder = Path(tempfile.mkdtemp(prefix="roundhouse-streams-load-"))
    try:
        results = {kind: run(kind, folder, args.streams) for kind in kinds}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    met = {
        kind: r["streams"]["opened"] == args.streams
        and r["streams"]["datasets"]["p99_ms"] < P99_TARGET_MS
        and not r["streams"]["datasets"]["errors"]
        and r["streams"]["datasets"]["unanswered"] == 0
        for kind, r in results.items()
    }
    result = {
        "benchmark": "streams_load",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": f"GET /api/datasets p99 < {P99_TARGET_MS:g} ms with {args.streams} streams open, no error",
        "met": met,
        "setup": {
            "server": "roundhouse serve: uvicorn, one process, loopback",
            "broker": "filesystem (no server); no worker: the jobs stay queued",
            "jobs": JOBS,
            "probe": {"connections": PROBE_CONNECTIONS, "period_s": PERIOD_S, "seconds": PHASE_S},
            "idle_s": IDLE_S,
            "open_timeout_s": OPEN_TIMEOUT_S,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "sigterm_grace_s": GRACE_S,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "memory_gb": psutil.virtual_memory().total / 2**30,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_before": load_before,
        },
        "versions": versions(),
        "databases": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "streams_load.json").write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))


if __name__ == "__main__":
    main()
