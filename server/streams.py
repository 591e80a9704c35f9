"""Server-sent event streams: a job's events (replayable by id) and the GPU hosts' telemetry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from server.services import gpus, jobs

POLL_S = 0.5
KEEPALIVE_S = 15.0


def frame(*, data: Any, event: str | None = None, ident: int | None = None) -> str:
    lines = []
    if ident is not None:
        lines.append(f"id: {ident}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append(f"data: {json.dumps(data, default=str)}")
    return "\n".join(lines) + "\n\n"


def _with_session(request: Request, fn: Callable[..., Any], **kwargs: Any) -> Any:
    with request.app.state.sessions() as session:
        return fn(session, **kwargs)


def _job_page(session: Any, *, job_id: str, after: int) -> tuple[list[dict[str, Any]], str | None]:
    page = jobs.events(session, job_id=job_id, after=after, limit=500)
    job = jobs.get_job(session, job_id=job_id)
    rows = [
        {
            "id": e.id,
            "kind": e.kind,
            "step": e.step,
            "message": e.message,
            "data": e.data,
            "created_at": e.created_at.isoformat(),
        }
        for e in page
    ]
    return rows, (job.status if job is not None else None)


async def job_stream(request: Request, *, job_id: str, after: int) -> AsyncIterator[str]:
    """Every event after ``after``, then new ones as they are written; ends after a final state.

    Each event is sent under its kind (``event: metrics``, ``event: telemetry``...: ``EventKind``)."""
    yield "retry: 2000\n\n"
    idle = 0.0
    while not await request.is_disconnected():
        rows, status = await run_in_threadpool(_with_session, request, _job_page, job_id=job_id, after=after)
        for row in rows:
            after = row["id"]
            yield frame(data=row, event=row["kind"], ident=row["id"])
        if rows:
            idle = 0.0
            continue
        if status is None or status in jobs.TERMINAL:
            yield frame(data={"status": status}, event="end")
            return
        await asyncio.sleep(POLL_S)
        idle += POLL_S
        if idle >= KEEPALIVE_S:
            idle = 0.0
            yield ": keep-alive\n\n"


async def gpu_stream(request: Request, *, interval: float) -> AsyncIterator[str]:
    """A snapshot of every worker host's devices, each time the worker samples them."""
    yield "retry: 2000\n\n"
    last = None
    idle = 0.0
    while not await request.is_disconnected():
        hosts = await run_in_threadpool(_with_session, request, gpus.hosts, stale_after=interval * 5)
        snapshot = json.dumps(hosts, default=str, sort_keys=True)
        if snapshot != last:
            last, idle = snapshot, 0.0
            yield f"event: gpus\ndata: {snapshot}\n\n"
        await asyncio.sleep(interval / 2)
        idle += interval / 2
        if idle >= KEEPALIVE_S:
            idle = 0.0
            yield ": keep-alive\n\n"
