"""The task's body: claim the job, run the training child, relay cancel and pause, record the outcome.

Runs in the Celery pool process. It never imports torch: the child is a fresh interpreter, so
a crash or an out-of-memory kill there leaves the worker alive.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from engine import training as layout
from server import queue
from server.db import unavailable
from server.kinds import EventKind, JobStatus
from server.services import boxes, checkpoints, gpus, inference, jobs, placement
from server.settings import Settings
from server.tables import Job
from server.worker import files, inference_link, network
from server.worker.children import die_with_parent
from server.worker.telemetry import count_gpus
from server.worker.trainer import ERROR_FILE, EXIT_CANCELLED, EXIT_DISK_FULL, EXIT_FAILED, EXIT_OK

log = logging.getLogger("roundhouse.worker")
POLL_S = 0.5
TELEMETRY_S = 10.0  # how often a job records its host's latest sample


def crashed(rc: int) -> bool:
    """Killed by a signal (the out-of-memory killer's SIGKILL, a segfault) or an exit code the
    trainer never uses: worth a restart. ``EXIT_FAILED`` is an exception inside the run (bad data,
    a bad config), which would only happen again."""
    return rc < 0 or rc not in (EXIT_OK, EXIT_FAILED, EXIT_CANCELLED, EXIT_DISK_FULL)


def death(rc: int) -> str:
    if rc < 0:
        hint = " (out of host memory?)" if -rc == signal.SIGKILL else ""
        return f"killed by {signal.Signals(-rc).name}{hint}"
    return f"exited with code {rc}"


def failure(folder: Path, rc: int) -> str:
    reason = folder / ERROR_FILE
    if reason.is_file():
        return reason.read_text().strip()
    return f"the training process {death(rc)}; see train.log"


def last_checkpoint(session: Session, job_id: str) -> int | None:
    saved = checkpoints.list_for(session, job_id=job_id)
    return saved[-1].step if saved else None


def _resume_step(session: Session, job_id: str, folder: Path) -> int | None:
    """The step a restarted run resumes from: the latest checkpoint recorded for the job, or a later
    one complete on this host's disk whose row the killed process had no time to record."""
    recorded = last_checkpoint(session, job_id)
    on_disk = layout.latest(layout.checkpoints_dir(folder))
    steps = [s for s in (recorded, on_disk[0] if on_disk else None) if s is not None]
    return max(steps) if steps else None


def resume_step_of(sessions: sessionmaker[Session], job_id: str, folder: Path) -> int | None:
    with sessions() as session:
        return _resume_step(session, job_id, folder)


def record_unrecorded(settings: Settings, session: Session, *, job_id: str, output_dir: str) -> list[int]:
    """Give a row to each complete checkpoint in the job's folder of the local store that is newer
    than its latest row: the process that wrote it was killed before it recorded it (a crash, a
    power cut). Returns their steps. (With a remote store a checkpoint counts once it is pushed:
    ``files.pull_checkpoint`` drops local ones no row names.)"""
    store = files.open_store(settings)
    folder = files.run_folder(settings, output_dir)
    if not files.same_file(store.local_path(output_dir) if files.is_key(output_dir) else None, folder):
        return []
    last = last_checkpoint(session, job_id)
    found = []
    for step, path in layout.list_checkpoints(layout.checkpoints_dir(folder)):
        if last is not None and step <= last:
            continue
        kind = str(layout.kind_of(path))
        key = f"{layout.checkpoints_key(output_dir)}/{path.name}"
        checkpoints.record(session, job_id=job_id, step=step, path=key, kind=kind, metrics={}, storage=store)
        jobs.add_event(
            session,
            job_id=job_id,
            kind=EventKind.CHECKPOINT,
            message=f"recorded {path.name}: complete on disk, its row lost when its process was killed",
            data={"step": step, "path": key, "recovered": True},
            step=step,
        )
        found.append(step)
    return found


class _Stopped(Exception):
    """The supervisor stopped the child: its lease was lost, or the worker's main process died."""


# the statuses whose run stops at its next step boundary with a checkpoint: the engine's cancel,
# relayed as SIGTERM; the outcome is recorded as the request (``jobs.finish``: cancelled or paused)
STOPPING: dict[str, str] = {JobStatus.CANCELLING: "cancel", JobStatus.PAUSING: "pause"}


class Outage:
    """``with`` it around a use of the database that may wait for the next try: a database that
    cannot be reached (``db.unavailable``) is logged when it goes and when it is back, not raised."""

    def __init__(self, what: str) -> None:
        self.what, self.away = what, False

    def __enter__(self) -> Outage:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            if self.away:
                log.warning("%s: the database is back", self.what)
            self.away = False
            return False
        if not (isinstance(exc, DBAPIError) and unavailable(exc)):
            return False
        if not self.away:
            log.warning("%s: the database is unavailable, trying again: %s", self.what, exc.orig)
        self.away = True
        return True


class Child:
    """One training process of a job, watched until it exits: the lease renewed, a cancel or pause
    relayed (SIGTERM, then a kill after the grace period), the host's telemetry recorded. While
    the database is away the watch goes on without them (the training process keeps its writes)
    and renews the lease as soon as it is back."""

    def __init__(
        self, settings: Settings, folder: Path, *, job_id: str, args: list[str] | None = None
    ) -> None:
        """``args``: the trainer's options after the job id (a box of a run on several hosts)."""
        env = {**os.environ, **settings.child_environment()}
        with (folder / "train.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.worker.trainer", job_id, *(args or [])],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent,
            )
        self.cancel_sent: float | None = None
        self.killed_for_cancel = False

    def stop(self, why: str) -> _Stopped:
        self.proc.kill()
        self.proc.wait()
        return _Stopped(why)

    def watch(
        self, settings: Settings, sessions: sessionmaker[Session], *, job_id: str, worker_id: str
    ) -> int:
        """Wait for the exit code.

        Raises:
            _Stopped: the lease was lost or the worker's main process died; the child is killed.
        """
        parent = os.getppid()
        renew_every = settings.lease_seconds / 3
        next_renew = next_telemetry = 0.0
        outage = Outage(f"job {job_id}")
        while (rc := self.proc.poll()) is None:
            now = time.monotonic()
            if os.getppid() != parent:  # the worker's main process died: stop, the sweep requeues
                raise self.stop("worker main process gone; child stopped")
            with outage, sessions() as session:
                if now >= next_renew:
                    status = jobs.renew(
                        session, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds
                    )
                    next_renew = now + renew_every
                    if status is None:
                        raise self.stop("lease lost; child stopped")
                else:
                    status = jobs.status_of(session, job_id=job_id)
                if status in STOPPING and self.cancel_sent is None:
                    self.proc.send_signal(signal.SIGTERM)
                    self.cancel_sent = now
                    jobs.add_event(
                        session,
                        job_id=job_id,
                        kind=EventKind.LOG,
                        message=f"{STOPPING[status]} relayed to the training process: it stops at the next"
                        " step boundary with a checkpoint",
                    )
                if now >= next_telemetry:
                    next_telemetry = now + TELEMETRY_S
                    sample = gpus.job_sample(session, worker_id=worker_id)
                    if sample:
                        jobs.add_event(
                            session, job_id=job_id, kind=EventKind.TELEMETRY, data=sample, step=None
                        )
            if (
                self.cancel_sent is not None
                and not self.killed_for_cancel
                and now - self.cancel_sent > settings.cancel_grace_seconds
            ):
                self.proc.kill()
                self.killed_for_cancel = True
            time.sleep(POLL_S)
        return rc


