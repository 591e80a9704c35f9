"""``/api/gpus``: every worker host's devices, as a list and as an SSE stream."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.deps import SessionDep, SettingsDep, current_key
from server.errors import documented
from server.schemas import EVENT_STREAM, HostsPublic
from server.services import gpus
from server.streams import gpu_stream, stream_key

router = APIRouter(
    prefix="/api/gpus", tags=["gpus"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)
# the stream checks the key with a session of its own: an open stream holds no database connection
stream_router = APIRouter(
    prefix="/api/gpus", tags=["gpus"], dependencies=[Depends(stream_key)], responses=documented(401, 422)
)


@router.get("", response_model=HostsPublic)
def list_gpus(session: SessionDep, settings: SettingsDep) -> Any:
    """The latest telemetry sample of every worker ("no GPU" on CPU-only hosts), and per host."""
    workers = gpus.hosts(session, stale_after=settings.telemetry_seconds * 5)
    return {"data": workers, "hosts": gpus.by_host(workers)}


@stream_router.get("/stream", response_class=StreamingResponse, responses={200: EVENT_STREAM})
def stream_gpus(request: Request) -> StreamingResponse:
    """Server-sent events: a new snapshot of every host each time a worker samples."""
    return StreamingResponse(
        gpu_stream(request.app.state.streams),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
