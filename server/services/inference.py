"""Finding the workers' inference services (``server/worker/inference.py``) and talking to one.

Each worker records its service's URL and token in its ``workers`` row. The API picks an online
one, preferring a host where no job trains (its GPUs are free), and forwards a request there as
one NDJSON stream (``open_stream``); the supervisor finds its own worker's (``link_of``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from server.kinds import JobStatus
from server.tables import Job, Worker, now

RETRY_AFTER_S = 10  # what a 503 suggests when no worker serves inference
READ_TIMEOUT_S = 60.0  # the service sends a line at least every 10 s while it answers


@dataclass(frozen=True)
class Service:
    url: str
    token: str
    worker: str


class Unavailable(RuntimeError):
    """The service cannot take the request: HTTP ``status``, OpenAI's ``code``, ``retry_after`` s."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.retry_after = (
            status,
            code,
            message,
            param,
            retry_after,
        )


def link_of(session: Session, *, worker_id: str) -> Service | None:
    """The inference service of worker ``worker_id``, as its last sample recorded it."""
    row = session.get(Worker, worker_id)
    if row is None or not row.inference_url or not row.inference_token:
        return None
    return Service(row.inference_url, row.inference_token, row.id)


def pick(session: Session, *, stale_after: float) -> Service:
    """An online worker's service: one whose host trains no job if there is one, else any.

    Raises:
        Unavailable: (503) no online worker runs one.
    """
    since = now() - timedelta(seconds=stale_after)
    rows = session.scalars(
        select(Worker)
        .where(Worker.heartbeat_at >= since, Worker.inference_url.is_not(None))
        .order_by(Worker.heartbeat_at.desc())
    ).all()
    if not rows:
        raise Unavailable(
            503,
            "no_inference_worker",
            "no worker runs to answer: start one (`roundhouse worker`, or `roundhouse serve --with-worker`)",
            param="model",
            retry_after=RETRY_AFTER_S,
        )
    running = (
        select(Worker.hostname).join(Job, Job.worker_id == Worker.id).where(Job.status == JobStatus.RUNNING)
    )
    busy = set(session.scalars(running))
    row = next((r for r in rows if r.hostname not in busy), rows[0])
    return Service(str(row.inference_url), str(row.inference_token), row.id)


async def open_stream(
    client: httpx.AsyncClient, service: Service, payload: dict[str, Any]
) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
    """Forward ``payload`` to the service's ``/generate``: its ``start`` line and the rest of the
    lines (``token``, ``end``) as they come. Closing the iterator closes the connection, which
    cancels the answer there.

    Raises:
        Unavailable: the service refused it (its status and code) or cannot be reached (503).
    """
    request = client.build_request(
        "POST",
        f"{service.url}/generate",
        json=payload,
        headers={"Authorization": f"Bearer {service.token}"},
        timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0),
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise Unavailable(
            503,
            "inference_unavailable",
            f"the worker's inference service did not answer: {exc}",
            retry_after=RETRY_AFTER_S,
        ) from exc
    if response.status_code != 200:
        body = await response.aread()
        await response.aclose()
        try:
            error = json.loads(body)
        except ValueError:
            error = {"message": body.decode(errors="replace")[:500]}
        retry = response.headers.get("Retry-After")
        raise Unavailable(
            response.status_code,
            str(error.get("code") or "inference_failed"),
            str(error.get("message") or "the inference service failed"),
            param=error.get("param"),
            retry_after=int(retry) if retry and retry.isdigit() else None,
        )
    lines = response.aiter_lines()
    try:
        first = json.loads(await anext(lines))
    except (StopAsyncIteration, ValueError, httpx.HTTPError) as exc:
        await response.aclose()
        raise Unavailable(
            503, "inference_unavailable", f"the inference service broke off: {exc}", retry_after=RETRY_AFTER_S
        ) from exc

    async def rest() -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in lines:
                if line:
                    event = json.loads(line)
                    if event.get("type") != "ping":
                        yield event
        finally:
            await response.aclose()

    return first, rest()
