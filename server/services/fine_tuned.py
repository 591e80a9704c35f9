"""Fine-tuned models by name, as the OpenAI-compatible API gives them: a job's model
``ft:<base model>:<suffix or roundhouse>:<job id>`` (its latest checkpoint) and a checkpoint's
``...:ckpt-step-<step>``. The playground and the download route take these names."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.kinds import JobStatus
from server.services import checkpoints
from server.storage import Storage
from server.tables import Checkpoint, Job

ORGANIZATION = "roundhouse"  # every job's organization_id, and the owner of its fine-tuned model
STEP = "ckpt-step-"


def model_name(job: Job) -> str:
    return f"ft:{job.base_model}:{job.suffix or ORGANIZATION}:{job.id}"


def checkpoint_name(job: Job, step: int) -> str:
    return f"{model_name(job)}:{STEP}{step}"


def parse_model(name: str) -> tuple[str, int | None] | None:
    """The job id and checkpoint step (None: the latest) a fine-tuned model's name gives; None
    for a name that is not one (a base model's)."""
    parts = name.split(":")
    if parts[0] != "ft" or len(parts) < 4:
        return None
    step = None
    if parts[-1].startswith(STEP):
        number = parts.pop().removeprefix(STEP)
        if not (number.isascii() and number.isdigit() and len(number) <= 10) or len(parts) < 4:
            return None
        step = int(number)
    return parts[-1], step


def resolve_model(session: Session, *, name: str, storage: Storage | None = None) -> tuple[Job, Checkpoint]:
    """The job and checkpoint a fine-tuned model's name stands for (with ``storage``: one in it).

    Raises:
        LookupError: no such job or checkpoint (the name must be the one the API gave).
    """
    parsed = parse_model(name)
    job = session.get(Job, parsed[0]) if parsed is not None else None
    step = parsed[1] if parsed is not None else None
    if job is None or name != (model_name(job) if step is None else checkpoint_name(job, step)):
        raise LookupError(f"no fine-tuned model {name!r} (see GET /v1/models)")
    if step is None:
        saved = checkpoints.list_for(session, job_id=job.id, storage=storage)
        if not saved:
            raise LookupError(f"{name!r}: job {job.id} has no checkpoint yet")
        return job, saved[-1]
    found = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if found is None:
        raise LookupError(f"{name!r}: job {job.id} has no checkpoint at step {step}")
    return job, found


def fine_tuned_jobs(session: Session) -> list[Job]:
    """The succeeded jobs, newest first: each is a fine-tuned model."""
    q = select(Job).where(Job.status == JobStatus.SUCCEEDED).order_by(Job.created_at.desc())
    return list(session.scalars(q))