def _restart(
    settings: Settings, session: Session, *, job_id: str, worker_id: str, rc: int, folder: Path
) -> str | None:
    """After a crash: count a restart and record it, or, past ``max_retries`` (or when the job is
    no longer this worker's to run), return why the job fails."""
    session.expire_all()
    job = jobs.get_job(session, job_id=job_id)
    step = _resume_step(session, job_id, folder)
    done = job.retries if job is not None else 0
    retry = (
        jobs.record_retry(session, job_id=job_id, worker_id=worker_id)
        if done < settings.max_retries
        else None
    )
    if retry is None:
        times = f"{done + 1} time{'s' if done else ''}"
        where = f"last checkpoint step {step}" if step is not None else "no checkpoint yet"
        return f"the training process was {death(rc)} {times}; {where}; see train.log"
    start = f"the checkpoint at step {step}" if step is not None else "the start (no checkpoint yet)"
    data: dict[str, object] = {
        "retry": retry,
        "max_retries": settings.max_retries,
        "exit_code": rc,
        "checkpoint_step": step,
    }
    if rc < 0:
        data["signal"] = signal.Signals(-rc).name
    jobs.add_event(
        session,
        job_id=job_id,
        kind=EventKind.LOG,
        message=f"the training process was {death(rc)}: restarted from {start}"
        f" (retry {retry} of {settings.max_retries})",
        data=data,
    )
    log.warning("job %s: training process %s; retry %d from step %s", job_id, death(rc), retry, step)
    return None


