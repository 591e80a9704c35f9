"""The task's body: claim the job, run the training child, relay cancel, record the outcome.

Runs in the Celery pool process. It never imports torch: the child is a fresh interpreter, so
a crash or an out-of-memory kill there leaves the worker alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from server.kinds import EventKind, JobStatus
from server.services import gpus, jobs
from server.settings import Settings
from server.worker.trainer import ERROR_FILE, EXIT_CANCELLED, EXIT_OK

log = logging.getLogger("roundhouse.worker")
POLL_S = 0.5
TELEMETRY_S = 10.0  # how often a job records its host's latest sample
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when its parent dies (Linux)."""
    # not Linux: no prctl, and the child's own parent watch still stops it
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _failure(folder: Path, rc: int) -> str:
    reason = folder / ERROR_FILE
    if reason.is_file():
        return reason.read_text().strip()
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (out of host memory?)" if -rc == signal.SIGKILL else ""
        return f"the training process was killed by {name}{hint}; see train.log"
    return f"the training process exited with code {rc}; see train.log"


def supervise(settings: Settings, sessions: sessionmaker[Session], *, job_id: str, worker_id: str) -> str:
    """Run one job to its outcome. Returns what happened (for the worker's log)."""
    with sessions() as session:
        if not jobs.claim(session, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds):
            return "not claimable (taken, finished or cancelled)"
        job = jobs.get_job(session, job_id=job_id)
        folder = Path(job.output_dir) if job is not None else settings.runs_dir / job_id
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **settings.child_environment()}
    with (folder / "train.log").open("ab") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "server.worker.trainer", job_id],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
    parent = os.getppid()
    renew_every = settings.lease_seconds / 3
    next_renew = next_telemetry = 0.0
    cancel_sent: float | None = None
    killed_for_cancel = False
    while (rc := child.poll()) is None:
        now = time.monotonic()
        if os.getppid() != parent:  # the worker's main process died: stop, the sweep requeues
            child.kill()
            child.wait()
            return "worker main process gone; child stopped"
        with sessions() as session:
            if now >= next_renew:
                status = jobs.renew(
                    session, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds
                )
                next_renew = now + renew_every
                if status is None:
                    child.kill()
                    child.wait()
                    return "lease lost; child stopped"
            else:
                status = jobs.status_of(session, job_id=job_id)
            if status == JobStatus.CANCELLING and cancel_sent is None:
                child.send_signal(signal.SIGTERM)
                cancel_sent = now
                jobs.add_event(
                    session,
                    job_id=job_id,
                    kind=EventKind.LOG,
                    message="cancel relayed to the training process",
                )
            if now >= next_telemetry:
                next_telemetry = now + TELEMETRY_S
                sample = gpus.job_sample(session, worker_id=worker_id)
                if sample:
                    jobs.add_event(session, job_id=job_id, kind=EventKind.TELEMETRY, data=sample, step=None)
        if (
            cancel_sent is not None
            and not killed_for_cancel
            and now - cancel_sent > settings.cancel_grace_seconds
        ):
            child.kill()
            killed_for_cancel = True
        time.sleep(POLL_S)
    with sessions() as session:
        error = None
        if rc == EXIT_OK:
            to, message = JobStatus.SUCCEEDED, "training finished"
        elif rc == EXIT_CANCELLED:
            to, message = JobStatus.CANCELLED, "stopped at a step boundary with a checkpoint"
        elif killed_for_cancel:
            to, message = (
                JobStatus.CANCELLED,
                "killed after the cancel grace period; resumes from its last checkpoint",
            )
        else:
            to, message, error = JobStatus.FAILED, "training failed", _failure(folder, rc)
        recorded = jobs.finish(
            session, job_id=job_id, worker_id=worker_id, to=to, message=message, error=error
        )
    return f"{to} (exit code {rc})" if recorded else f"outcome {to} not recorded: the job moved on"


def telemetry_loop(
    settings: Settings, sessions: sessionmaker[Session], *, worker_id: str, stop: threading.Event
) -> None:
    """The worker's housekeeping thread: sample devices, and requeue jobs of vanished workers."""
    from server.queue import enqueue
    from server.worker.telemetry import Sampler

    sampler = Sampler()
    hostname = socket.gethostname()
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
                    )
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + settings.lease_seconds / 2
                        for job_id in jobs.sweep(session):
                            log.warning("job %s lost its worker: requeued", job_id)
                            enqueue(settings, job_id)
            except Exception:  # the database may be briefly unavailable; try again next tick
                log.exception("telemetry/sweep tick failed")
            stop.wait(settings.telemetry_seconds)
    finally:
        sampler.close()
