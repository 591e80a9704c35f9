"""One host's box of a job on several hosts, on the worker side.

The worker that takes the job's message reserves its hosts (``services.boxes.reserve``) and sends
each its box on its host queue (``supervisor``). ``supervise_box`` runs a box: the training
child with its rank, the run's size and the first box's rendezvous, watched as ``supervisor``
watches a job's child (cancel and pause relayed, the box's lease renewed, and for the first box
the job's lease and telemetry). The first box records the outcome and frees
the hosts; another box records only a failure of its own run. A box lost (the engine's
``BoxLost``, a child killed, a worker silent: ``services.boxes.sweep``) interrupts the run, which
resumes from its latest checkpoint on the hosts free then.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Literal

from sqlalchemy.orm import Session, sessionmaker

from server.kinds import EventKind, JobStatus
from server.services import boxes, gpus, inference, jobs
from server.settings import Settings
from server.worker import files, inference_link, network
from server.worker.supervisor import (
    POLL_S,
    STOPPING,
    TELEMETRY_S,
    Child,
    Outage,
    crashed,
    death,
    failure,
    last_checkpoint,
    push_log,
    record_unrecorded,
    release_inference,
    resume_step_of,
)
from server.worker.trainer import (
    BOX_LOST_FILE,
    EXIT_BOX_LOST,
    EXIT_CANCELLED,
    EXIT_DISK_FULL,
    EXIT_FAILED,
    EXIT_OK,
    box_argv,
)

log = logging.getLogger("roundhouse.worker")


def supervise_box(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    job_id: str,
    generation: int,
    rank: int,
    worker_id: str,
) -> str:
    """Run one host's box of a job's run to its end. Returns what happened (for the worker's log)."""
    lease = settings.lease_seconds
    with sessions() as session:
        run = boxes.reservation(session, job_id=job_id, generation=generation)
        if run is None or rank >= len(run.boxes):
            return "its run ended before it started"
        if run.boxes[rank].hostname != settings.host_name:
            return f"box {rank} is {run.boxes[rank].hostname}'s, not this host's"
        if not boxes.start(session, job_id=job_id, generation=generation, rank=rank, lease_seconds=lease):
            return "already started (a message delivered again)"
        job = jobs.get_job(session, job_id=job_id)
        output_dir = job.output_dir if job is not None else str(settings.runs_dir / job_id)
        link = inference.link_of(session, worker_id=worker_id)

    def renew() -> None:
        with sessions() as session:
            boxes.renew(session, job_id=job_id, generation=generation, rank=rank, lease_seconds=lease)
            if rank == 0:
                jobs.renew(session, job_id=job_id, worker_id=worker_id, lease_seconds=lease)

    release_inference(settings, link, renew=renew)
    try:
        return _run_box(settings, sessions, run=run, rank=rank, worker_id=worker_id, output_dir=output_dir)
    finally:
        inference_link.training(link, training=False, timeout=10.0)


def _watch(
    settings: Settings,
    sessions: sessionmaker[Session],
    child: Child,
    *,
    run: boxes.Reservation,
    rank: int,
    worker_id: str,
) -> int | str:
    """The child's exit code, or why it was stopped (its run released, the job's lease lost, the
    worker's main process gone)."""
    job_id, lease = run.job_id, settings.lease_seconds
    parent = os.getppid()
    next_renew = next_telemetry = 0.0
    outage = Outage(f"job {job_id} box {rank}")
    while (rc := child.proc.poll()) is None:
        now = time.monotonic()
        if os.getppid() != parent:
            return str(child.stop("worker main process gone; box stopped"))
        with outage, sessions() as session:
            if now >= next_renew:
                next_renew = now + lease / 3
                held = boxes.renew(
                    session, job_id=job_id, generation=run.generation, rank=rank, lease_seconds=lease
                )
                if not held:
                    return str(child.stop("its run was released (a box lost, or it ended); box stopped"))
                if (
                    rank == 0
                    and jobs.renew(session, job_id=job_id, worker_id=worker_id, lease_seconds=lease) is None
                ):
                    return str(child.stop("lease lost; box stopped"))
            status = jobs.status_of(session, job_id=job_id)
            if status in STOPPING and child.cancel_sent is None:  # every box stops at the same step
                child.proc.send_signal(signal.SIGTERM)
                child.cancel_sent = now
                if rank == 0:
                    message = (
                        f"{STOPPING[status]} relayed to the {len(run.boxes)} boxes: they stop at the next"
                    )
                    jobs.add_event(
                        session, job_id=job_id, kind=EventKind.LOG, message=f"{message} step boundary"
                    )
            if rank == 0 and now >= next_telemetry:
                next_telemetry = now + TELEMETRY_S
                sample = gpus.job_sample(session, worker_id=worker_id)
                if sample:
                    jobs.add_event(session, job_id=job_id, kind=EventKind.TELEMETRY, data=sample)
        waited = now - child.cancel_sent if child.cancel_sent is not None else 0.0
        if waited > settings.cancel_grace_seconds and not child.killed_for_cancel:
            child.proc.kill()
            child.killed_for_cancel = True
        time.sleep(POLL_S)
    return rc


def _run_box(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    run: boxes.Reservation,
    rank: int,
    worker_id: str,
    output_dir: str,
) -> str:
    job_id, me = run.job_id, run.boxes[rank]
    folder = files.run_folder(settings, output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        with sessions() as session:
            record_unrecorded(settings, session, job_id=job_id, output_dir=output_dir)
    args: list[str] = []
    if len(run.boxes) > 1:
        interface = network.endpoint(settings).interface
        args = box_argv(
            boxes=len(run.boxes),
            rank=rank,
            address=run.rendezvous,
            host=me.hostname,
            timeout_s=settings.box_timeout_seconds,
            interface=interface,
        )
    child = Child(settings, folder, job_id=job_id, args=args)
    rc = _watch(settings, sessions, child, run=run, rank=rank, worker_id=worker_id)
    if isinstance(rc, str):
        return rc
    if rank > 0:
        return _other_box_outcome(
            sessions, run=run, rank=rank, rc=rc, folder=folder, max_retries=settings.max_retries
        )
    return _first_box_outcome(
        settings,
        sessions,
        run=run,
        worker_id=worker_id,
        child=child,
        rc=rc,
        folder=folder,
        output_dir=output_dir,
    )


def _other_box_outcome(
    sessions: sessionmaker[Session],
    *,
    run: boxes.Reservation,
    rank: int,
    rc: int,
    folder: Path,
    max_retries: int,
) -> str:
    """A box other than the first records a failure of its own run (the first box then loses it
    and finds the job failed) and its own training process killed (it is the box lost); the first
    box records every other outcome."""
    me = run.boxes[rank]
    if crashed(rc):  # this box is the one lost: say so, naming it (the others may not know which)
        with sessions() as session:
            outcome = boxes.lost(
                session,
                job_id=run.job_id,
                worker_id=None,
                host=me.hostname,
                rank=rank,
                why=f"its training process was {death(rc)}",
                checkpoint_step=last_checkpoint(session, run.job_id),
                max_retries=max_retries,
            )
        return f"box {rank} lost: {outcome or 'the job had moved on'}"
    if rc not in (EXIT_FAILED, EXIT_DISK_FULL):
        with sessions() as session:
            boxes.leave(session, job_id=run.job_id, generation=run.generation, rank=rank)
        return f"box {rank} ended (exit code {rc}); the first box records the outcome"
    error = f"box {me.hostname} (rank {rank}) failed: {failure(folder, rc)}"
    with sessions() as session:
        job = jobs.get_job(session, job_id=run.job_id)
        holder = job.worker_id if job is not None else None
        recorded = holder is not None and jobs.finish(
            session,
            job_id=run.job_id,
            worker_id=holder,
            to=JobStatus.FAILED,
            message="training failed",
            error=error,
        )
        boxes.release(session, job_id=run.job_id)
    return f"failed (exit code {rc})" if recorded else f"box {rank} failed; the job had moved on"


def _which_box(
    settings: Settings, sessions: sessionmaker[Session], *, run: boxes.Reservation, worker_id: str
) -> boxes.Box | Literal[False] | None:
    """Another box was lost without its name: wait (holding the job) until the service names it:
    the box itself (its training process was killed) or the sweep (its worker went silent) records
    the loss, and None is returned; or its worker's heartbeat is stale, and it is returned. False:
    none was found in time."""
    lease, stale_after = settings.lease_seconds, settings.telemetry_seconds * 5
    deadline = time.monotonic() + 2 * lease + stale_after
    while time.monotonic() < deadline:
        with sessions() as session:
            if jobs.renew(session, job_id=run.job_id, worker_id=worker_id, lease_seconds=lease) is None:
                return None
            boxes.renew(session, job_id=run.job_id, generation=run.generation, rank=0, lease_seconds=lease)
            silent = boxes.silent_boxes(session, run=run, stale_after=stale_after)
        if silent:
            return silent[0]
        time.sleep(POLL_S)
    return False


def _first_box_outcome(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    run: boxes.Reservation,
    worker_id: str,
    child: Child,
    rc: int,
    folder: Path,
    output_dir: str,
) -> str:
    """Record the run's outcome (as ``supervisor`` does for one host), free its hosts and keep
    the link rate it measured."""
    job_id = run.job_id
    error = None
    lost: tuple[str | None, int | None, str] | None = None
    if rc == EXIT_OK:
        to, message = JobStatus.SUCCEEDED, "training finished"
    elif rc == EXIT_CANCELLED:
        to, message = JobStatus.CANCELLED, "stopped at a step boundary with a checkpoint"
    elif rc == EXIT_DISK_FULL:
        error = failure(folder, rc)
        to, message = JobStatus.PAUSED, f"paused: {error}"
    elif child.killed_for_cancel:
        to, message = JobStatus.CANCELLED, "killed after the grace period; resumes from its last checkpoint"
    elif rc == EXIT_BOX_LOST:
        try:
            said = json.loads((folder / BOX_LOST_FILE).read_text())
        except (OSError, ValueError):
            said = {}
        why = str(said.get("message") or "it stopped answering")
        if said.get("host") is None:  # the engine could not tell which: the service finds out
            which = _which_box(settings, sessions, run=run, worker_id=worker_id)
            if which is None:
                return "a box was lost: recorded by the service, naming it"
            said = {"host": which.hostname, "rank": which.rank} if which else said
        lost = (said.get("host"), said.get("rank"), why)
    elif crashed(rc):
        lost = (run.boxes[0].hostname, 0, f"its training process was {death(rc)}")
    else:
        to, message, error = JobStatus.FAILED, "training failed", failure(folder, rc)
    push_log(settings, output_dir=output_dir, folder=folder)
    with sessions() as session:
        boxes.record_link(session, job_id=job_id, hosts=[b.hostname for b in run.boxes])
        if lost is not None:
            host, rank, why = lost
            step = resume_step_of(sessions, job_id, folder)
            outcome = boxes.lost(
                session,
                job_id=job_id,
                worker_id=worker_id,
                host=host,
                rank=rank,
                why=why,
                checkpoint_step=step,
                max_retries=settings.max_retries,
            )
            log.warning("job %s lost box %s: %s", job_id, host, outcome)
            return f"box {host} lost: {outcome or 'the job had moved on'}"
        recorded = jobs.finish(
            session, job_id=job_id, worker_id=worker_id, to=to, message=message, error=error
        )
        boxes.release(session, job_id=job_id)
    return f"{to} (exit code {rc})" if recorded else f"outcome {to} not recorded: the job moved on"
