"""API load: request latency with 50 concurrent clients while a job trains, and RSS during a 1 GB upload.

Everything runs as real processes on a fresh data folder each: ``roundhouse serve`` (uvicorn, one
process), ``roundhouse worker`` where a job trains, SQLite and the no-server folder broker (the
one-box defaults), the tiny test model as base model ``tiny``, and an empty Hugging Face cache
folder (so model discovery does not depend on what the machine has cached).

Two scenarios, measured one after the other in the same run, each on its own server:

- ``idle``: the server alone (no worker, nothing trains; created jobs stay queued);
- ``training``: a worker runs one long LoRA job on the CPU (two pipeline stages, a checkpoint
  every 1000 steps) that keeps training, and writing its metrics, during every measurement.

In each scenario, three measurements:

- ``sequential``: one connection, one request at a time: the service time of
  ``GET /api/health`` (no key, no database), ``GET /api/jobs/{id}`` (key check and one row),
  ``GET /api/jobs?limit=50`` and ``POST /api/jobs``, with the server's CPU time per request;
- ``concurrent`` (the target's condition): 50 clients at once, each on its own keep-alive
  connection, each sending its next request as soon as the previous one is answered,
  alternating listing (``GET /api/jobs?limit=50``) and creating (``POST /api/jobs``) a job;
- ``paced``: the same 50 clients, but each sends one request per second (staggered), an
  offered load below the server's capacity, so the latency is service time plus contention
  rather than a queue 50 requests deep.

A warm-up creates enough jobs first that every list returns a full page. Latency is timed in the
client from writing the request to the last byte of the response; list and create are kept apart
(count, p50, p90, p99, max, non-2xx and connection errors). The load clients speak HTTP/1.1 over
asyncio streams directly: the load generator shares the CPUs with the server, and a full-featured
async client costs a large share of the CPU the server needs at this request rate. The CPU used
during each run by the server, the worker and its training process, the load generator and
everything else on the machine is recorded alongside.

Upload: on the ``idle`` server, after a small warm-up upload, a generated JSONL file of chat
rows (1 GiB; smaller when the disk is short) is streamed from disk as ``multipart/form-data``
(httpx reads it in chunks). The RSS of the server process and its children is sampled every
50 ms; the growth is the peak during the upload (receiving, spooling, the row-by-row validation)
minus the RSS just before. The time after the last byte was sent is reported apart.

Targets: p99 < 50 ms for listing and creating with 50 concurrent clients while a job trains;
server RSS growth < 100 MB during a 1 GB upload. Figures go to ``bench/results/api_load.json``.

    python bench/api_load.py [--quick] [--requests 40] [--paced 20] [--upload-mb 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
# run as ``python bench/api_load.py``: the checkout's root, where ``tests`` is, is not on the path yet
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.utils import Process, child_env, free_port, roundhouse  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CLIENTS = 50
WARMUP_JOBS = CLIENTS + 10
PACE_S = 1.0
P99_TARGET_MS = 50.0
RSS_TARGET_MB = 100.0
SAMPLE_S = 0.05
MIN_FREE_BYTES = 5 * 2**30
MB = 2**20
SMALL_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 7}."},
            {"role": "assistant", "content": str(i % 7)},
        ]
    }
    for i in range(48)
]
TEXT = "the quick brown fox jumps over the lazy dog while five ducks count to seven"


def job_body(dataset_id: str, *, steps: int, every: int, name: str | None = None) -> dict[str, Any]:
    """A LoRA job on the tiny model that trains on the CPU in two pipeline stages."""
    return {
        "name": name,
        "base_model": "tiny",
        "dataset_id": dataset_id,
        "data": {"max_length": 64},
        "method": {"kind": "lora", "lora_r": 4},
        "hyper": {"max_steps": steps, "batch_size": 4, "learning_rate": 0.01, "optimizer": "sgd"},
        "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2, "compute_dtype": "float32"},
        "checkpoint": {"every_steps": every, "keep_last": 2},
    }


def stats(latencies_s: list[float]) -> dict[str, Any]:
    """Count, mean and nearest-rank percentiles in milliseconds."""
    values = sorted(x * 1000 for x in latencies_s)
    if not values:
        return {"count": 0}

    def pct(p: float) -> float:
        return values[max(0, math.ceil(p / 100 * len(values)) - 1)]

    return {
        "count": len(values),
        "mean_ms": sum(values) / len(values),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": values[-1],
    }


def tree(proc: psutil.Process | None) -> list[psutil.Process]:
    if proc is None:
        return []
    with contextlib.suppress(psutil.NoSuchProcess):
        return [proc, *proc.children(recursive=True)]
    return []


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and all its descendants, in bytes (processes that vanish count 0)."""
    total = 0
    for p in tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def tree_cpu_s(proc: psutil.Process | None) -> float:
    """CPU seconds (user + system) used so far by a process and its live descendants."""
    total = 0.0
    for p in tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class RssSampler:
    """Samples a process tree's RSS every ``SAMPLE_S`` in a thread; keeps the peak and when it was."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak = 0
        self.peak_at = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            rss = tree_rss(self.proc)
            self.samples += 1
            if rss > self.peak:
                self.peak, self.peak_at = rss, time.perf_counter() - start
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


class CpuMeter:
    """CPU cores used between ``start`` and ``stop`` by the server, the worker, this process, the rest."""

    def __init__(self, stack: Stack) -> None:
        self.server = psutil.Process(stack.server.pid) if stack.server else None
        self.worker = psutil.Process(stack.worker.pid) if stack.worker else None
        self.me = psutil.Process()

    def _read(self) -> tuple[float, ...]:
        mine = self.me.cpu_times()
        machine = psutil.cpu_times()
        busy = machine.user + machine.system + machine.nice
        return (
            time.perf_counter(),
            tree_cpu_s(self.server),
            tree_cpu_s(self.worker),
            mine.user + mine.system,
            busy,
        )

    def start(self) -> None:
        self.t0 = self._read()

    def stop(self) -> dict[str, float]:
        t1 = self._read()
        wall = t1[0] - self.t0[0]
        server, worker, client, machine = ((b - a) / wall for a, b in zip(self.t0[1:], t1[1:], strict=True))
        return {
            "server_cores": server,
            "worker_and_training_cores": worker,
            "load_generator_cores": client,
            "other_processes_cores": max(0.0, machine - server - worker - client),
            "machine_busy_cores": machine,
        }


class Conn:
    """One keep-alive HTTP/1.1 connection: writes a request, reads a Content-Length response."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.prefix = f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = f"{method} {target} HTTP/1.1\r\n{self.prefix}"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status, length, close = int(lines[0].split(" ", 2)[1]), 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                close = value.strip().lower() == "close"
            elif name == "transfer-encoding":
                raise RuntimeError("a chunked response was not expected")
        data = await self.reader.readexactly(length)
        if close:
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


