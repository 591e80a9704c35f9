"""Jobs: creation from a validated TrainConfig, the state machine, events, paging, metrics."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from engine.config import TrainConfig
from server.kinds import METRIC_KINDS, EventKind, JobStatus
from server.services import checkpoints
from server.tables import Job, JobEvent, now

# validating -> queued -> running -> succeeded | failed | cancelled, plus cancelling and
# interrupted (the worker vanished; the job is requeued and resumes from its last checkpoint)
TRANSITIONS: dict[JobStatus, set[JobStatus]] = {
    JobStatus.VALIDATING: {JobStatus.QUEUED, JobStatus.FAILED},
    JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED},
    JobStatus.RUNNING: {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.CANCELLING,
        JobStatus.INTERRUPTED,
        JobStatus.CANCELLED,
    },
    JobStatus.CANCELLING: {JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.SUCCEEDED, JobStatus.INTERRUPTED},
    JobStatus.INTERRUPTED: {JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED},
    JobStatus.SUCCEEDED: set(),
    JobStatus.FAILED: set(),
    JobStatus.CANCELLED: set(),
}
TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
STATUSES = tuple(TRANSITIONS)
HELD = (JobStatus.RUNNING, JobStatus.CANCELLING)  # a worker holds the job (and renews its lease)
# what a person may do with a job no worker holds: resume it (the one way out of a final state:
# back to queued, from its latest checkpoint), or delete it with its files
RESUMABLE = (JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.INTERRUPTED)
DELETABLE = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.INTERRUPTED)


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
    if to in TERMINAL:
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


def new_id() -> str:
    return uuid.uuid4().hex


def build_config(
    *,
    request: dict[str, Any],
    model_path: Path | str,
    train_path: str,
    validation_path: str | None,
    output_dir: Path,
) -> TrainConfig:
    """The engine's TrainConfig for a job request. Raises ``ValueError`` naming the bad field."""
    data = dict(request.get("data") or {})
    data.update({"train": train_path, "validation": validation_path})
    raw = {
        "model": {"path": str(model_path), "name": request["base_model"]},
        "data": data,
        "output_dir": str(output_dir),
        **{k: request[k] for k in ("method", "hyper", "engine", "checkpoint", "eval") if request.get(k)},
    }
    return TrainConfig.parse(raw)


def create_job(
    session: Session,
    *,
    ident: str,
    name: str | None,
    base_model: str,
    dataset_id: str,
    dataset_name: str,
    validation_dataset_id: str | None,
    config: TrainConfig,
) -> Job:
    """Insert a job (validating), then queue it: both transitions recorded. It counts as sent:
    the caller sends its message next, or calls ``send_failed`` (the reconcile sends it later)."""
    job = Job(
        id=ident,
        name=name or default_name(session, base_model=base_model, dataset_name=dataset_name),
        status=JobStatus.VALIDATING,
        base_model=base_model,
        dataset_id=dataset_id,
        validation_dataset_id=validation_dataset_id,
        config=config.model_dump(mode="json"),
        output_dir=config.output_dir,
        sent_at=now(),
        sends=1,
    )
    session.add(job)
    session.flush()
    add_event(
        session,
        job_id=ident,
        kind=EventKind.STATE,
        message="created",
        data={"to": JobStatus.VALIDATING},
        commit=False,
    )
    transition(session, job=job, to=JobStatus.QUEUED, message="config and data valid", commit=False)
    session.commit()
    return job


def default_name(session: Session, *, base_model: str, dataset_name: str) -> str:
    """A job's name when none is given: "<model> on <dataset> HH:MM" (UTC), with the seconds
    when a job of that name exists already."""
    model = base_model.rstrip("/").rsplit("/", 1)[-1][:100]
    stamp = now()
    name = f"{model} on {dataset_name[:100]} {stamp:%H:%M}"
    if session.scalar(select(Job.id).where(Job.name == name).limit(1)) is not None:
        name = f"{model} on {dataset_name[:100]} {stamp:%H:%M:%S}"
    return name


