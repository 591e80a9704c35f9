"""``/api/jobs``: create, list, get, cancel, pause, resume, delete, events (paged and as an SSE stream),
metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from engine.errors import ConfigError
from server import queue
from server.deps import JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.kinds import EventKind, JobStatus
from server.schemas import (
    EVENT_STREAM,
    MAX_INT,
    EventsPublic,
    JobCreate,
    JobPublic,
    JobsPublic,
    MetricsPublic,
)
from server.services import datasets, disk, gpus, jobs, models, placement
from server.settings import Settings
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


def send(session: Session, settings: Settings, job_id: str) -> None:
    """Send a queued job to the workers; if the broker is down the job is kept, and a worker's
    reconcile sends it when the broker answers."""
    job = jobs.get_job(session, job_id=job_id)
    try:
        queue.enqueue(settings, job_id, where=job.placement if job is not None else None)
    except Exception as exc:
        jobs.send_failed(session, job_id=job_id)
        jobs.add_event(
            session,
            job_id=job_id,
            kind=EventKind.LOG,
            message=f"the job queue is unreachable ({exc}); the job is sent when it answers",
            data={"send_pending": True},
        )


@router.post("", response_model=JobPublic, status_code=201, responses=documented(400, 404))
def create_job(session: SessionDep, settings: SettingsDep, storage: StorageDep, body: JobCreate) -> Any:
    """Start a fine-tune: a base model, a dataset, and the TrainConfig sections."""
    return public(submit(session, settings, body, storage=storage), storage)


def submit(session: Session, settings: Settings, body: JobCreate, *, storage: Storage) -> Job:
    """Check a job request (base model, datasets, TrainConfig), store the job queued and send it:
    what ``POST /api/jobs`` and ``POST /v1/fine_tuning/jobs`` do. Raises ``ApiError`` naming the field."""
    model = models.find(body.base_model, settings.models_dir, settings.hf_cache_dir)
    if model is None:
        raise ApiError(
            404, "not_found", f"no base model {body.base_model!r} (see GET /api/models)", param="base_model"
        )
    if not model.supported:  # refused now, not failed later by the worker
        raise ApiError(
            422,
            "unsupported_model",
            f"base model {body.base_model!r} cannot be fine-tuned: {model.unsupported_reason}",
            param="base_model",
        )
    train = datasets.get_dataset(session, dataset_id=body.dataset_id)
    if train is None:
        raise ApiError(404, "not_found", f"no dataset {body.dataset_id!r}", param="dataset_id")
    validation = None
    if body.validation_dataset_id is not None:
        validation = datasets.get_dataset(session, dataset_id=body.validation_dataset_id)
        if validation is None:
            raise ApiError(
                404, "not_found", f"no dataset {body.validation_dataset_id!r}", param="validation_dataset_id"
            )
    ident = jobs.new_id()
    output_dir = jobs.run_key(ident)
    try:
        config = jobs.build_config(
            request=body.model_dump(),
            model_path=model.path if model.path is not None else body.base_model,
            train_path=jobs.config_path(storage, storage.key_of(train.path)),
            validation_path=jobs.config_path(storage, storage.key_of(validation.path))
            if validation
            else None,
            output_dir=jobs.config_path(storage, output_dir),
        )
        jobs.check_formats(config=config, train=train, validation=validation)  # dpo: preference data
    except ValueError as exc:
        param = exc.field if isinstance(exc, ConfigError) else None
        raise ApiError(422, "invalid_config", str(exc), param=param) from exc
    job = jobs.create_job(
        session,
        ident=ident,
        name=body.name,
        base_model=body.base_model,
        dataset_id=train.id,
        dataset_name=train.name,
        validation_dataset_id=validation.id if validation else None,
        config=config,
        output_dir=output_dir,
    )
    where = placement.normalized(body.placement.model_dump() if body.placement else None)
    if where is not None:
        placement.record(
            session,
            job=job,
            where=where,
            hosts=gpus.hosts(session, stale_after=settings.telemetry_seconds * 5),
        )
    send(session, settings, job.id)
    return job


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
    try:
        jobs.request_cancel(session, job=job)
    except jobs.IllegalTransition as exc:
        raise ApiError(409, "illegal_transition", str(exc), param="status") from exc
    return public(job, storage)


@router.post("/{job_id}/pause", response_model=JobPublic, responses=documented(404, 409))
def pause_job(session: SessionDep, storage: StorageDep, job: JobDep) -> Any:
    """Pause: a queued job at once; a running one stops at its next step with a checkpoint."""
    try:
        jobs.request_pause(session, job=job)
    except jobs.IllegalTransition as exc:
        raise ApiError(409, "illegal_transition", str(exc), param="status") from exc
    return public(job, storage)


@router.post("/{job_id}/resume", response_model=JobPublic, responses=documented(404, 409))
def resume_job(session: SessionDep, settings: SettingsDep, storage: StorageDep, job: JobDep) -> Any:
    """Resume a cancelled, failed, interrupted or paused job: queued again, from its latest checkpoint."""
    try:
        jobs.resume(session, job=job)
    except jobs.IllegalTransition as exc:
        raise ApiError(409, "illegal_transition", str(exc), param="status") from exc
    send(session, settings, job.id)
    return public(job, storage)


@router.delete("/{job_id}", status_code=204, response_class=Response, responses=documented(404, 409))
def delete_job(session: SessionDep, storage: StorageDep, job: JobDep) -> Response:
    """Delete a finished or interrupted job with its events, checkpoints and files."""
    folder = job.output_dir
    try:
        jobs.delete_job(session, job=job)
    except jobs.IllegalTransition as exc:
        raise ApiError(409, "illegal_transition", str(exc), param="status") from exc
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
