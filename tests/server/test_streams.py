"""The event streams under real use: an open stream holds no database connection, one poll serves
every stream, many open streams leave the API responsive, and SIGTERM ends them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from server.services import gpus, jobs
from server.settings import Settings
from server.streams import POLL_S
from tests.server.test_api import CHAT, jsonl, make_job, upload
from tests.utils import Process, child_env, free_port, roundhouse
from tests.utils.aio import run_coroutine

STATE_IDS = 2  # a new job's events: created, queued


def new_jobs(client: TestClient, n: int) -> list[str]:
    ds = upload(client, jsonl(CHAT)).json()
    return [make_job(client, ds["id"]).json()["id"] for _ in range(n)]


def ids_until(lines: Iterator[str], *, count: int) -> list[int]:
    """The next ``count`` event ids a stream sends."""
    ids: list[int] = []
    for line in lines:
        if line.startswith("id: "):
            ids.append(int(line[4:]))
            if len(ids) == count:
                return ids
    raise AssertionError(f"the stream ended after {ids}")


def test_open_streams_hold_no_connection_and_share_one_poll(client: TestClient) -> None:
    app: Any = client.app
    engine, sessions = app.state.engine, app.state.sessions
    first, second = new_jobs(client, 2)
    reads: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "FROM job_events" in statement:
            reads.append(statement)

    with contextlib.ExitStack() as stack:
        streams = []
        for job_id in (first, first, first, second, second, second):
            r = stack.enter_context(client.stream("GET", f"/api/jobs/{job_id}/stream"))
            assert r.status_code == 200
            lines = r.iter_lines()
            assert len(ids_until(lines, count=STATE_IDS)) == STATE_IDS  # the replay
            streams.append((job_id, lines))
        gpu = stack.enter_context(client.stream("GET", "/api/gpus/stream"))
        gpu_lines = gpu.iter_lines()
        assert next(line for line in gpu_lines if line.startswith("data: ")) == "data: []"
        # while they wait: no connection held (one, briefly, while the hub polls), and the new
        # events of both jobs are read by one query per poll interval, not one per stream
        reads.clear()
        held = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            held.append(engine.pool.checkedout())
            time.sleep(0.02)
        polls = len(reads)
        assert max(held) <= 1, f"connections held by 7 open streams: {sorted(set(held))}"
        assert polls <= 2.0 / POLL_S + 1, f"{polls} reads of job_events in 2 s for 6 job streams"
        # new events reach every stream of their job, in order, then a final state ends them
        with sessions() as session:
            added = [
                jobs.add_event(session, job_id=j, kind="log", message="x").id for j in (first, second) * 2
            ]
            gpus.record(session, worker_id="w@box", hostname="box", devices=[], cpu={}, message="no GPU")
        client.post(f"/api/jobs/{first}/cancel")
        client.post(f"/api/jobs/{second}/cancel")
        for job_id, lines in streams:
            every = client.get(f"/api/jobs/{job_id}/events").json()["data"]
            assert {e["id"] for e in every} >= set(added[(job_id == second) :: 2])
            rest = list(lines)
            assert [int(x[4:]) for x in rest if x.startswith("id: ")] == [e["id"] for e in every[STATE_IDS:]]
            assert "event: end" in rest and 'data: {"status": "cancelled"}' in rest
        host = next(line for line in gpu_lines if line.startswith("data: "))
        assert '"worker": "w@box"' in host


async def open_streams(base: str, key: str, paths: list[str]) -> tuple[httpx.AsyncClient, list[Any]]:
    """Open every stream and read its first bytes; the client and the open responses."""
    limits = httpx.Limits(max_connections=len(paths) + 20, max_keepalive_connections=20)
    http = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, limits=limits)

    async def one(path: str) -> Any:
        r = await http.send(http.build_request("GET", path), stream=True)
        assert r.status_code == 200, (path, r.status_code)
        chunks = r.aiter_text()
        assert (await anext(chunks)).startswith("retry:")
        return r, chunks

    async with asyncio.timeout(20):
        opened = await asyncio.gather(*(one(p) for p in paths))
    return http, opened


async def serve_with_streams(base: str, key: str, paths: list[str], *, probes: int) -> list[float]:
    """Hold the streams open and time ``GET /api/datasets`` meanwhile (sequential, 5 s timeout each)."""
    http, opened = await open_streams(base, key, paths)
    try:
        took = []
        for _ in range(probes):
            t = time.perf_counter()
            r = await http.get("/api/datasets", timeout=5)
            took.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
        return took
    finally:
        for r, _ in opened:
            await r.aclose()
        await http.aclose()


def start_server(settings: Settings, tmp_path: Path, *extra: str) -> tuple[Process, str]:
    port = free_port()
    env = child_env(**settings.child_environment())
    server = Process(roundhouse("serve", "--port", str(port), *extra), env=env, log=tmp_path / "serve.log")
    server.start().wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=60)
    return server, f"http://127.0.0.1:{port}"


def test_many_open_streams_leave_the_api_responsive(
    client: TestClient, settings: Settings, app_and_key: tuple[Any, str], tmp_path: Path
) -> None:
    # ~15 streams used to take the whole connection pool, so other requests waited 30 s and failed
    _, key = app_and_key
    job_ids = new_jobs(client, 4)
    paths = ["/api/gpus/stream" if i % 4 == 3 else f"/api/jobs/{job_ids[i % 4]}/stream" for i in range(80)]
    server, base = start_server(settings, tmp_path)
    try:
        took = run_coroutine(serve_with_streams(base, key, paths, probes=40))
    finally:
        server.stop(grace=10)
        server.kill_group()
    took.sort()
    p99 = took[int(0.99 * len(took))]
    assert p99 < 1.0, (
        f"GET /api/datasets with 80 streams open: p50 {took[len(took) // 2]:.3f} s, p99 {p99:.3f} s"
    )
    assert "Traceback" not in server.log.read_text(), server.tail()


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_sigterm_ends_open_streams_and_the_server_exits(
    client: TestClient, settings: Settings, app_and_key: tuple[Any, str], tmp_path: Path, processes: int
) -> None:
    _, key = app_and_key
    (job_id,) = new_jobs(client, 1)
    server, base = start_server(settings, tmp_path, "--processes", str(processes))
    assert server.proc is not None

    async def stop_with_streams_open() -> float:
        paths = [f"/api/jobs/{job_id}/stream", "/api/gpus/stream"] * processes
        http, opened = await open_streams(base, key, paths)
        try:
            assert server.proc is not None
            t = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                for _, chunks in opened:  # the server ends every stream
                    async for _ in chunks:
                        pass
                while server.proc.poll() is None:
                    await asyncio.sleep(0.05)
            return time.monotonic() - t
        finally:
            await http.aclose()

    try:
        took = run_coroutine(stop_with_streams_open())
    finally:
        server.stop(grace=1)
        server.kill_group()
    assert took < 5.0 and server.proc.returncode == 0, (took, server.proc.returncode, server.tail())
