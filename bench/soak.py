"""Soak: the service under mixed use for a bounded time, a worker SIGKILLed mid-job and a training
process SIGKILLed (as the out-of-memory killer does), and not one job lost or run twice.

Everything runs as real processes on loopback, in a temporary data folder of its own that is
removed at the end: ``roundhouse serve`` (uvicorn, one process), ``roundhouse worker`` (short lease
and requeue bounds so recovery fits in the run), SQLite, the broker (Redis database 7 on
127.0.0.1:6379 with a queue name of its own when Redis answers, else the folder transport), the
tiny test model as base model ``tiny``. For ``--seconds`` (120 by default):

- ``--streams`` SSE clients (24) follow unfinished jobs (``GET /api/jobs/{id}/stream``), each
  for 3 to 12 s at a time, then reconnect with ``Last-Event-ID`` as a browser does (a stream that
  ended, its job over, is left for another job after 1 to 3 s); every event id must be larger
  than the last one that client saw of that job;
- ``--jobs`` identical LoRA jobs (6) are submitted, spread over the first half of the run;
- two downloaders fetch the latest checkpoint of a job (``.../checkpoints/{step}/download``; one
  in five merged into the base model) and check every sum of its ``MANIFEST.sha256``;
- two pollers read what the web UI reads: the job list, a job, its events and metrics, the
  checkpoints, the GPU hosts, health;
- chaos: once a job has a checkpoint, the worker's main process gets SIGKILL (its training
  process must stop by itself; the job becomes ``interrupted`` when its lease runs out and resumes
  on the worker started in its place); later another job's training process gets SIGKILL (the
  worker restarts it from its last checkpoint).

Then the jobs are left to finish (``--drain`` seconds at most), the same job is trained once
without interruption in this process, and the checks run: every request answered without a 5xx;
every job ``succeeded``; claims (state events into ``running``) = ``attempts`` = 1 + the job's
interruptions, and each claim followed a ``queued`` or ``interrupted`` state (never two runs at
once); the final adapter's SHA-256 (from the download's manifest) and the final ``loss/train``
equal the uninterrupted run's; no training process outlives its worker. Latency is timed in the
client (httpx); p50/p90/p99/max per kind of request. Figures go to ``bench/results/soak.json``
(machine, Python and package versions); the exit code is 1 when a check fails.

    python bench/soak.py [--seconds 120] [--streams 24] [--jobs 6] [--broker redis|folder]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
# run as ``python bench/soak.py``: the checkout's root, where ``tests`` is, is not on the path yet
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.utils import Process, answers, child_env, free_port, roundhouse  # noqa: E402

RESULTS = ROOT / "bench" / "results"
REDIS = "redis://127.0.0.1:6379/7"
STEPS, EVERY = 30, 5
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 7}."},
            {"role": "assistant", "content": str(i % 7)},
        ]
    }
    for i in range(48)
]
WORKER_ENV = {  # short bounds, so that a lost worker's job is back within seconds
    "ROUNDHOUSE_LEASE_SECONDS": "4",
    "ROUNDHOUSE_TELEMETRY_SECONDS": "1",
    "ROUNDHOUSE_REQUEUE_AFTER_SECONDS": "15",
}
ADAPTER = "adapter_model.safetensors"


def job_body(dataset_id: str, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "base_model": "tiny",
        "dataset_id": dataset_id,
        "data": {"max_length": 64},
        "method": {"kind": "lora", "lora_r": 4},
        "hyper": {"max_steps": STEPS, "batch_size": 4, "learning_rate": 0.01, "optimizer": "sgd"},
        "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2, "compute_dtype": "float32"},
        "checkpoint": {"every_steps": EVERY, "keep_last": 10},
    }


def stats(latencies_s: list[float]) -> dict[str, Any]:
    """Count and nearest-rank percentiles in milliseconds."""
    values = sorted(x * 1000 for x in latencies_s)
    if not values:
        return {"count": 0}

    def pct(p: float) -> float:
        return round(values[max(0, math.ceil(p / 100 * len(values)) - 1)], 2)

    return {"count": len(values), "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": pct(100)}


class Tally:
    """Latencies and outcomes per kind of request."""

    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = {}
        self.status: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []

    def add(self, kind: str, seconds: float | None, status: int | str) -> None:
        if seconds is not None:
            self.latency.setdefault(kind, []).append(seconds)
        counts = self.status.setdefault(kind, {})
        counts[str(status)] = counts.get(str(status), 0) + 1

    def fail(self, kind: str, what: str) -> None:
        self.add(kind, None, "error")
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {what}"[:300])

    def server_errors(self) -> int:
        return sum(n for c in self.status.values() for s, n in c.items() if s.isdigit() and int(s) >= 500)

    def client_errors(self) -> int:
        return sum(n for c in self.status.values() for s, n in c.items() if not s.isdigit())

    def report(self) -> dict[str, Any]:
        kinds = sorted(set(self.latency) | set(self.status))
        return {k: {**stats(self.latency.get(k, [])), "status": self.status.get(k, {})} for k in kinds}


class Stack:
    """The API server and a worker on a fresh data folder."""

    def __init__(self, home: Path, redis_url: str | None) -> None:
        self.home = home
        self.env = child_env(
            ROUNDHOUSE_HOME=str(home),
            ROUNDHOUSE_HF_CACHE=str(home / "hf-cache"),
            ROUNDHOUSE_QUEUE=f"soak-{uuid.uuid4().hex[:12]}",
            **WORKER_ENV,
        )
        if redis_url:
            self.env["ROUNDHOUSE_REDIS_URL"] = redis_url
        self.server: Process | None = None
        self.workers: list[Process] = []
        self.port = free_port()
        self.key = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker(self) -> Process:
        return self.workers[-1]

    def start(self) -> Stack:
        from tests.engine.tiny import tiny_model_folder  # imports torch: not needed for --help

        (self.home / "hf-cache").mkdir(parents=True, exist_ok=True)
        tiny_model_folder(self.home / "models" / "tiny")
        made = subprocess.run(
            roundhouse("keys", "create", "--name", "soak"),
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        self.key = made.stdout.strip().splitlines()[0]
        serve = roundhouse("serve", "--host", "127.0.0.1", "--port", str(self.port))
        self.server = Process(serve, env=self.env, log=self.home / "server.log").start()
        self.server.wait_for_http(f"{self.url}/api/health", timeout=120)
        self.start_worker()
        return self

    def start_worker(self) -> Process:
        log = self.home / f"worker-{len(self.workers) + 1}.log"
        worker = Process(roundhouse("worker", "--loglevel", "INFO"), env=self.env, log=log).start()
        self.workers.append(worker)
        if worker.wait_for_line(r"ready\.", timeout=120) is None:
            raise RuntimeError(f"the worker did not start\n{worker.tail()}")
        return worker

    def trainers(self) -> list[psutil.Process]:
        """Training processes of this run's data folder, whoever their parent is."""
        found = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            with contextlib.suppress(psutil.Error):
                cmd = p.info["cmdline"] or []
                if "server.worker.trainer" in cmd and (p.info["environ"] or {}).get("ROUNDHOUSE_HOME") == str(
                    self.home
                ):
                    found.append(p)
        return found

    def logged_errors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for path in sorted(self.home.glob("*.log")):
            for text in path.read_text(errors="replace").splitlines():
                if re.match(r"^[\w.]+(Error|Exception)\b", text) or "Traceback" in text:
                    line = f"{path.name}: {text[:200]}"
                    found[line] = found.get(line, 0) + 1
        return found

    def stop(self) -> None:
        for process in reversed(self.workers):
            process.stop(grace=60)
        if self.server is not None:
            self.server.stop(grace=30)
        for process in self.workers:
            process.kill_group()
        if self.server is not None:
            self.server.kill_group()

    def forget_queue(self) -> None:
        """Remove this run's keys from the Redis database (its queue, bindings, unacked messages)."""
        url = self.env.get("ROUNDHOUSE_REDIS_URL")
        if not url:
            return
        import redis

        queue = self.env["ROUNDHOUSE_QUEUE"]
        client = redis.Redis.from_url(url)
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        for tag, raw in client.hgetall("unacked").items():
            with contextlib.suppress(ValueError, IndexError, TypeError):
                if json.loads(raw)[2] == queue:
                    client.hdel("unacked", tag)
                    client.zrem("unacked_index", tag)
        client.close()