def push_log(settings: Settings, *, output_dir: str, folder: Path) -> None:
    """The run's train.log to a remote store; a failure is logged, never the job's outcome."""
    try:
        files.push_log(files.open_store(settings), output_dir=output_dir, folder=folder)
    except Exception:
        log.exception("could not push %s/train.log to the store", output_dir)


def supervise(settings: Settings, sessions: sessionmaker[Session], *, job_id: str, worker_id: str) -> str:
    """Run one job to its outcome. Returns what happened (for the worker's log).

    A training process that crashes (killed by a signal: the out-of-memory killer) is started
    again, up to ``max_retries`` times per job; it resumes from the job's latest checkpoint."""
    with sessions() as session:
        job = jobs.get_job(session, job_id=job_id)
        where = job.placement if job is not None else None
        if placement.several(where) and job is not None:  # any worker reserves its hosts for it
            return _reserve_boxes(settings, session, job=job)
        gpu_count = settings.worker_gpus if settings.worker_gpus is not None else count_gpus()
        if not placement.fits(where, host=settings.host_name, gpus=gpu_count):
            # a message that reached the wrong worker: left for one that fits (the reconcile resends it)
            wanted = placement.describe(where)
            if job is not None and job.status in jobs.CLAIMABLE:
                here = f"{worker_id} (host {settings.host_name}, {gpu_count} GPU(s))"
                message = f"{here} cannot run it: waiting for {wanted}"
                jobs.add_event(
                    session, job_id=job_id, kind=EventKind.LOG, message=message, data={"waiting": True}
                )
            return f"not for this worker: the job wants {wanted}"
        lease, host = settings.lease_seconds, settings.host_name
        if not jobs.claim(session, job_id=job_id, worker_id=worker_id, lease_seconds=lease, host=host):
            return "not claimable (taken, finished, cancelled, or this host is reserved for another)"
        job = jobs.get_job(session, job_id=job_id)
        output_dir = job.output_dir if job is not None else str(settings.runs_dir / job_id)
    with sessions() as session:
        link = inference.link_of(session, worker_id=worker_id)
    lease = settings.lease_seconds

    def renew() -> None:
        with sessions() as session:
            jobs.renew(session, job_id=job_id, worker_id=worker_id, lease_seconds=lease)

    release_inference(settings, link, renew=renew)
    try:
        return _run(settings, sessions, job_id=job_id, worker_id=worker_id, output_dir=output_dir)
    finally:
        inference_link.training(link, training=False, timeout=10.0)


def _reserve_boxes(settings: Settings, session: Session, *, job: Job) -> str:
    """A job on several hosts: reserve its hosts and send each its box (``worker.boxes``)."""
    if job.status not in jobs.CLAIMABLE:
        return "not claimable (taken, finished or cancelled)"
    lease, stale_after = settings.lease_seconds, settings.telemetry_seconds * 5
    run = boxes.reserve(session, job=job, lease_seconds=lease, stale_after=stale_after)
    if run is None:
        return "its hosts are not free: nothing reserved"
    for box in run.boxes:  # a send lost: that box's lease runs out and the run is sent again
        queue.send_box(settings, job.id, generation=run.generation, rank=box.rank, host=box.hostname)
    return f"reserved {', '.join(b.hostname for b in run.boxes)}; rendezvous {run.rendezvous}"


def release_inference(
    settings: Settings, link: inference.Service | None, *, renew: Callable[[], None]
) -> None:
    """Tell this host's inference service that a job takes the devices, and wait until it has let
    go of them (answers in flight finish within ``inference_release_seconds``), calling ``renew``
    (the lease) meanwhile."""
    if link is None:
        return
    timeout = settings.inference_release_seconds + 30.0
    thread = threading.Thread(
        target=inference_link.training, args=(link,), kwargs={"training": True, "timeout": timeout}
    )
    thread.start()
    while thread.is_alive():
        thread.join(settings.lease_seconds / 3)
        renew()