def get_job(session: Session, *, job_id: str) -> Job | None:
    return session.get(Job, job_id)


def _cursor(job: Job) -> str:
    return base64.urlsafe_b64encode(f"{job.created_at.isoformat()}|{job.id}".encode()).decode()


def _decode(cursor: str) -> tuple[datetime, str]:
    try:
        stamp, ident = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        when = datetime.fromisoformat(stamp)
        if not ident.isprintable():  # a NUL (no id has one) would reach PostgreSQL, which refuses it
            raise ValueError(f"id {ident!r}")
        # in UTC here, as the column stores it: a stamp at the ends of the calendar overflows now
        return (when.astimezone(UTC) if when.tzinfo is not None else when), ident
    except (ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise ValueError(f"cursor {cursor!r} is not one this API returned") from exc


def list_jobs(
    session: Session, *, status: str | None, cursor: str | None, limit: int
) -> tuple[list[Job], str | None]:
    """Newest first; ``cursor`` continues after the last job of the previous page."""
    q = select(Job).order_by(Job.created_at.desc(), Job.id.desc())
    if status is not None:
        q = q.where(Job.status == status)
    if cursor is not None:
        stamp, ident = _decode(cursor)
        q = q.where((Job.created_at < stamp) | ((Job.created_at == stamp) & (Job.id < ident)))
    jobs = list(session.scalars(q.limit(limit + 1)))
    more = len(jobs) > limit
    jobs = jobs[:limit]
    return jobs, (_cursor(jobs[-1]) if more and jobs else None)


def request_cancel(session: Session, *, job: Job) -> None:
    """Queued or interrupted jobs are cancelled at once; running ones become cancelling."""
    if job.status in (JobStatus.QUEUED, JobStatus.INTERRUPTED, JobStatus.VALIDATING):
        transition(session, job=job, to=JobStatus.CANCELLED, message="cancelled before it ran")
    else:
        transition(session, job=job, to=JobStatus.CANCELLING, message="cancel requested")


def resume(session: Session, *, job: Job) -> None:
    """Queue a cancelled, failed or interrupted job again: the worker that claims it resumes from
    its latest checkpoint. Its error, finish time and restart count are cleared; its message
    counts as sent (the caller sends it, or calls ``send_failed``).

    Raises:
        IllegalTransition: the job is not resumable (naming its status).
    """
    previous = job.status
    if previous not in RESUMABLE:
        message = f"job {job.id} is {previous}: only a cancelled, failed or interrupted job can be resumed"
        raise IllegalTransition(job, JobStatus.QUEUED, message)
    taken = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == previous)
        .values(
            status=JobStatus.QUEUED,
            error=None,
            finished_at=None,
            worker_id=None,
            lease_until=None,
            retries=0,
            sent_at=now(),
            sends=Job.sends + 1,
        )
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]  # claimed, resumed or deleted meanwhile
        session.rollback()
        now_status = status_of(session, job_id=job.id) or "deleted"
        raise IllegalTransition(job, JobStatus.QUEUED, f"job {job.id} is {now_status}: it cannot be resumed")
    saved = checkpoints.list_for(session, job_id=job.id)
    start = f"the checkpoint at step {saved[-1].step}" if saved else "the start (no checkpoint yet)"
    add_event(
        session,
        job_id=job.id,
        kind=EventKind.STATE,
        message=f"{previous} -> queued: resumed, it continues from {start}",
        data={"from": previous, "to": JobStatus.QUEUED, "resumed": True},
        commit=False,
    )
    session.commit()
    session.refresh(job)


