"""``/v1/fine_tuning/jobs``: OpenAI's fine-tuning API over our jobs (created the way
``POST /api/jobs`` creates them, run by the same workers)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy.orm import Session

from server.api.openai.shapes import (
    AUTO_DEFAULTS,
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobCreate,
    FineTuningJobEventList,
    FineTuningJobList,
    Hyperparameters,
    RoundhouseOptions,
    documented,
)
from server.deps import IdPath, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError
from server.schemas import JobCreate
from server.services import datasets, integrations, jobs, openai_compat, submission
from server.services.failures import Conflict, Refusal
from server.services.openai_compat import FILE, JOB
from server.tables import Dataset, Job

router = APIRouter(
    prefix="/v1/fine_tuning/jobs",
    tags=["openai"],
    dependencies=[Depends(current_key)],
    responses=documented(400, 401),
)
After = Annotated[str | None, Query(max_length=255, description="the last id of the previous page")]


def found_job(session: SessionDep, fine_tuning_job_id: IdPath) -> Job:
    """The job a ``{fine_tuning_job_id}`` names (``ftjob-<job id>``, or the job id), or the 404."""
    job = jobs.get_job(session, job_id=openai_compat.ours(fine_tuning_job_id, JOB))
    if job is None:
        message = f"no fine-tuning job {fine_tuning_job_id!r}"
        raise ApiError(404, "not_found", message, param="fine_tuning_job_id")
    return job


JobDep = Annotated[Job, Depends(found_job)]


def _file(session: SessionDep, ident: str, param: str) -> Dataset:
    found = datasets.get_dataset(session, dataset_id=openai_compat.ours(ident, FILE))
    if found is None:
        raise ApiError(400, "invalid_file", f"no file {ident!r} (see GET /v1/files)", param=param)
    return found


def _hyperparameters(body: FineTuningJobCreate, method_type: str) -> dict[str, Any]:
    """The request's hyperparameters: the method's, else the deprecated top-level ones."""
    chosen: Hyperparameters | None = body.hyperparameters
    options = getattr(body.method, method_type, None) if body.method is not None else None
    if options is not None and options.hyperparameters is not None:
        chosen = options.hyperparameters
    return chosen.model_dump() if chosen is not None else {}


@router.post(
    "",
    response_model=FineTuningJob,
    description=f"Checked and queued as POST /api/jobs does. {AUTO_DEFAULTS}. Our extension, roundhouse, "
    "holds the TrainConfig sections of POST /api/jobs (LoRA rank, engine settings, max_steps, ...).",
)
def create_job(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, body: FineTuningJobCreate
) -> Any:
    """Create a fine-tuning job."""
    request, method_type, given = job_request(session, body)
    try:
        job = submission.submit(session, request=request, settings=settings, storage=storage)
    except Refusal as exc:  # named as the OpenAI request names it; a missing base model is a 400
        raise named(exc, method_type=method_type, given=given) from exc
    openai_compat.label(session, job=job, metadata=body.metadata, suffix=body.suffix)
    return openai_compat.job_object(job)


def job_request(session: Session, body: FineTuningJobCreate) -> tuple[JobCreate, str, set[str]]:
    """The ``POST /api/jobs`` body of an OpenAI request, its method type and the hyperparameters
    it gave (for naming a refused field as the request names it)."""
    try:
        tracking = integrations.tracking_section(body.integrations)
    except Refusal as exc:
        raise ApiError(400, exc.code, exc.message, param=exc.param) from exc
    train = _file(session, body.training_file, "training_file")
    validation = _file(session, body.validation_file, "validation_file") if body.validation_file else None
    method_type = body.method.type if body.method is not None else "supervised"
    options = body.roundhouse or RoundhouseOptions()
    hyperparameters = _hyperparameters(body, method_type)
    given = {k for k, v in hyperparameters.items() if v != "auto"} | (
        {"seed"} if body.seed is not None else set()
    )
    reinforcement = body.method.reinforcement if body.method is not None else None
    grader = reinforcement.grader if reinforcement is not None and method_type == "reinforcement" else None
    try:
        sections = openai_compat.train_sections(
            method_type=method_type,
            hyperparameters=hyperparameters,
            seed=body.seed,
            options=options.model_dump(),
            grader=grader,
        )
    except openai_compat.Invalid as exc:
        raise ApiError(400, "invalid_request", str(exc), param=exc.param) from exc
    name = jobs.default_name(session, base_model=body.model, dataset_name=train.name)
    request = JobCreate(
        name=f"{body.suffix}: {name}"[:255] if body.suffix else None,
        base_model=body.model,
        dataset_id=train.id,
        validation_dataset_id=validation.id if validation else None,
        data=options.data,
        method=sections["method"],
        hyper=sections["hyper"],
        engine=options.engine,
        checkpoint=options.checkpoint,
        eval=sections["eval"],
        tracking=tracking,
    )
    return request, method_type, given


def named(exc: Refusal, *, method_type: str, given: set[str]) -> ApiError:
    """A refusal of the job as a 400 naming the field as the OpenAI request names it."""
    param = openai_compat.request_param(exc.param, method_type=method_type, given=given)
    message = exc.message
    if exc.param and param != exc.param and message.startswith(f"{exc.param}:"):
        message = f"{param}:{message.removeprefix(f'{exc.param}:')}"
    return ApiError(400, exc.code, message, param=param)


def metadata_filter(request: Request) -> tuple[dict[str, str], bool]:
    """``metadata[key]=value`` pairs of the query, and whether it asks for ``metadata=null``."""
    pairs, without = {}, False
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            name = key[len("metadata[") : -1]
            if not 0 < len(name) <= 64 or '"' in name or "\\" in name:
                message = f"{key}: a key of 1 to 64 characters, without a quote or backslash"
                raise ApiError(400, "invalid_request", message, param="metadata")
            pairs[name] = value
        elif key == "metadata":
            if value != "null":
                raise ApiError(
                    400, "invalid_request", "metadata: give metadata[key]=value, or null", param="metadata"
                )
            without = True
    if pairs and without:
        raise ApiError(
            400, "invalid_request", "metadata: null and metadata[key] do not go together", param="metadata"
        )
    return pairs, without


@router.get("", response_model=FineTuningJobList)
def list_jobs(
    session: SessionDep,
    request: Request,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Any:
    """Fine-tuning jobs, newest first; ``metadata[key]=value`` keeps those with that pair."""
    pairs, without = metadata_filter(request)
    try:
        page, more = openai_compat.page_jobs(
            session, after=after, limit=limit, metadata=pairs, without_metadata=without
        )
    except openai_compat.Invalid as exc:
        raise ApiError(400, "invalid_request", str(exc), param=exc.param) from exc
    return {"object": "list", "data": [openai_compat.job_object(j) for j in page], "has_more": more}


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob, responses=documented(404))
def retrieve_job(job: JobDep) -> Any:
    """One fine-tuning job."""
    return openai_compat.job_object(job)


@router.post("/{fine_tuning_job_id}/cancel", response_model=FineTuningJob, responses=documented(404, 409))
def cancel_job(session: SessionDep, job: JobDep) -> Any:
    """Cancel: a queued or paused job at once; a running one stops at its next step."""
    jobs.request_cancel(session, job=job)
    return openai_compat.job_object(job)


@router.post("/{fine_tuning_job_id}/pause", response_model=FineTuningJob, responses=documented(404, 409))
def pause_job(session: SessionDep, job: JobDep) -> Any:
    """Pause: a running job stops at its next step with a checkpoint (it shows running until then)."""
    jobs.request_pause(session, job=job)
    session.refresh(job)
    return openai_compat.job_object(job)


@router.post("/{fine_tuning_job_id}/resume", response_model=FineTuningJob, responses=documented(404, 409))
def resume_job(session: SessionDep, settings: SettingsDep, job: JobDep) -> Any:
    """Resume a paused (or cancelled, failed) job: queued again, from its latest checkpoint."""
    try:
        jobs.resume(session, job=job)
    except Conflict as exc:  # a file it trains on was deleted: named as the request names it
        gone = datasets.missing_files(session, job=job)
        if exc.code != "file_deleted" or not gone:
            raise
        field, dataset = gone[0]
        param = openai_compat.PARAMS[field]
        message = (
            f"{param} {FILE + dataset.id!r} ({dataset.filename}) was deleted: {JOB + job.id} cannot "
            "resume; create a new job with a new file"
        )
        raise ApiError(409, "file_deleted", message, param=param) from exc
    submission.send(session, settings=settings, job_id=job.id)
    return openai_compat.job_object(job)


@router.get("/{fine_tuning_job_id}/events", response_model=FineTuningJobEventList, responses=documented(404))
def list_events(
    session: SessionDep,
    job: JobDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> Any:
    """The job's events, newest first: state changes, metrics of each step, log lines, checkpoints."""
    try:
        before = openai_compat.event_number(after) if after is not None else None
    except openai_compat.Invalid as exc:
        raise ApiError(400, "invalid_request", str(exc), param=exc.param) from exc
    page, more = openai_compat.page_events(session, job_id=job.id, after=before, limit=limit)
    return {
        "object": "list",
        "data": [openai_compat.event_object(e, total_steps=job.total_steps) for e in page],
        "has_more": more,
    }


@router.get(
    "/{fine_tuning_job_id}/checkpoints", response_model=FineTuningJobCheckpointList, responses=documented(404)
)
def list_checkpoints(
    session: SessionDep,
    storage: StorageDep,
    job: JobDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> Any:
    """The job's checkpoints on disk, the latest first; each names a model the playground runs."""
    try:
        page, more = openai_compat.page_checkpoints(
            session, job=job, after=after, limit=limit, storage=storage
        )
    except openai_compat.Invalid as exc:
        raise ApiError(400, "invalid_request", str(exc), param=exc.param) from exc
    data = [openai_compat.checkpoint_object(job, c) for c in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "has_more": more, "first_id": first, "last_id": last}