class Soak:
    """The load, the chaos and what they saw."""

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack, self.args = stack, args
        self.tally = Tally()
        self.jobs: list[str] = []
        self.finished: set[str] = set()  # jobs whose stream said they ended
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + args.seconds
        self.chaos: dict[str, Any] = {}
        self.streams = {"connects": 0, "events": 0, "ends": 0, "out_of_order": 0, "keepalives": 0}
        self.downloads = {"adapter": 0, "merged": 0, "bytes": 0, "bad_manifest": 0, "gone": 0}
        self.rng = random.Random(7)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def over(self) -> bool:
        return time.monotonic() >= self.stop_at

    async def call(self, http: httpx.AsyncClient, kind: str, method: str, url: str, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            r = await http.request(method, url, **kw)
        except httpx.HTTPError as exc:
            self.tally.fail(kind, f"{type(exc).__name__}: {exc}")
            return None
        self.tally.add(kind, time.perf_counter() - t, r.status_code)
        if r.status_code >= 500:
            self.tally.failures.append(f"{kind} {url}: {r.status_code} {r.text[:200]}")
        return r

    async def submitter(self, http: httpx.AsyncClient, dataset_id: str) -> None:
        gap = self.args.seconds / 2 / max(1, self.args.jobs - 1)
        for i in range(self.args.jobs):
            r = await self.call(http, "submit", "POST", "/api/jobs", json=job_body(dataset_id, f"soak {i}"))
            if r is not None and r.status_code == 201:
                self.jobs.append(r.json()["id"])
            if i + 1 < self.args.jobs:
                await asyncio.sleep(gap)

    async def streamer(self, http: httpx.AsyncClient, index: int) -> None:
        seen: dict[str, int] = {}
        await asyncio.sleep(index * 0.1)
        while not self.over():
            if not self.jobs:
                await asyncio.sleep(0.5)
                continue
            live = [j for j in self.jobs if j not in self.finished]
            job_id = self.rng.choice(live or self.jobs)  # a finished one: its history, replayed
            window = min(self.rng.uniform(3, 12), max(0.1, self.stop_at - time.monotonic()))
            ended = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(window):
                    ended = await self.follow(http, job_id, seen)
            await asyncio.sleep(self.rng.uniform(1, 3) if ended else 0.3)

    async def follow(self, http: httpx.AsyncClient, job_id: str, seen: dict[str, int]) -> bool:
        """Read one job's stream from the last event this client saw; True when the stream ended
        (the job is over)."""
        last = seen.get(job_id, 0)
        headers = {"Last-Event-ID": str(last)}
        t = time.perf_counter()
        try:
            async with http.stream("GET", f"/api/jobs/{job_id}/stream", headers=headers) as r:
                self.tally.add("stream_connect", time.perf_counter() - t, r.status_code)
                if r.status_code != 200:
                    return False
                self.streams["connects"] += 1
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        ident = int(line[4:])
                        if ident <= seen.get(job_id, 0):
                            self.streams["out_of_order"] += 1
                        seen[job_id] = ident
                        self.streams["events"] += 1
                    elif line == "event: end":
                        self.streams["ends"] += 1
                        self.finished.add(job_id)
                        return True
                    elif line.startswith(": keep-alive"):
                        self.streams["keepalives"] += 1
        except httpx.HTTPError as exc:
            self.tally.fail("stream", f"{type(exc).__name__}: {exc}")
        return False

    async def poller(self, http: httpx.AsyncClient) -> None:
        while not self.over():
            await self.call(http, "list_jobs", "GET", "/api/jobs", params={"limit": 50})
            await self.call(http, "health", "GET", "/api/health")
            await self.call(http, "gpus", "GET", "/api/gpus")
            if self.jobs:
                job_id = self.rng.choice(self.jobs)
                await self.call(http, "get_job", "GET", f"/api/jobs/{job_id}")
                await self.call(http, "events", "GET", f"/api/jobs/{job_id}/events", params={"limit": 200})
                params = {"keys": ["loss/train"]}
                await self.call(http, "metrics", "GET", f"/api/jobs/{job_id}/metrics", params=params)
            await asyncio.sleep(0.5)

    async def downloader(self, http: httpx.AsyncClient, index: int) -> None:
        count = index
        while not self.over():
            await asyncio.sleep(1.0)
            if not self.jobs:
                continue
            job_id = self.rng.choice(self.jobs)
            r = await self.call(http, "checkpoints", "GET", f"/api/jobs/{job_id}/checkpoints")
            if r is None or r.status_code != 200 or not r.json()["data"]:
                continue
            step = r.json()["data"][-1]["step"]
            count += 1
            merged = count % 5 == 0
            kind = "download_merged" if merged else "download"
            url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
            r = await self.call(http, kind, "GET", url, params={"merged": merged})
            if r is None or r.status_code == 404:  # pruned meanwhile (keep_last)
                self.downloads["gone"] += r is not None
                continue
            if r.status_code == 200:
                self.downloads["merged" if merged else "adapter"] += 1
                self.downloads["bytes"] += len(r.content)
                if manifest(r.content) is None:
                    self.downloads["bad_manifest"] += 1

    async def job_now(self, http: httpx.AsyncClient, job_id: str) -> dict[str, Any] | None:
        r = await self.call(http, "get_job", "GET", f"/api/jobs/{job_id}")
        return r.json() if r is not None and r.status_code == 200 else None

    async def running_with_checkpoint(self, http: httpx.AsyncClient, skip: set[str]) -> dict[str, Any]:
        while True:
            for job_id in list(self.jobs):
                job = await self.job_now(http, job_id)
                if (
                    job
                    and job_id not in skip
                    and job["status"] == "running"
                    and EVERY < job["step"] < STEPS - 3
                ):
                    return job
            await asyncio.sleep(0.2)

    async def chaos_monkey(self, http: httpx.AsyncClient) -> None:
        """SIGKILL the worker while a job runs (then start another), later a training process."""
        job = await self.running_with_checkpoint(http, set())
        old = self.stack.worker
        old.kill()
        self.chaos["worker_killed"] = {"at_s": self.elapsed(), "job": job["id"], "step": job["step"]}
        await asyncio.sleep(2.0)
        self.chaos["orphan_trainers_2s_after"] = len(self.stack.trainers())
        await asyncio.to_thread(self.stack.start_worker)
        self.chaos["worker_restarted_at_s"] = self.elapsed()
        job = await self.running_with_checkpoint(http, {job["id"]})
        (trainer,) = [p for p in self.stack.worker.descendants() if "server.worker.trainer" in p.cmdline()]
        trainer.kill()
        self.chaos["trainer_killed"] = {"at_s": self.elapsed(), "job": job["id"], "step": job["step"]}

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.streams + 20, max_keepalive_connections=20)
        timeout = httpx.Timeout(60.0)
        headers = {"Authorization": f"Bearer {self.stack.key}"}
        async with httpx.AsyncClient(
            base_url=self.stack.url, headers=headers, limits=limits, timeout=timeout
        ) as http:
            content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
            r = await http.post("/api/datasets", files={"file": ("rows.jsonl", content)})
            r.raise_for_status()
            dataset_id = r.json()["id"]
            self.t0 = time.monotonic()
            self.stop_at = self.t0 + self.args.seconds
            load = [
                self.submitter(http, dataset_id),
                *(self.streamer(http, i) for i in range(self.args.streams)),
                *(self.poller(http) for _ in range(2)),
                *(self.downloader(http, i) for i in range(2)),
            ]
            chaos = asyncio.create_task(self.chaos_monkey(http))
            await asyncio.gather(*load)
            self.chaos["finished_within_the_load"] = chaos.done()
            drain_until = time.monotonic() + self.args.drain
            while time.monotonic() < drain_until:
                states = [await self.job_now(http, j) for j in self.jobs]
                if all(s and s["status"] in ("succeeded", "failed", "cancelled") for s in states):
                    break
                await asyncio.sleep(1.0)
            if not chaos.done():
                chaos.cancel()
                self.chaos["unfinished"] = True
            self.drained_at = self.elapsed()


