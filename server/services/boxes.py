"""Jobs on several hosts (``placement.hosts``): the hosts reserved for a run, all at once or none.

A worker that takes such a job's message reserves its hosts in one transaction (``reserve``): the
job goes to running, held by its first box's worker, and one ``JobBox`` row per host names its
rank, worker and address. A host holds one row at most (a unique column), and a host whose worker
holds a job, or that is stale, is not taken, so nothing is reserved unless every host is. Rank 0 is
the host that wrote the job's latest checkpoint when it is free (its checkpoint is on its disk),
else the first by name; its address and rendezvous port are the run's rendezvous. Each box renews
its row; a box silent past its lease is lost (``sweep``), as is one the engine reports
(``lost``): the job is interrupted, naming the host, its rows released, and it is sent again to
resume from its latest checkpoint on the hosts free then (down to ``min_hosts``). "auto" takes the
free hosts up to what the job's batch gives work to (``batch_hosts``), and a job whose batch cannot
be shared out over the hosts it asks for is refused when it is submitted (``check_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from engine import ConfigError, TrainConfig
from engine.distributed import required_rows
from engine.planner import Workload, max_hosts
from server.kinds import EventKind, JobStatus
from server.services import gpus, placement
from server.services.job_states import HELD, add_event, move
from server.tables import Job, JobBox, JobEvent, Worker, now

BOXES_EVENT = "boxes"  # the engine's event at a run's start: data {"hosts", "link_gbps", "gradient_bytes"}
# a reserved box's first lease: long enough for its worker to take its task from the broker
START_LEASES = 3


@dataclass(frozen=True)
class Box:
    """One reserved host of a run, as its worker's task reads it."""

    rank: int
    hostname: str
    worker_id: str
    address: str
    port: int


@dataclass(frozen=True)
class Reservation:
    """A run's hosts by rank; the rendezvous is rank 0's ``address:port``."""

    job_id: str
    generation: int
    boxes: list[Box]

    @property
    def rendezvous(self) -> str:
        first = self.boxes[0]
        return f"{first.address}:{first.port}"


def _held_rows(session: Session) -> Any:
    """The rows of runs in progress (a job held by a worker)."""
    return select(JobBox).join(Job, Job.id == JobBox.job_id).where(Job.status.in_(HELD))


def host_reserved(host: str, *, job_id: str | None = None) -> Any:
    """A SQL condition: ``host`` is reserved for a run in progress (of a job other than ``job_id``)."""
    held = select(Job.id).where(Job.id == JobBox.job_id, Job.status.in_(HELD)).exists()
    condition = exists().where(JobBox.hostname == host, held)
    if job_id is not None:
        condition = exists().where(JobBox.hostname == host, JobBox.job_id != job_id, held)
    return condition


def lock_hosts(session: Session, hosts: list[str]) -> None:
    """Lock the hosts' worker rows until the transaction ends (PostgreSQL; SQLite has one writer
    at a time): a reservation and a claim of the same host take turns, so each sees what the
    other committed."""
    if hosts:
        session.execute(
            select(Worker.id)
            .where(Worker.hostname.in_(sorted(set(hosts))))
            .order_by(Worker.id)
            .with_for_update()
        ).all()


def busy_hosts(session: Session, *, job_id: str) -> set[str]:
    """Hosts that run another job now: reserved for a run, or whose worker holds a job."""
    reserved = {row.hostname for row in session.scalars(_held_rows(session).where(JobBox.job_id != job_id))}
    holders = select(Job.worker_id).where(Job.status.in_(HELD), Job.id != job_id)
    running = set(session.scalars(select(Worker.hostname).where(Worker.id.in_(holders))))
    return reserved | running


def previous_writer(session: Session, *, job_id: str) -> str | None:
    """The host that was rank 0 of the job's last run on several hosts (it wrote its checkpoints)."""
    q = (
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == BOXES_EVENT)
        .order_by(JobEvent.id.desc())
        .limit(1)
    )
    data = session.scalar(q)
    hosts = (data or {}).get("hosts") or []
    return str(hosts[0]) if hosts else None


