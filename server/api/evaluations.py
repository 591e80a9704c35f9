"""``/api/jobs/{id}/evaluations``: score a job's checkpoint on a dataset (on a worker), list, get."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends

from server import queue
from server.deps import IdPath, JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.schemas import EvaluationCreate, EvaluationDetail, EvaluationPublic, EvaluationsPublic
from server.services import checkpoints, datasets, evaluations

log = logging.getLogger("roundhouse.api")
router = APIRouter(
    prefix="/api/jobs",
    tags=["evaluations"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 404, 422),
)


@router.post(
    "/{job_id}/evaluations", response_model=EvaluationPublic, status_code=201, responses=documented(400, 409)
)
def create_evaluation(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, job: JobDep, body: EvaluationCreate
) -> Any:
    """Evaluate a checkpoint of the job on a dataset; a worker runs it (after the job it trains)."""
    saved = checkpoints.list_for(session, job_id=job.id, storage=storage)
    if not saved:
        raise ApiError(409, "no_checkpoint", f"job {job.id!r} has no checkpoint yet", param="checkpoint")
    if body.checkpoint == "latest":
        step = saved[-1].step
    elif body.checkpoint in {c.step for c in saved}:
        step = body.checkpoint
    else:
        steps = ", ".join(str(c.step) for c in saved)
        message = f"job {job.id!r} has no checkpoint at step {body.checkpoint} (it has {steps})"
        raise ApiError(404, "not_found", message, param="checkpoint")
    dataset = datasets.get_dataset(session, dataset_id=body.dataset_id)
    if dataset is None:
        raise ApiError(404, "not_found", f"no dataset {body.dataset_id!r}", param="dataset_id")
    row = evaluations.create(
        session,
        job_id=job.id,
        step=step,
        dataset_id=dataset.id,
        max_rows=body.max_rows,
        max_new_tokens=body.max_new_tokens,
        num_samples=body.num_samples,
    )
    try:
        queue.send_evaluation(settings, row.id)
    except Exception:  # the broker is down: it stays queued; a worker sends it again when it starts
        log.exception("evaluation %s: the queue is unreachable", row.id)
    return row


@router.get("/{job_id}/evaluations", response_model=EvaluationsPublic)
def list_evaluations(session: SessionDep, job: JobDep) -> Any:
    """The job's evaluations, newest first, with their metrics."""
    return {"data": evaluations.list_for(session, job_id=job.id)}


@router.get("/{job_id}/evaluations/{evaluation_id}", response_model=EvaluationDetail)
def get_evaluation(session: SessionDep, storage: StorageDep, job: JobDep, evaluation_id: IdPath) -> Any:
    """One evaluation: its metrics and the sample outputs next to their references."""
    row = evaluations.get(session, evaluation_id=evaluation_id, job_id=job.id)
    if row is None:
        raise ApiError(
            404, "not_found", f"job {job.id!r} has no evaluation {evaluation_id!r}", param="evaluation_id"
        )
    result = evaluations.read_result(row, storage)
    detail = EvaluationPublic.model_validate(row).model_dump()
    return detail | {"samples": (result or {}).get("samples", []), "stored": result is not None}