class Stack:
    """A server (and, on request, a worker) on a fresh data folder; ``stop`` ends every process."""

    def __init__(self, home: Path, *, worker: bool) -> None:
        self.home, self.want_worker = home, worker
        self.env = child_env(ROUNDHOUSE_HOME=str(home), ROUNDHOUSE_HF_CACHE=str(home / "hf-cache"))
        self.server: Process | None = None
        self.worker: Process | None = None
        self.port = 0
        self.key = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Stack:
        from tests.engine.tiny import tiny_model_folder  # imports torch: not needed for --help

        (self.home / "hf-cache").mkdir(parents=True, exist_ok=True)
        tiny_model_folder(self.home / "models" / "tiny")
        made = subprocess.run(
            roundhouse("keys", "create", "--name", "bench"),
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        self.key = made.stdout.strip().splitlines()[0]
        self.port = free_port()
        serve = roundhouse("serve", "--host", "127.0.0.1", "--port", str(self.port))
        self.server = Process(serve, env=self.env, log=self.home / "server.log").start()
        self.server.wait_for_http(f"{self.url}/api/health", timeout=120)
        if self.want_worker:
            worker = roundhouse("worker", "--loglevel", "WARNING")
            self.worker = Process(worker, env=self.env, log=self.home / "worker.log").start()
        return self

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.log.name}\n{p.tail(3000)}" for p in (self.server, self.worker) if p is not None
        )

    def logged_errors(self) -> dict[str, int]:
        """The exception lines of the server's and worker's logs, counted (a failure's last line)."""
        found: dict[str, int] = {}
        for log in ("server.log", "worker.log"):
            path = self.home / log
            if path.is_file():
                for text in path.read_text(errors="replace").splitlines():
                    if re.match(r"^[\w.]+(Error|Exception|Exit)\b", text):
                        found[text[:200]] = found.get(text[:200], 0) + 1
        return found

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop(grace=60)
        if self.server is not None:
            self.server.stop(grace=30)
        # whatever is left in either process group (a training child) goes too
        for process in (self.worker, self.server):
            if process is not None:
                process.kill_group()


