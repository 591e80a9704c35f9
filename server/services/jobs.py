"""Jobs: creation from a validated TrainConfig, cancel, pause, resume and delete, events, paging,
metrics, and the worker's claim, lease and outcome (the state machine: ``job_states``)."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from engine import ConfigError, TrainConfig
from engine.methods import method_entry
from server.kinds import METRIC_KINDS, EventKind, JobStatus
from server.services import boxes, checkpoints, datasets, methods, tracking
from server.services.failures import Conflict
from server.services.job_states import DELETABLE as DELETABLE
from server.services.job_states import HELD as HELD
from server.services.job_states import RESUMABLE as RESUMABLE
from server.services.job_states import STATUSES as STATUSES
from server.services.job_states import TERMINAL as TERMINAL
from server.services.job_states import TRANSITIONS as TRANSITIONS
from server.services.job_states import IllegalTransition as IllegalTransition
from server.services.job_states import add_event as add_event
from server.services.job_states import move
from server.services.job_states import transition as transition
from server.storage import Storage
from server.tables import Dataset, Job, JobEvent, now


def new_id() -> str:
    return uuid.uuid4().hex


RUNS = "runs"  # the store's folder of jobs: runs/<job id>


def run_key(job_id: str) -> str:
    """The key of a job's folder in the store."""
    return f"{RUNS}/{job_id}"


def config_path(storage: Storage, key: str) -> str:
    """What a job's TrainConfig names a stored file or folder by: its path where the store is this
    host's folder (the engine reads it there), else its key (the worker fetches it)."""
    own = storage.local_path(key)
    return str(own) if own is not None else key


# the TrainConfig sections a job request carries as they are
SECTIONS = ("method", "hyper", "engine", "checkpoint", "eval", "tracking")


def build_config(
    *,
    request: dict[str, Any],
    model_path: Path | str,
    train_path: str,
    validation_path: str | None,
    output_dir: Path | str,
    home: Path,
    image_store: str | None = None,
) -> TrainConfig:
    """The engine's TrainConfig for a job request, by the engine's rules and the service's (a
    ``file:`` tracking URI inside ``home``: ``services.tracking``). ``image_store``: the service's
    image store when the datasets name images (``datasets.image_store``); it is the config's
    ``data.image_store`` whatever the request says. Raises ``ValueError`` naming the bad field."""
    data = dict(request.get("data") or {})
    data.update({"train": train_path, "validation": validation_path, "image_store": image_store})
    raw = {
        "model": {"path": str(model_path), "name": request["base_model"]},
        "data": data,
        "output_dir": str(output_dir),
        **{k: request[k] for k in SECTIONS if request.get(k)},
    }
    config = TrainConfig.parse(raw)
    tracking.check(config, home=home)
    return config