def delete_job(session: Session, *, job: Job) -> None:
    """Delete a finished or interrupted job's rows (its events and checkpoints go with it: the
    foreign keys cascade). The caller removes its folder.

    Raises:
        IllegalTransition: a worker holds the job or it waits for one: cancel it first.
    """

    def refused(status: str) -> IllegalTransition:
        wait = "wait until it is cancelled" if status == JobStatus.CANCELLING else "cancel it first"
        message = (
            f"job {job.id} is {status}: {wait}; only a succeeded, failed, cancelled or interrupted"
            " job can be deleted"
        )
        return IllegalTransition(job, "deleted", message)

    if job.status not in DELETABLE:
        raise refused(job.status)
    gone = session.execute(delete(Job).where(Job.id == job.id, Job.status.in_(DELETABLE)))
    if gone.rowcount != 1:  # type: ignore[attr-defined]  # claimed, resumed or deleted meanwhile
        session.rollback()
        now_status = status_of(session, job_id=job.id)
        if now_status is not None:
            raise refused(now_status)
    session.commit()
    session.expunge(job)


def events(session: Session, *, job_id: str, after: int, limit: int) -> list[JobEvent]:
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.id > after)
        .order_by(JobEvent.id)
        .limit(limit)
    )
    return list(session.scalars(q))


def events_of_jobs(session: Session, *, after: dict[str, int], limit: int) -> list[JobEvent]:
    """The events of several jobs in one query, each job's after its own id (``after``: job id ->
    event id), in id order: what the event streams' shared poller reads."""
    where = or_(*(and_(JobEvent.job_id == job_id, JobEvent.id > last) for job_id, last in after.items()))
    return list(session.scalars(select(JobEvent).where(where).order_by(JobEvent.id).limit(limit)))


def metric_series(
    session: Session, *, job_id: str, keys: list[str] | None
) -> dict[str, list[dict[str, Any]]]:
    """Every logged value of each metric key, in the order logged: training metrics carry their
    step; device samples (telemetry: ``gpu/*``, ``host/*``) carry only their time."""
    out: dict[str, list[dict[str, Any]]] = {}
    q = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.kind.in_(METRIC_KINDS))
        .order_by(JobEvent.id)
    )
    for ev in session.scalars(q):
        for key, value in ev.data.items():
            if (keys is None or key in keys) and isinstance(value, int | float):
                out.setdefault(key, []).append(
                    {"step": ev.step, "value": float(value), "time": ev.created_at}
                )
    return out


# -- the worker side: claim with a lease, heartbeat, progress, outcome, sweep ----------------------
CLAIMABLE = (JobStatus.QUEUED, JobStatus.INTERRUPTED)


def claim(session: Session, *, job_id: str, worker_id: str, lease_seconds: float) -> bool:
    """Take a queued or interrupted job for ``worker_id`` with one conditional update.

    A redelivered message or a second requeue finds the job already taken and gets False, so a
    job never runs twice at once.
    """
    job = session.get(Job, job_id)
    if job is None or job.status not in CLAIMABLE:
        return False
    previous = job.status
    taken = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == previous)
        .values(
            status=JobStatus.RUNNING,
            worker_id=worker_id,
            lease_until=now() + timedelta(seconds=lease_seconds),
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, now()),
        )
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    add_event(
        session,
        job_id=job_id,
        kind=EventKind.STATE,
        message=f"{previous} -> running on {worker_id}",
        data={"from": previous, "to": JobStatus.RUNNING, "worker": worker_id},
        commit=False,
    )
    session.commit()
    return True


def renew(session: Session, *, job_id: str, worker_id: str, lease_seconds: float) -> str | None:
    """Extend the lease of a job this worker holds; returns its status, or None if it was lost."""
    held = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status.in_(HELD))
        .values(lease_until=now() + timedelta(seconds=lease_seconds))
    )
    session.commit()
    if held.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return status_of(session, job_id=job_id)


def status_of(session: Session, *, job_id: str) -> str | None:
    """The job's status as stored now (None for no such job)."""
    return session.scalar(select(Job.status).where(Job.id == job_id))


