"""``/api/jobs``: create, list, get, cancel, pause, resume, delete, events (paged and as an SSE stream),
metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from server.deps import JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.kinds import JobStatus
from server.schemas import (
    EVENT_STREAM,
    MAX_INT,
    EventsPublic,
    JobCreate,
    JobPublic,
    JobsPublic,
    MetricsPublic,
)
from server.services import disk, jobs, submission
from server.storage import Storage
from server.streams import job_stream, stream_job
from server.tables import Job

router = APIRouter(
    prefix="/api/jobs", tags=["jobs"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)
# the stream checks the key and the job with a session of its own (``stream_job``), not the
# router's: an open stream holds no database connection
stream_router = APIRouter(prefix="/api/jobs", tags=["jobs"], responses=documented(401, 422))


def public(job: Job, storage: Storage) -> JobPublic:
    """The job as the API shows it, with the bytes of its folder (cached: ``services.disk``)."""
    shown = JobPublic.model_validate(job)
    shown.disk_bytes = disk.job_bytes(storage, job.output_dir)
    return shown


@router.post("", response_model=JobPublic, status_code=201, responses=documented(400, 404))
def create_job(session: SessionDep, settings: SettingsDep, storage: StorageDep, body: JobCreate) -> Any:
    """Start a fine-tune: a base model, a dataset, and the TrainConfig sections."""
    return public(submission.submit(session, request=body, settings=settings, storage=storage), storage)


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    storage: StorageDep,
    status: Annotated[JobStatus | None, Query(description="only jobs in this state")] = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> Any:
    """Jobs, newest first, paged by cursor."""
    try:
        page, next_cursor = jobs.list_jobs(session, status=status, cursor=cursor, limit=limit)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"cursor: {exc}", param="cursor") from exc
    return {"data": [public(j, storage) for j in page], "next_cursor": next_cursor}


@router.get("/{job_id}", response_model=JobPublic, responses=documented(404))
def get_job(storage: StorageDep, job: JobDep) -> Any:
    """One job."""
    return public(job, storage)


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=documented(404, 409))
def cancel_job(session: SessionDep, storage: StorageDep, job: JobDep) -> Any:
    """Cancel: a queued job at once; a running one stops at its next step with a checkpoint."""
    jobs.request_cancel(session, job=job)
    return public(job, storage)


@router.post("/{job_id}/pause", response_model=JobPublic, responses=documented(404, 409))
def pause_job(session: SessionDep, storage: StorageDep, job: JobDep) -> Any:
    """Pause: a queued job at once; a running one stops at its next step with a checkpoint."""
    jobs.request_pause(session, job=job)
    return public(job, storage)


@router.post("/{job_id}/resume", response_model=JobPublic, responses=documented(404, 409))
def resume_job(session: SessionDep, settings: SettingsDep, storage: StorageDep, job: JobDep) -> Any:
    """Resume a cancelled, failed, interrupted or paused job: queued again, from its latest checkpoint."""
    jobs.resume(session, job=job)
    submission.send(session, settings=settings, job_id=job.id)
    return public(job, storage)


@router.delete("/{job_id}", status_code=204, response_class=Response, responses=documented(404, 409))
def delete_job(session: SessionDep, storage: StorageDep, job: JobDep) -> Response:
    """Delete a finished or interrupted job with its events, checkpoints and files."""
    folder = job.output_dir
    jobs.delete_job(session, job=job)
    disk.remove_job_folder(storage, folder, job_id=job.id)
    return Response(status_code=204)


@router.get("/{job_id}/events", response_model=EventsPublic, responses=documented(404))
def list_events(
    session: SessionDep,
    job: JobDep,
    after: Annotated[int, Query(ge=0, le=MAX_INT, description="only events with a larger id")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Any:
    """The job's events (state changes, metrics, telemetry, log lines, checkpoints) in id order."""
    page = jobs.events(session, job_id=job.id, after=after, limit=limit)
    return {"data": page, "next_after": page[-1].id if len(page) == limit else None}


def resume_after(last_event_id: str | None, after: int) -> int:
    """Where a stream starts: the ``Last-Event-ID`` an ``EventSource`` sends back when it is an id
    this API could have sent (ASCII digits, within the id column's range), else ``after``."""
    given = last_event_id or ""
    if given.isascii() and given.isdigit() and len(given) <= len(str(MAX_INT)) and int(given) <= MAX_INT:
        return int(given)
    return after


@stream_router.get(
    "/{job_id}/stream",
    response_class=StreamingResponse,
    responses={200: EVENT_STREAM, **documented(404)},
)
def stream_events(
    request: Request,
    job_id: Annotated[str, Depends(stream_job)],
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
) -> StreamingResponse:
    """Server-sent events of the job, replayed from ``Last-Event-ID`` (or ``after``), then live."""
    start = resume_after(last_event_id, after)
    return StreamingResponse(
        job_stream(request.app.state.streams, job_id=job_id, after=start),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=documented(404))
def get_metrics(
    session: SessionDep,
    job: JobDep,
    keys: Annotated[list[str], Query(default_factory=list, description="metric names, e.g. loss/train")],
) -> Any:
    """Every logged value of each metric, in step order."""
    return {"data": jobs.metric_series(session, job_id=job.id, keys=keys or None)}