def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=600)


def upload_small(http: httpx.Client) -> str:
    content = "".join(json.dumps(r) + "\n" for r in SMALL_ROWS).encode()
    r = http.post("/api/datasets", files={"file": ("rows.jsonl", content)})
    r.raise_for_status()
    return str(r.json()["id"])


def write_jsonl(path: Path, size: int) -> int:
    """A valid chat JSONL file of about ``size`` bytes (rows of ~1 KB); returns the row count."""
    vocab = TEXT.split()
    pool = []
    for i in range(1000):
        words = [vocab[(i * 7 + j * 3) % len(vocab)] for j in range(60 + i % 40)]
        user = f"Question {i}: " + " ".join(words)
        answer = f"Answer {i}: " + " ".join(reversed(words))
        row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        pool.append((json.dumps(row) + "\n").encode())
    block = b"".join(pool)
    rows = written = 0
    with path.open("wb") as f:
        while written + len(block) <= size:
            f.write(block)
            written += len(block)
            rows += len(pool)
        for line in pool:
            if written + len(line) > size:
                break
            f.write(line)
            written += len(line)
            rows += 1
    return rows


class TimedFile(io.FileIO):
    """A file read in chunks by the upload; remembers when its end was reached (the body was sent)."""

    eof_at: float | None = None

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if not data and self.eof_at is None:
            self.eof_at = time.perf_counter()
        return data


def measure_upload(stack: Stack, http: httpx.Client, folder: Path, size: int) -> dict[str, Any]:
    """Stream a generated JSONL file to the server while sampling its RSS."""
    assert stack.server is not None
    path = folder / "upload.jsonl"
    t0 = time.perf_counter()
    rows = write_jsonl(path, size)
    generate_s = time.perf_counter() - t0
    real_size = path.stat().st_size
    server = psutil.Process(stack.server.pid)
    me = psutil.Process()
    try:
        time.sleep(1.0)
        before = tree_rss(server)
        client_before = me.memory_info().rss
        with RssSampler(server) as sampler, TimedFile(path, "rb") as fh:
            t0 = time.perf_counter()
            r = http.post(
                "/api/datasets",
                files={"file": ("upload.jsonl", fh, "application/jsonl")},
                data={"name": "upload benchmark"},
            )
            done = time.perf_counter()
            sent = (fh.eof_at or done) - t0
        client_after = me.memory_info().rss
        time.sleep(1.0)
        after = tree_rss(server)
    finally:
        path.unlink(missing_ok=True)
    body = r.json()
    return {
        "bytes": real_size,
        "rows": rows,
        "generate_s": generate_s,
        "status": r.status_code,
        "stored_rows": body.get("rows") if r.status_code == 201 else None,
        "error": None if r.status_code == 201 else body,
        "seconds": done - t0,
        "send_s": sent,
        "after_last_byte_s": done - t0 - sent,
        "mb_per_s": real_size / MB / (done - t0),
        "server_rss_before_mb": before / MB,
        "server_rss_peak_mb": sampler.peak / MB,
        "server_rss_growth_mb": (sampler.peak - before) / MB,
        "server_rss_peak_at_s": sampler.peak_at,
        "server_rss_after_mb": after / MB,
        "rss_samples": sampler.samples,
        "client_rss_growth_mb": (client_after - client_before) / MB,
    }


async def sequential(stack: Stack, dataset_id: str, job_id: str, n: int) -> dict[str, Any]:
    """One request at a time on one connection: latency and the server's CPU time per request."""
    conn = Conn(stack.port, stack.key)
    body = json.dumps(job_body(dataset_id, steps=10, every=100, name="probe")).encode()
    requests = {
        "health": ("GET", "/api/health", b""),
        "get_job": ("GET", f"/api/jobs/{job_id}", b""),
        "list": ("GET", "/api/jobs?limit=50", b""),
        "create": ("POST", "/api/jobs", body),
    }
    server = psutil.Process(stack.server.pid) if stack.server else None
    out: dict[str, Any] = {}
    created: list[str] = []
    try:
        for kind, (method, target, data) in requests.items():
            await conn.request(method, target, data)  # not timed: the first of its kind
            lat = []
            cpu0 = tree_cpu_s(server)
            for _ in range(n):
                t0 = time.perf_counter()
                status, answer = await conn.request(method, target, data)
                lat.append(time.perf_counter() - t0)
                if not 200 <= status < 300:
                    raise RuntimeError(f"{method} {target}: {status} {answer[:300]!r}")
                if kind == "create":
                    created.append(json.loads(answer)["id"])
            out[kind] = stats(lat) | {"server_cpu_ms_per_request": (tree_cpu_s(server) - cpu0) / n * 1000}
    finally:
        await conn.close()
    out["created_ids"] = created
    return out