def record_progress(
    session: Session, *, job_id: str, step: int, total_steps: int, commit: bool = True
) -> None:
    """The run's step counter, as the training process logs it."""
    session.execute(update(Job).where(Job.id == job_id).values(step=step, total_steps=total_steps))
    if commit:
        session.commit()


def finish(
    session: Session, *, job_id: str, worker_id: str, to: JobStatus, message: str, error: str | None = None
) -> bool:
    """Record a run's outcome, if this worker still holds the job."""
    session.expire_all()
    job = session.get(Job, job_id)
    if job is None or job.worker_id != worker_id or job.status not in HELD:
        return False
    if to == JobStatus.SUCCEEDED and job.status == JobStatus.CANCELLING:
        message = f"{message} (finished before the cancel took effect)"
    job.error = error
    job.lease_until = None
    transition(session, job=job, to=to, message=message)
    return True


def sweep(session: Session) -> list[str]:
    """Jobs whose worker stopped renewing its lease: running ones become interrupted (to requeue),
    cancelling ones cancelled. Returns the ids to requeue."""
    stamp = now()
    stale = session.scalars(select(Job).where(Job.status.in_(HELD), Job.lease_until < stamp)).all()
    requeue = []
    for job in stale:
        worker = job.worker_id
        job.lease_until = None
        if job.status == JobStatus.CANCELLING:
            transition(
                session, job=job, to=JobStatus.CANCELLED, message=f"worker {worker} vanished while cancelling"
            )
        else:
            job.sent_at = None  # it needs a new message: the reconcile sends it
            transition(
                session, job=job, to=JobStatus.INTERRUPTED, message=f"worker {worker} vanished; requeued"
            )
            requeue.append(job.id)
    return requeue


def measured_rates(session: Session, *, job_id: str) -> list[float]:
    """Every training throughput (``throughput/tokens_per_s``) the job logged, in the order logged."""
    key = "throughput/tokens_per_s"
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.METRICS)
    return [float(ev.data[key]) for ev in session.scalars(q.order_by(JobEvent.id)) if key in ev.data]


# -- the broker side: every claimable job has a message on its way (server.queue sends it) ---------
def due_sends(session: Session, *, stale_before: datetime) -> list[tuple[str, str, datetime | None]]:
    """Claimable jobs whose message may be lost: never sent (a send is pending), or last sent
    before ``stale_before`` and still not claimed; as (id, status, sent_at), oldest first."""
    q = (
        select(Job.id, Job.status, Job.sent_at)
        .where(Job.status.in_(CLAIMABLE), Job.sent_at.is_(None) | (Job.sent_at < stale_before))
        .order_by(Job.created_at)
    )
    return [(ident, status, sent_at) for ident, status, sent_at in session.execute(q)]


def take_send(session: Session, *, job_id: str, stale_before: datetime) -> int | None:
    """Take the turn to send a claimable job's message, with one conditional update, so two
    senders (the API, each worker's reconcile) never both send it. Returns the number of this
    send, or None when the job is not due (just sent by another, claimed, finished)."""
    taken = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status.in_(CLAIMABLE),
            Job.sent_at.is_(None) | (Job.sent_at < stale_before),
        )
        .values(sent_at=now(), sends=Job.sends + 1)
    )
    session.commit()
    if taken.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.scalar(select(Job.sends).where(Job.id == job_id))


def send_failed(session: Session, *, job_id: str) -> None:
    """The send taken with ``take_send`` did not reach the broker: the job's send is pending."""
    session.execute(update(Job).where(Job.id == job_id).values(sent_at=None, sends=Job.sends - 1))
    session.commit()


def record_retry(session: Session, *, job_id: str, worker_id: str) -> int | None:
    """Count one more restart of a running job's training process, if this worker holds it and
    it is not being cancelled. Returns how many restarts the job has had, None if not counted."""
    held = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == JobStatus.RUNNING)
        .values(retries=Job.retries + 1)
    )
    session.commit()
    if held.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.scalar(select(Job.retries).where(Job.id == job_id))