def _waiting(session: Session, *, job: Job, message: str, data: dict[str, Any]) -> None:
    """A log event saying what the job waits for, unless its latest log event says the same."""
    q = select(JobEvent.message).where(JobEvent.job_id == job.id, JobEvent.kind == EventKind.LOG)
    if session.scalar(q.order_by(JobEvent.id.desc()).limit(1)) != message:
        add_event(session, job_id=job.id, kind=EventKind.LOG, message=message, data=data)


def batch_hosts(config: TrainConfig) -> int:
    """The most boxes the job's batch gives work to: the planner's ``max_hosts``, fewer while the
    engine would refuse the batch shared out over them (``required_rows``: a GRPO job's prompts'
    completions must also fill each box's micro-batches)."""
    most = max_hosts(Workload.from_train_config(config))
    while most > 1:
        try:
            required_rows(config, most)
        except ConfigError:
            most -= 1
        else:
            break
    return most


def check_batch(config: TrainConfig, where: dict[str, Any] | None) -> None:
    """Refuse a job whose batch cannot be shared out over the boxes its placement asks for:
    ``hosts`` (N > 1), or for "auto" its ``min_hosts`` (the fewest it may run on).

    Raises:
        ConfigError: (field ``hyper.batch_size``) the engine's refusal, with the placement named.
    """
    where = where or {}
    hosts = where.get("hosts")
    boxes = int(where.get("min_hosts") or 1) if hosts == placement.AUTO else int(hosts or 1)
    if boxes < 2:
        return
    try:
        required_rows(config, boxes)
    except ConfigError as exc:
        asked = f"placement.hosts={hosts!r}" + (
            f" with placement.min_hosts={boxes}" if hosts == placement.AUTO else ""
        )
        raise ConfigError(exc.field, f"{exc} for {asked}", value=exc.value) from exc


def reserve(session: Session, *, job: Job, lease_seconds: float, stale_after: float) -> Reservation | None:
    """Reserve the hosts of a claimable job on several hosts and move it to running, in one
    transaction; or reserve nothing (a log event says what it waits for) and return None: fewer
    free online hosts fit it than it needs, or another worker took a host or the job meanwhile."""
    session.execute(delete(JobBox).where(JobBox.job_id == job.id))  # a run of before that ended
    stale = select(Job.id).where(Job.status.in_(HELD))
    session.execute(delete(JobBox).where(JobBox.job_id.not_in(stale)))
    where = job.placement or {}
    fitting: list[dict[str, Any]] = []
    for host in gpus.by_host(gpus.hosts(session, stale_after=stale_after)):
        worker = host["workers"][0]
        fit = placement.fits(where, host=host["hostname"], gpus=len(worker["devices"]))
        if host["online"] and worker["address"] and fit:
            fitting.append(worker)
    lock_hosts(session, [w["hostname"] for w in fitting])  # a claim on one of them waits for this
    busy = busy_hosts(session, job_id=job.id)
    free = [w for w in fitting if w["hostname"] not in busy]
    fewest, most = placement.host_range(where, online=len(free))
    if where.get("hosts") == placement.AUTO:  # no more boxes than the batch gives work to
        most = max(fewest, min(most, batch_hosts(TrainConfig.model_validate(job.config))))
    if len(free) < fewest:
        session.rollback()
        names = ", ".join(w["hostname"] for w in free) or "none"
        message = f"waiting for {placement.describe(where)}: {len(free)} free now ({names})"
        _waiting(session, job=job, message=message, data={"waiting": True, "free_hosts": len(free)})
        return None
    writer = previous_writer(session, job_id=job.id)
    free.sort(key=lambda w: (w["hostname"] != writer, w["hostname"]))
    chosen = free[:most]
    first = chosen[0]
    generation, previous = job.attempts + 1, job.status
    stamp = now()
    taken = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == previous)
        .values(
            status=JobStatus.RUNNING,
            worker_id=first["worker"],
            lease_until=stamp + timedelta(seconds=lease_seconds * START_LEASES),
            attempts=generation,
            started_at=job.started_at or stamp,
            estimated_finish=None,
        )
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]  # claimed, cancelled or paused meanwhile
        session.rollback()
        return None
    boxes = [
        Box(rank, w["hostname"], w["worker"], str(w["address"]), int(w["rendezvous_port"]))
        for rank, w in enumerate(chosen)
    ]
    until = stamp + timedelta(seconds=lease_seconds * START_LEASES)
    for box in boxes:
        session.add(
            JobBox(
                job_id=job.id,
                generation=generation,
                rank=box.rank,
                hostname=box.hostname,
                worker_id=box.worker_id,
                address=box.address,
                port=box.port,
                lease_until=until,
            )
        )
    try:
        session.flush()
    except IntegrityError:  # a host reserved by another worker meanwhile: nothing is kept
        session.rollback()
        return None
    names = ", ".join(f"{b.hostname} (rank {b.rank})" for b in boxes)
    add_event(
        session,
        job_id=job.id,
        kind=EventKind.STATE,
        message=f"{previous} -> running on {len(boxes)} host{'s' if len(boxes) > 1 else ''}: {names}",
        data={
            "from": previous,
            "to": JobStatus.RUNNING,
            "worker": first["worker"],
            "boxes": [{"rank": b.rank, "host": b.hostname, "worker": b.worker_id} for b in boxes],
            "rendezvous": f"{first['address']}:{first['rendezvous_port']}",
        },
        commit=False,
    )
    session.commit()
    return Reservation(job.id, generation, boxes)