def check_formats(*, config: TrainConfig, train: Dataset, validation: Dataset | None) -> None:
    """A job trains on datasets of its method's data format (``GET /api/methods``): a preference
    method (DPO, ORPO) on preference datasets (rows with a preferred and a rejected answer), a
    reinforcement method (GRPO) on prompts datasets (a prompt and the fields its grader reads), a
    supervised one (``lora``, ``full``) on any other format (chat, instruction, prompt/completion,
    text).

    Raises:
        ConfigError: naming ``dataset_id``, ``validation_dataset_id`` or ``data.format``, with the
            dataset's name and format and the method.
    """
    entry = method_entry(config.method.objective)
    wanted, kind, given = entry.data_format, config.method.kind, config.data.format
    if given != "auto" and methods.dataset_kind(given) != wanted:
        takes = "a supervised format" if wanted == "supervised" else wanted
        message = f"data.format={given!r} does not suit method.kind={kind!r}: it takes {takes} (or auto)"
        raise ConfigError("data.format", message, value=given)
    for field, dataset in (("dataset_id", train), ("validation_dataset_id", validation)):
        if dataset is None:
            continue
        has = methods.dataset_kind(dataset.format)
        if has == wanted:
            continue
        if wanted != "supervised":
            why = f"is not a {wanted} dataset: {entry.name.upper()} needs {entry.needs}"
        else:
            fitting = " or ".join(repr(m) for m in methods.methods_for(has))
            why = f"is a {has} dataset: it trains with method.kind {fitting}, not {kind!r}"
        message = f"{field}: dataset {dataset.name!r} ({dataset.format}) {why}"
        raise ConfigError(field, message, value=dataset.id)


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
    output_dir: str,
) -> Job:
    """Insert a job (validating), then queue it: both transitions recorded. It counts as sent:
    the caller sends its message next, or calls ``send_failed`` (the reconcile sends it later).
    ``output_dir`` is the key of its folder in the store, ``runs/<id>``."""
    job = Job(
        id=ident,
        name=name or default_name(session, base_model=base_model, dataset_name=dataset_name),
        status=JobStatus.VALIDATING,
        base_model=base_model,
        dataset_id=dataset_id,
        validation_dataset_id=validation_dataset_id,
        config=config.model_dump(mode="json"),
        output_dir=output_dir,
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
    """Queued, interrupted or paused jobs are cancelled at once; running (or pausing) ones become
    cancelling."""
    if job.status in (JobStatus.QUEUED, JobStatus.INTERRUPTED, JobStatus.VALIDATING):
        transition(session, job=job, to=JobStatus.CANCELLED, message="cancelled before it ran")
    elif job.status == JobStatus.PAUSED:
        transition(session, job=job, to=JobStatus.CANCELLED, message="cancelled while paused")
    else:
        transition(session, job=job, to=JobStatus.CANCELLING, message="cancel requested")


def request_pause(session: Session, *, job: Job) -> None:
    """Pause a job: a running one becomes pausing (its worker stops the run at the next step
    boundary with a checkpoint at the step reached, and records it paused); a queued or
    interrupted one is paused at once. ``resume`` queues it again, from its latest checkpoint.

    Raises:
        IllegalTransition: the job cannot be paused (naming its status); also when it finished
            while the request was made (the finish stands).
    """
    for _ in range(3):  # a claim or a finish may move the job meanwhile: decide again on what it is now
        status = status_of(session, job_id=job.id) or "deleted"
        if status == JobStatus.RUNNING:
            to, message = JobStatus.PAUSING, "pause requested: it stops at the next step boundary"
        elif status in (JobStatus.QUEUED, JobStatus.INTERRUPTED):
            to, message = JobStatus.PAUSED, f"{status} -> paused while it waited for a worker"
        else:
            message = f"job {job.id} is {status}: only a queued, running or interrupted job can be paused"
            raise IllegalTransition(job, JobStatus.PAUSED, message)
        if move(session, job=job, frm=status, to=to, message=message):
            return
    raise IllegalTransition(job, JobStatus.PAUSED, f"job {job.id} keeps changing state: try again")


def resume(session: Session, *, job: Job) -> None:
    """Queue a cancelled, failed, interrupted or paused job again: the worker that claims it resumes
    from its latest checkpoint. Its error, finish time and restart count are cleared; its message
    counts as sent (the caller sends it, or calls ``send_failed``).

    Raises:
        IllegalTransition: the job is not resumable (naming its status).
        Conflict: (``file_deleted``) a dataset it trains on was deleted (naming it and its field).
    """
    previous = job.status
    if previous not in RESUMABLE:
        message = (
            f"job {job.id} is {previous}: only a cancelled, failed, interrupted or paused job can be resumed"
        )
        raise IllegalTransition(job, JobStatus.QUEUED, message)
    for field, gone in datasets.missing_files(session, job=job):
        message = f"{field}: dataset {gone.id} ({gone.filename}) was deleted: job {job.id} cannot resume"
        raise Conflict("file_deleted", message, param=field)
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
        waits: dict[str, str] = {
            JobStatus.CANCELLING: "wait until it is cancelled",
            JobStatus.PAUSING: "wait until it is paused",
        }
        wait = waits.get(status, "cancel it first")
        message = (
            f"job {job.id} is {status}: {wait}; only a succeeded, failed,"
            " cancelled, interrupted or paused job can be deleted"
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
    datasets.forget_deleted(session)  # a deleted dataset's row stays only for the jobs that name it
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


def claim(
    session: Session, *, job_id: str, worker_id: str, lease_seconds: float, host: str | None = None
) -> bool:
    """Take a queued or interrupted job for ``worker_id`` with one conditional update.

    A redelivered message or a second requeue finds the job already taken and gets False, so a
    job never runs twice at once. With ``host``, a host reserved for a job on several hosts
    (``services.boxes``) takes none.
    """
    job = session.get(Job, job_id)
    if job is None or job.status not in CLAIMABLE:
        return False
    previous = job.status
    q = update(Job).where(Job.id == job_id, Job.status == previous)
    if host is not None:
        boxes.lock_hosts(session, [host])  # after a reservation of this host in progress commits
        q = q.where(~boxes.host_reserved(host, job_id=job_id))
    taken = session.execute(
        q.values(
            status=JobStatus.RUNNING,
            worker_id=worker_id,
            lease_until=now() + timedelta(seconds=lease_seconds),
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, now()),
            estimated_finish=None,  # until this run's first step says
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


def finish(
    session: Session, *, job_id: str, worker_id: str, to: JobStatus, message: str, error: str | None = None
) -> bool:
    """Record a run's outcome, if this worker still holds the job. A run stopped on request (``to``
    cancelled) ends as requested: paused when the job is pausing, cancelled when cancelling."""
    for _ in range(3):  # a pause or cancel requested meanwhile: record the outcome over it
        session.expire_all()
        job = session.get(Job, job_id)
        if job is None or job.worker_id != worker_id or job.status not in HELD:
            return False
        held = job.status
        final = JobStatus.PAUSED if to == JobStatus.CANCELLED and held == JobStatus.PAUSING else to
        if to == JobStatus.PAUSED and held == JobStatus.CANCELLING:  # paused by a full disk: the cancel wins
            final = JobStatus.CANCELLED
        note = message
        if final == JobStatus.SUCCEEDED and held != JobStatus.RUNNING:
            request = "cancel" if held == JobStatus.CANCELLING else "pause"
            note = f"{message} (finished before the {request} took effect)"
        values = {"error": error, "lease_until": None}
        if move(session, job=job, frm=held, to=final, message=note, worker_id=worker_id, values=values):
            return True
    return False


def sweep(session: Session) -> list[str]:
    """Jobs whose worker stopped renewing its lease: running ones become interrupted (to requeue),
    cancelling ones cancelled, pausing ones paused (at their last checkpoint; never requeued).
    Returns the ids to requeue."""
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
        elif job.status == JobStatus.PAUSING:
            message = f"worker {worker} vanished while pausing: paused at its last checkpoint"
            transition(session, job=job, to=JobStatus.PAUSED, message=message)
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
