"""The job state machine: the statuses a job may go to from each, and the transitions recorded as
event rows (a plain one, and a conditional one for races with the worker)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from server.kinds import EventKind, JobStatus
from server.tables import Job, JobEvent, now

# validating -> queued -> running -> succeeded | failed | cancelled, plus cancelling, interrupted
# (the worker vanished; the job is requeued and resumes from its last checkpoint), and pausing ->
# paused (stopped at a step boundary with a checkpoint; resume queues it again from there)
TRANSITIONS: dict[JobStatus, set[JobStatus]] = {
    JobStatus.VALIDATING: {JobStatus.QUEUED, JobStatus.FAILED},
    JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.PAUSED},
    # paused by the worker itself: a checkpoint did not fit on the disk
    JobStatus.RUNNING: {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.CANCELLING,
        JobStatus.PAUSING,
        JobStatus.INTERRUPTED,
        JobStatus.CANCELLED,
        JobStatus.PAUSED,
    },
    JobStatus.CANCELLING: {JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.SUCCEEDED, JobStatus.INTERRUPTED},
    # a run that finishes or dies before its pause takes effect keeps that outcome
    JobStatus.PAUSING: {
        JobStatus.PAUSED,
        JobStatus.FAILED,
        JobStatus.SUCCEEDED,
        JobStatus.INTERRUPTED,
        JobStatus.CANCELLING,
    },
    JobStatus.PAUSED: {JobStatus.QUEUED, JobStatus.CANCELLED},
    JobStatus.INTERRUPTED: {
        JobStatus.QUEUED,
        JobStatus.RUNNING,
        JobStatus.CANCELLED,
        JobStatus.FAILED,
        JobStatus.PAUSED,
    },
    JobStatus.SUCCEEDED: set(),
    JobStatus.FAILED: set(),
    JobStatus.CANCELLED: set(),
}
TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
STATUSES = tuple(TRANSITIONS)
# the statuses that set finished_at: the final ones, and paused (when it stopped; a resume clears it)
STOPPED = TERMINAL | {JobStatus.PAUSED}
# a worker holds the job (and renews its lease)
HELD = (JobStatus.RUNNING, JobStatus.CANCELLING, JobStatus.PAUSING)
# what a person may do with a job no worker holds: resume it (back to queued, from its latest
# checkpoint; the one way out of a final state), or delete it with its files
RESUMABLE = (JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.INTERRUPTED, JobStatus.PAUSED)
DELETABLE = (
    JobStatus.SUCCEEDED,
    JobStatus.FAILED,
    JobStatus.CANCELLED,
    JobStatus.INTERRUPTED,
    JobStatus.PAUSED,
)


class IllegalTransition(Exception):
    def __init__(self, job: Job, to: str, message: str | None = None) -> None:
        super().__init__(message or f"job {job.id} is {job.status}: it cannot become {to}")
        self.job, self.to = job, to


def transition(session: Session, *, job: Job, to: JobStatus, message: str = "", commit: bool = True) -> None:
    """Move a job to ``to`` and record the transition as an event row.

    Raises:
        IllegalTransition: ``to`` is not reachable from the job's status.
    """
    if to not in TRANSITIONS[JobStatus(job.status)]:
        raise IllegalTransition(job, to)
    previous, job.status = job.status, to
    if to == JobStatus.RUNNING and job.started_at is None:
        job.started_at = now()
    if to in STOPPED:
        job.finished_at = now()
    add_event(
        session,
        job_id=job.id,
        kind=EventKind.STATE,
        message=message or f"{previous} -> {to}",
        data={"from": previous, "to": to},
        commit=False,
    )
    if commit:
        session.commit()


def add_event(
    session: Session,
    *,
    job_id: str,
    kind: str,
    message: str = "",
    data: dict[str, Any] | None = None,
    step: int | None = None,
    commit: bool = True,
) -> JobEvent:
    """Record an event: ``kind`` is an ``EventKind`` (the engine's sink events keep their own name)."""
    event = JobEvent(job_id=job_id, kind=kind, message=message, data=data or {}, step=step)
    session.add(event)
    if commit:
        session.commit()
    return event


def move(
    session: Session,
    *,
    job: Job,
    frm: str,
    to: JobStatus,
    message: str,
    worker_id: str | None = None,
    values: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
) -> bool:
    """``transition`` as one conditional update: from ``frm`` (and held by ``worker_id`` when
    given), also setting ``values``; ``data`` is added to its event's. False, and nothing
    written, when the job moved on meanwhile (a worker claimed or finished it, a person
    cancelled it).

    Raises:
        IllegalTransition: ``to`` is not reachable from ``frm``.
    """
    if to not in TRANSITIONS[JobStatus(frm)]:
        raise IllegalTransition(job, to, f"job {job.id} is {frm}: it cannot become {to}")
    changes: dict[str, Any] = {"status": to, **(values or {})}
    if to in STOPPED:
        changes["finished_at"] = now()
    q = update(Job).where(Job.id == job.id, Job.status == frm)
    if worker_id is not None:
        q = q.where(Job.worker_id == worker_id)
    if session.execute(q.values(**changes)).rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    recorded = {"from": frm, "to": to, **(data or {})}
    add_event(session, job_id=job.id, kind=EventKind.STATE, message=message, data=recorded, commit=False)
    session.commit()
    session.expire(job)
    return True