def reservation(session: Session, *, job_id: str, generation: int) -> Reservation | None:
    """The run's reservation, while it holds its hosts."""
    rows = session.scalars(
        select(JobBox).where(JobBox.job_id == job_id, JobBox.generation == generation).order_by(JobBox.rank)
    ).all()
    if not rows:
        return None
    boxes = [Box(r.rank, r.hostname, r.worker_id, r.address, r.port) for r in rows]
    return Reservation(job_id, generation, boxes)


def start(session: Session, *, job_id: str, generation: int, rank: int, lease_seconds: float) -> bool:
    """Mark a box's task started (once: a redelivered message gets False) and renew its lease."""
    started = session.execute(
        update(JobBox)
        .where(
            JobBox.job_id == job_id,
            JobBox.generation == generation,
            JobBox.rank == rank,
            JobBox.started_at.is_(None),
        )
        .values(started_at=now(), lease_until=now() + timedelta(seconds=lease_seconds))
    )
    session.commit()
    return started.rowcount == 1  # type: ignore[attr-defined]


def renew(session: Session, *, job_id: str, generation: int, rank: int, lease_seconds: float) -> bool:
    """Extend a box's lease; False once its reservation was released (the run ended or was lost)."""
    held = session.execute(
        update(JobBox)
        .where(JobBox.job_id == job_id, JobBox.generation == generation, JobBox.rank == rank)
        .values(lease_until=now() + timedelta(seconds=lease_seconds))
    )
    session.commit()
    return held.rowcount == 1  # type: ignore[attr-defined]


def leave(session: Session, *, job_id: str, generation: int, rank: int) -> None:
    """A box whose part ended (its run finished, or it lost another box) frees its host: a box
    silent past its lease is then one that died (``sweep``), never one that is done."""
    session.execute(
        delete(JobBox).where(JobBox.job_id == job_id, JobBox.generation == generation, JobBox.rank == rank)
    )
    session.commit()


def silent_boxes(session: Session, *, run: Reservation, stale_after: float) -> list[Box]:
    """The run's boxes whose worker stopped sampling ``stale_after`` seconds ago or more."""
    limit = now() - timedelta(seconds=stale_after)
    ids = [b.worker_id for b in run.boxes]
    stale = set(session.scalars(select(Worker.id).where(Worker.id.in_(ids), Worker.heartbeat_at < limit)))
    return [b for b in run.boxes if b.worker_id in stale]


def release(session: Session, *, job_id: str, commit: bool = True) -> None:
    """Free the job's hosts."""
    session.execute(delete(JobBox).where(JobBox.job_id == job_id))
    if commit:
        session.commit()