def manifest(archive: bytes) -> dict[str, str] | None:
    """A download's ``MANIFEST.sha256`` (name -> sum) when every sum matches, else None."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name: tar.extractfile(m) for m in tar.getmembers() if m.isfile()}
        data = {name: f.read() for name, f in files.items() if f is not None}
    listed = {}
    for line in data.get("MANIFEST.sha256", b"").decode().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    ok = listed and all(hashlib.sha256(data.get(n, b"")).hexdigest() == d for n, d in listed.items())
    return listed if ok else None


def reference(config: dict[str, Any], folder: Path, models_dir: Path) -> dict[str, Any]:
    """The same job trained once without interruption, in this process."""
    from engine.config import TrainConfig
    from engine.metrics import ListSink
    from engine.training.run import train

    sink = ListSink()
    t = time.perf_counter()
    train(TrainConfig.model_validate(config | {"output_dir": str(folder)}), sink, models_dir=models_dir)
    adapter = folder / "checkpoints" / f"step_{STEPS:06d}" / ADAPTER
    return {
        "seconds": round(time.perf_counter() - t, 1),
        "adapter_sha256": hashlib.sha256(adapter.read_bytes()).hexdigest(),
        "final_loss": sink.series("loss/train")[-1],
    }


def audit(http: httpx.Client, job_id: str, expected: dict[str, Any]) -> dict[str, Any]:
    """One job's outcome and history, and whether it matches an uninterrupted run."""
    job = http.get(f"/api/jobs/{job_id}").json()
    events = http.get(f"/api/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    while len(events) % 1000 == 0 and events:
        more = http.get(f"/api/jobs/{job_id}/events", params={"limit": 1000, "after": events[-1]["id"]})
        page = more.json()["data"]
        if not page:
            break
        events += page
    moves = [(e["data"].get("from"), e["data"]["to"]) for e in events if e["kind"] == "state"]
    claims = [m for m in moves if m[1] == "running"]
    out: dict[str, Any] = {
        "id": job_id,
        "status": job["status"],
        "error": job["error"],
        "attempts": job["attempts"],
        "claims": len(claims),
        "interruptions": sum(1 for m in moves if m[1] == "interrupted"),
        "retries": sum(1 for e in events if e["kind"] == "log" and "retry" in e["data"]),
        "sends": [e["data"]["sends"] for e in events if e["kind"] == "log" and "sends" in e["data"]],
        "resumed_from": [e["data"].get("step") for e in events if e["kind"] == "resume"],
        "states": [m[1] for m in moves],
    }
    out["one_run_at_a_time"] = all(m[0] in ("queued", "interrupted") for m in claims)
    loss = http.get(f"/api/jobs/{job_id}/metrics", params={"keys": ["loss/train"]}).json()["data"]
    out["final_loss"] = loss["loss/train"][-1]["value"] if loss.get("loss/train") else None
    sums = None
    if job["status"] == "succeeded":
        r = http.get(f"/api/jobs/{job_id}/checkpoints/{STEPS}/download")
        sums = manifest(r.content) if r.status_code == 200 else None
    out["adapter_sha256"] = sums.get(ADAPTER) if sums else None
    out["ok"] = (
        out["status"] == "succeeded"
        and out["attempts"] == out["claims"] == 1 + out["interruptions"]
        and out["one_run_at_a_time"]
        and out["adapter_sha256"] == expected["adapter_sha256"]
        and out["final_loss"] == expected["final_loss"]
    )
    return out


def versions() -> dict[str, str]:
    names = (
        "torch",
        "transformers",
        "peft",
        "fastapi",
        "starlette",
        "uvicorn",
        "pydantic",
        "sqlalchemy",
        "celery",
        "kombu",
        "redis",
        "httpx",
    )
    out = {"python": platform.python_version()}
    for n in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[n] = metadata.version(n)
    return out


def summary(result: dict[str, Any]) -> str:
    lines = [f"soak: {result['setup']['seconds']} s of load, broker {result['setup']['broker']}"]
    for kind, s in result["requests"].items():
        if s.get("count"):
            lines.append(
                f"  {kind:16} n={s['count']:5}  p50 {s['p50_ms']:8.1f}  p99 {s['p99_ms']:8.1f}"
                f"  max {s['max_ms']:8.1f} ms  {s['status']}"
            )
    lines.append(f"  streams {result['streams']}")
    lines.append(f"  downloads {result['downloads']}")
    lines.append(f"  chaos {result['chaos']}")
    for job in result["jobs"]:
        lines.append(
            f"  job {job['id'][:8]} {job['status']:9} attempts {job['attempts']} claims {job['claims']}"
            f" interrupted {job['interruptions']} retries {job['retries']} sends {job['sends']}"
            f" resumed {job['resumed_from']} same weights/loss {job['ok']}"
        )
    lines.append(f"  5xx {result['server_errors']}, connection errors {result['connection_errors']}")
    lines.append(f"  checks {result['checks']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="length of the load (default 120)")
    parser.add_argument("--streams", type=int, default=24, help="SSE clients (default 24)")
    parser.add_argument("--jobs", type=int, default=6, help="jobs submitted (default 6; at least 2)")
    parser.add_argument("--drain", type=float, default=240.0, help="most seconds to let the jobs finish")
    parser.add_argument("--broker", choices=("redis", "folder"), help="default: redis when it answers")
    args = parser.parse_args()
    args.jobs = max(2, args.jobs)
    broker = args.broker or ("redis" if answers("127.0.0.1", 6379) else "folder")
    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="roundhouse-soak-") as tmp:
        stack = Stack(Path(tmp) / "home", REDIS if broker == "redis" else None)
        try:
            stack.start()
            soak = Soak(stack, args)
            me = psutil.Process()
            cpu0 = me.cpu_times()
            asyncio.run(soak.run())
            cpu1 = me.cpu_times()
            with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}) as http:
                config = http.get(f"/api/jobs/{soak.jobs[0]}").json()["config"]
                expected = reference(config, Path(tmp) / "reference", stack.home / "models")
                jobs = [audit(http, job_id, expected) for job_id in soak.jobs]
        finally:
            stack.stop()
            orphans = len(stack.trainers())
            logged = stack.logged_errors()
            stack.forget_queue()
    killed = soak.chaos.get("worker_killed", {}).get("job")
    retried = soak.chaos.get("trainer_killed", {}).get("job")
    checks = {
        "no_5xx": soak.tally.server_errors() == 0,
        "no_connection_errors": soak.tally.client_errors() == 0,
        "streams_in_order": soak.streams["out_of_order"] == 0,
        "downloads_verified": soak.downloads["bad_manifest"] == 0 and soak.downloads["adapter"] > 0,
        "all_jobs_submitted": len(soak.jobs) == args.jobs,
        "every_job_once_same_weights_and_loss": all(j["ok"] for j in jobs),
        "worker_killed_mid_job_and_resumed": killed is not None
        and any(j["id"] == killed and j["interruptions"] == 1 for j in jobs),
        "trainer_killed_and_retried": retried is not None
        and any(j["id"] == retried and j["retries"] == 1 for j in jobs),
        "no_orphan_training_process": orphans == 0 and soak.chaos.get("orphan_trainers_2s_after") == 0,
    }
    result = {
        "benchmark": "soak",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "setup": {
            "seconds": args.seconds,
            "streams": args.streams,
            "jobs": args.jobs,
            "broker": broker if broker == "folder" else f"redis ({REDIS}, a queue of its own)",
            "database": "sqlite (WAL)",
            "server": "roundhouse serve: uvicorn, one process",
            "worker_settings": WORKER_ENV,
            "job": job_body("<dataset>", "soak N"),
            "pollers": 2,
            "downloaders": 2,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_before": load_before,
        },
        "versions": versions(),
        "wall_s": round(time.monotonic() - started, 1),
        "drained_at_s": getattr(soak, "drained_at", None),
        "load_generator_cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 1),
        "requests": soak.tally.report(),
        "server_errors": soak.tally.server_errors(),
        "connection_errors": soak.tally.client_errors(),
        "failures": soak.tally.failures,
        "streams": soak.streams,
        "downloads": soak.downloads,
        "chaos": soak.chaos,
        "reference": expected,
        "jobs": jobs,
        "orphan_training_processes": orphans,
        "logged_errors": logged,
        "checks": checks,
        "passed": all(checks.values()),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