def _run(
    settings: Settings, sessions: sessionmaker[Session], *, job_id: str, worker_id: str, output_dir: str
) -> str:
    """The training processes of a claimed job, until its outcome is recorded."""
    folder = files.run_folder(settings, output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        with sessions() as session:
            record_unrecorded(settings, session, job_id=job_id, output_dir=output_dir)
        child = Child(settings, folder, job_id=job_id)
        try:
            rc = child.watch(settings, sessions, job_id=job_id, worker_id=worker_id)
        except _Stopped as stopped:
            push_log(settings, output_dir=output_dir, folder=folder)
            return str(stopped)
        error = None
        if rc == EXIT_OK:
            to, message = JobStatus.SUCCEEDED, "training finished"
        # stopped on request: jobs.finish records it cancelled, or paused when the job is pausing
        elif rc == EXIT_CANCELLED:
            with sessions() as session:
                step = last_checkpoint(session, job_id)
            saved = f"a checkpoint at step {step}" if step is not None else "no checkpoint (before a step)"
            to, message = JobStatus.CANCELLED, f"stopped at a step boundary with {saved}"
        elif rc == EXIT_DISK_FULL:  # its checkpoints before are intact: resume once space is freed
            step = resume_step_of(sessions, job_id, folder)
            saved = f"the checkpoint at step {step}" if step is not None else "the start (no checkpoint yet)"
            to, message = JobStatus.PAUSED, f"paused: {failure(folder, rc)}; a resume continues from {saved}"
            error = failure(folder, rc)
        elif child.killed_for_cancel:
            to, message = (
                JobStatus.CANCELLED,
                "killed after the grace period; resumes from its last checkpoint",
            )
        elif rc == -signal.SIGTERM and child.cancel_sent is not None:
            # the request reached the training process before it could handle it (it handles
            # SIGTERM from its first line): it trained nothing
            to, message = JobStatus.CANCELLED, "stopped before the training started"
        elif crashed(rc) and child.cancel_sent is None:
            with sessions() as session:
                error = _restart(settings, session, job_id=job_id, worker_id=worker_id, rc=rc, folder=folder)
            if error is None:
                continue
            to, message = JobStatus.FAILED, "training failed"
        else:
            to, message, error = JobStatus.FAILED, "training failed", failure(folder, rc)
        push_log(settings, output_dir=output_dir, folder=folder)
        with sessions() as session:
            recorded = jobs.finish(
                session, job_id=job_id, worker_id=worker_id, to=to, message=message, error=error
            )
        return f"{to} (exit code {rc})" if recorded else f"outcome {to} not recorded: the job moved on"


def telemetry_loop(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    worker_id: str,
    stop: threading.Event,
    inference: tuple[str, str] | None = None,
) -> None:
    """The worker's housekeeping thread: sample devices, requeue jobs of vanished workers, and
    send every claimable job whose message is pending or the broker lost (``queue.reconcile``):
    a worker that starts picks up everything queued, whatever the broker kept."""
    from server.queue import reconcile
    from server.worker.telemetry import Sampler

    sampler = Sampler()
    hostname = settings.host_name
    endpoint = network.endpoint(settings)
    next_sweep = 0.0
    try:
        while not stop.is_set():
            try:
                devices, cpu, message = sampler.sample()
                with sessions() as session:
                    gpus.record(
                        session,
                        worker_id=worker_id,
                        hostname=hostname,
                        devices=devices,
                        cpu=cpu,
                        message=message,
                        inference=inference,
                        endpoint=endpoint,
                    )
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + settings.lease_seconds / 2
                        for job_id in boxes.sweep(session):
                            log.warning("job %s lost a box: requeued", job_id)
                        for job_id in jobs.sweep(session):
                            log.warning("job %s lost its worker: requeued", job_id)
                        for job_id in reconcile(settings, session):
                            log.warning("job %s sent to the queue by the reconcile", job_id)
            except Exception as exc:  # the database may be briefly unavailable; try again next tick
                if not unavailable(exc):
                    log.exception("telemetry/sweep tick failed")
                else:
                    log.warning(
                        "telemetry/sweep tick: the database is unavailable: %s", getattr(exc, "orig", exc)
                    )
                    # no lease could be renewed while it was away: their holders get a whole lease
                    # once it is back to renew them, before a sweep takes their jobs for lost
                    next_sweep = time.monotonic() + settings.lease_seconds + settings.telemetry_seconds
            stop.wait(settings.telemetry_seconds)
    finally:
        sampler.close()