def lost(
    session: Session,
    *,
    job_id: str,
    worker_id: str | None,
    host: str | None,
    rank: int | None,
    why: str,
    checkpoint_step: int | None,
    max_retries: int,
) -> str | None:
    """A box of a run in progress was lost: the run stops and its hosts are freed. A running job is
    interrupted and sent again (it resumes from ``checkpoint_step`` on the hosts free then), or
    fails after ``max_retries`` losses in a row; a pausing one is paused, a cancelling one
    cancelled. ``worker_id``: the run's holder (None: whoever holds it). Returns the status
    recorded, None when the job had moved on."""
    session.expire_all()
    job = session.get(Job, job_id)
    if job is None or job.status not in HELD or (worker_id is not None and job.worker_id != worker_id):
        release(session, job_id=job_id)
        return None
    box = f"box {host or 'unknown'}" + (f" (rank {rank})" if rank is not None else "")
    start = f"the checkpoint at step {checkpoint_step}" if checkpoint_step is not None else "the start"
    data: dict[str, Any] = {"box_lost": host, "rank": rank, "checkpoint_step": checkpoint_step}
    values: dict[str, Any] = {"lease_until": None}
    if job.status == JobStatus.PAUSING:
        to, message = JobStatus.PAUSED, f"{box} lost while pausing: {why}; paused at {start}"
    elif job.status == JobStatus.CANCELLING:
        to, message = JobStatus.CANCELLED, f"{box} lost while cancelling: {why}"
    elif job.retries >= max_retries:
        to, message = JobStatus.FAILED, f"{box} lost: {why}; {job.retries + 1} runs lost a box, no more tries"
        values["error"] = message
    else:
        to = JobStatus.INTERRUPTED
        message = f"{box} lost: {why}; paused at {start}, sent again to resume there on the hosts free"
        values |= {"sent_at": None, "retries": job.retries + 1}
    moved = move(session, job=job, frm=job.status, to=to, message=message, values=values, data=data)
    release(session, job_id=job_id)
    return str(to) if moved else None


def sweep(session: Session) -> list[str]:
    """Runs with a box whose worker stopped renewing its lease (it died or lost its network): each
    is stopped as ``lost`` says. Rows of runs that ended are deleted. Returns the ids to send again."""
    session.execute(delete(JobBox).where(JobBox.job_id.not_in(select(Job.id).where(Job.status.in_(HELD)))))
    session.commit()
    silent = session.scalars(_held_rows(session).where(JobBox.lease_until < now())).all()
    again = []
    for job_id in sorted({row.job_id for row in silent}):
        row = min((r for r in silent if r.job_id == job_id), key=lambda r: r.rank)
        checkpoint = session.scalar(
            select(JobEvent.step)
            .where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.CHECKPOINT)
            .order_by(JobEvent.id.desc())
            .limit(1)
        )
        outcome = lost(
            session,
            job_id=job_id,
            worker_id=None,
            host=row.hostname,
            rank=row.rank,
            why=f"its worker {row.worker_id} stopped answering",
            checkpoint_step=checkpoint,
            max_retries=1 << 30,  # a vanished worker is not the run's fault: as ``jobs.sweep``
        )
        if outcome == JobStatus.INTERRUPTED:
            again.append(job_id)
    return again


def record_link(session: Session, *, job_id: str, hosts: list[str]) -> float | None:
    """The all-reduce rate a run measured (its ``exchange/gbps`` metrics' median, else its
    ``boxes`` event's ``link_gbps``), stored on its hosts' workers. Returns it (None: none logged)."""
    q = select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.METRICS)
    rates = sorted(float(d["exchange/gbps"]) for d in session.scalars(q) if "exchange/gbps" in d)
    rate = rates[len(rates) // 2] if rates else None
    if rate is None:
        q = select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == BOXES_EVENT)
        data = session.scalar(q.order_by(JobEvent.id.desc()).limit(1))
        rate = float(data["link_gbps"]) if data and data.get("link_gbps") is not None else None
    if rate is not None and hosts:
        session.execute(update(Worker).where(Worker.hostname.in_(hosts)).values(link_measured_gbps=rate))
        session.commit()
    return rate