async def drive(stack: Stack, dataset_id: str, per_client: int, period: float) -> dict[str, Any]:
    """``CLIENTS`` clients, each alternating list and create ``per_client`` times.

    ``period`` 0: each sends its next request when the previous one is answered; otherwise each
    sends one request per ``period`` seconds, the clients' starts spread over one period."""
    lat: dict[str, list[float]] = {"list": [], "create": []}
    errors: dict[str, dict[str, int]] = {"list": {}, "create": {}}
    created: list[str] = []
    body = json.dumps(job_body(dataset_id, steps=10, every=100, name="load")).encode()
    conns = [Conn(stack.port, stack.key) for _ in range(CLIENTS)]

    async def one(conn: Conn, kind: str, record: bool) -> None:
        t0 = time.perf_counter()
        try:
            if kind == "list":
                status, answer = await conn.request("GET", "/api/jobs?limit=50")
            else:
                status, answer = await conn.request("POST", "/api/jobs", body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            await conn.close()
            if record:
                errors[kind][type(exc).__name__] = errors[kind].get(type(exc).__name__, 0) + 1
            return
        elapsed = time.perf_counter() - t0
        if kind == "create" and status == 201:
            created.append(json.loads(answer)["id"])
        if record:
            lat[kind].append(elapsed)
            if not 200 <= status < 300:
                errors[kind][str(status)] = errors[kind].get(str(status), 0) + 1
            elif kind == "list" and not answer.startswith(b'{"data":[{'):
                errors[kind]["not a page of jobs"] = errors[kind].get("not a page of jobs", 0) + 1

    async def run_client(index: int) -> None:
        start = loop.time() + index * period / CLIENTS
        for i in range(per_client):
            if period:
                await asyncio.sleep(max(0.0, start + i * period - loop.time()))
            await one(conns[index], "list" if (i + index) % 2 == 0 else "create", True)

    loop = asyncio.get_running_loop()
    meter = CpuMeter(stack)
    try:
        # warm-up (not recorded): open the connections and fill the first page of the job list;
        # a connection carries one request at a time
        async def warm(index: int) -> None:
            for _ in range(WARMUP_JOBS // CLIENTS + (index < WARMUP_JOBS % CLIENTS)):
                await one(conns[index], "create", False)

        await asyncio.gather(*(warm(i) for i in range(CLIENTS)))
        await asyncio.gather(*(one(c, "list", False) for c in conns))
        if len(created) != WARMUP_JOBS:
            raise RuntimeError(f"the warm-up created {len(created)} of {WARMUP_JOBS} jobs\n{stack.tail()}")
        meter.start()
        t0 = time.perf_counter()
        await asyncio.gather(*(run_client(i) for i in range(CLIENTS)))
        wall = time.perf_counter() - t0
        cpu = meter.stop()
    finally:
        for c in conns:
            await c.close()
    total = len(lat["list"]) + len(lat["create"])
    return {
        "clients": CLIENTS,
        "requests_per_client": per_client,
        "period_s": period or None,
        "wall_s": wall,
        "throughput_rps": total / wall,
        "list": stats(lat["list"]) | {"errors": errors["list"]},
        "create": stats(lat["create"]) | {"errors": errors["create"]},
        "cpu_cores": cpu,
        "created_ids": created,
    }


def wait_running(http: httpx.Client, stack: Stack, job_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = http.get(f"/api/jobs/{job_id}").json()
        if job["status"] == "running" and job["step"] >= 1:
            return
        if job["status"] in ("failed", "cancelled", "succeeded"):
            break
        time.sleep(0.5)
    log = stack.home / "runs" / job_id / "train.log"
    train_log = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
    raise RuntimeError(f"the training job did not start: {job}\n{stack.tail()}\n{train_log}")


def cancel_all(http: httpx.Client, ids: list[str]) -> None:
    for ident in ids:
        r = http.post(f"/api/jobs/{ident}/cancel")
        if r.status_code not in (200, 409):
            r.raise_for_status()


def run_scenario(name: str, home: Path, args: argparse.Namespace, upload_bytes: int | None) -> dict[str, Any]:
    """One server (plus worker and a long job for ``training``): upload, probe, load, paced load."""
    home.mkdir(parents=True)
    stack = Stack(home, worker=name == "training")
    out: dict[str, Any] = {}
    created: list[str] = []
    try:
        stack.start()
        with client(stack) as http:
            dataset_id = upload_small(http)
            if upload_bytes is not None:
                print(f"[{name}] upload of {upload_bytes / MB:.0f} MB ...", flush=True)
                out["upload"] = measure_upload(stack, http, home, upload_bytes)
            r = http.post("/api/jobs", json=job_body(dataset_id, steps=100_000, every=1000, name="long"))
            r.raise_for_status()
            long_id = r.json()["id"]
            if stack.worker is not None:
                print(f"[{name}] waiting for job {long_id[:8]} to train ...", flush=True)
                wait_running(http, stack, long_id)

            def step() -> int:
                return int(http.get(f"/api/jobs/{long_id}").json()["step"])

            def measured(label: str, coro: Any) -> dict[str, Any]:
                print(f"[{name}] {label} ...", flush=True)
                step0, t0 = step(), time.perf_counter()
                result: dict[str, Any] = asyncio.run(coro)
                created.extend(result.pop("created_ids"))
                if stack.worker is not None:
                    result["training_steps_per_s"] = (step() - step0) / (time.perf_counter() - t0)
                return result

            out["sequential"] = measured(
                "sequential probe", sequential(stack, dataset_id, long_id, args.probe)
            )
            out["concurrent"] = measured(
                f"{CLIENTS} clients x {args.requests} requests",
                drive(stack, dataset_id, args.requests, 0.0),
            )
            out["paced"] = measured(
                f"{CLIENTS} clients x {args.paced} requests, one per {PACE_S:g} s each",
                drive(stack, dataset_id, args.paced, PACE_S),
            )
            out["jobs_created"] = len(created) + 1
            if stack.worker is not None:
                out["training_job_status"] = http.get(f"/api/jobs/{long_id}").json()["status"]
                print(f"[{name}] cancelling {len(created) + 1} jobs ...", flush=True)
                cancel_all(http, created)  # the queued ones first: none may start in between
                cancel_all(http, [long_id])
                deadline = time.monotonic() + 120
                while http.get(f"/api/jobs/{long_id}").json()["status"] != "cancelled":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"job {long_id} did not stop after its cancel\n{stack.tail()}")
                    time.sleep(0.5)
    finally:
        stack.stop()
        out["logged_errors"] = stack.logged_errors()
    return out


def versions() -> dict[str, str]:
    names = ("fastapi", "starlette", "uvicorn", "pydantic", "sqlalchemy", "celery", "kombu", "httpx")
    out = {"python": platform.python_version()}
    for n in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[n] = metadata.version(n)
    return out


def line(label: str, s: dict[str, Any]) -> str:
    text = (
        f"  {label:8s} n={s['count']:5d}  p50 {s['p50_ms']:7.1f}  p90 {s['p90_ms']:7.1f}  "
        f"p99 {s['p99_ms']:7.1f}  max {s['max_ms']:7.1f} ms"
    )
    if "errors" in s:
        text += f"  errors {sum(s['errors'].values())}"
    if "server_cpu_ms_per_request" in s:
        text += f"  server CPU {s['server_cpu_ms_per_request']:.1f} ms/request"
    return text


def summary(result: dict[str, Any]) -> str:
    out = []
    for name, sc in result["scenarios"].items():
        out.append(f"\n{name}: sequential, one connection")
        out += [line(kind, s) for kind, s in sc["sequential"].items() if isinstance(s, dict)]
        for run in ("concurrent", "paced"):
            c = sc[run]
            how = "back to back" if run == "concurrent" else f"one request per {c['period_s']:g} s each"
            out.append(f"{name}: {c['clients']} clients, {how}: {c['throughput_rps']:.0f} requests/s")
            out += [line("list", c["list"]), line("create", c["create"])]
            cpu = c["cpu_cores"]
            out.append(
                f"  CPU cores: server {cpu['server_cores']:.2f}, worker+training "
                f"{cpu['worker_and_training_cores']:.2f}, load generator {cpu['load_generator_cores']:.2f}, "
                f"other processes {cpu['other_processes_cores']:.2f}; machine {cpu['machine_busy_cores']:.2f}"
                f" of {result['machine']['cpu_count']}"
            )
            if "training_steps_per_s" in c:
                out.append(f"  training job: {c['training_steps_per_s']:.1f} steps/s meanwhile")
        for text, count in sc["logged_errors"].items():
            out.append(f"  logged by the server or worker ({count}x): {text}")
    u = result["upload"]
    out.append(
        f"\nupload {u['bytes'] / MB:.0f} MB ({u['rows']} rows): status {u['status']}, {u['seconds']:.1f} s "
        f"({u['send_s']:.1f} s sending, {u['after_last_byte_s']:.1f} s after the last byte); server RSS "
        f"{u['server_rss_before_mb']:.0f} -> peak {u['server_rss_peak_mb']:.0f} MB "
        f"(growth {u['server_rss_growth_mb']:.1f} MB); client RSS growth {u['client_rss_growth_mb']:.1f} MB"
    )
    met = result["met"]

    def word(ok: bool) -> str:
        return "met" if ok else "MISSED"

    out.append(
        f"\ntargets: p99 < {P99_TARGET_MS:.0f} ms, {CLIENTS} concurrent clients while a job trains: "
        f"list {word(met['list_p99_while_training'])}, create {word(met['create_p99_while_training'])}; "
        f"upload RSS growth < {RSS_TARGET_MB:.0f} MB: {word(met['upload_rss_growth'])}"
    )
    return "\n".join(out)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="roundhouse-api-load-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 64 MB upload, few requests")
    parser.add_argument("--requests", type=int, help="back-to-back requests per client (default 40; quick 6)")
    parser.add_argument("--paced", type=int, help="paced requests per client (default 20; quick 3)")
    parser.add_argument("--probe", type=int, help="sequential requests of each kind (default 30; quick 5)")
    parser.add_argument("--upload-mb", type=int, help="upload size in MiB (default 1024; quick 64)")
    args = parser.parse_args()
    args.requests = args.requests or (6 if args.quick else 40)
    args.paced = args.paced or (3 if args.quick else 20)
    args.probe = args.probe or (5 if args.quick else 30)
    wanted = (args.upload_mb or (64 if args.quick else 1024)) * MB
    load_before = os.getloadavg()
    with scratch() as folder:
        free = shutil.disk_usage(folder).free
        # the file, the server's spooled copy and the stored copy, with room to spare
        size = wanted if free - 3 * wanted >= MIN_FREE_BYTES else max(MB, (free - MIN_FREE_BYTES) // 3)
        scenarios = {
            "idle": run_scenario("idle", folder / "idle", args, size),
            "training": run_scenario("training", folder / "training", args, None),
        }
    upload = scenarios["idle"].pop("upload")
    upload |= {"requested_bytes": wanted, "reduced_for_disk": size < wanted, "disk_free_bytes": free}
    loaded = scenarios["training"]["concurrent"]
    met = {
        "list_p99_while_training": loaded["list"]["p99_ms"] < P99_TARGET_MS,
        "create_p99_while_training": loaded["create"]["p99_ms"] < P99_TARGET_MS,
        "upload_rss_growth": upload["status"] == 201 and upload["server_rss_growth_mb"] < RSS_TARGET_MB,
    }
    result = {
        "benchmark": "api_load",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "targets": {"p99_ms": P99_TARGET_MS, "rss_growth_mb": RSS_TARGET_MB},
        "met": met,
        "setup": {
            "server": "roundhouse serve: uvicorn, one process",
            "database": "sqlite (WAL), the default",
            "broker": "filesystem (no server), the default",
            "base_model": "tiny (tests/engine/tiny.py)",
            "training_job": job_body("<dataset>", steps=100_000, every=1000),
            "clients": CLIENTS,
            "requests_per_client": args.requests,
            "paced_requests_per_client": args.paced,
            "paced_period_s": PACE_S,
            "sequential_requests_per_kind": args.probe,
            "warmup_jobs": WARMUP_JOBS,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "memory_gb": psutil.virtual_memory().total / 2**30,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_before": load_before,
        },
        "versions": versions(),
        "scenarios": scenarios,
        "upload": upload,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "api_load.json").write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))


if __name__ == "__main__":
    main()
