"""The worker's Celery app and its tasks (a job, a host's box of a job on several hosts, an
evaluation). ``roundhouse worker`` starts it.

Concurrency 1 and prefetch 1 (the worker owns every GPU of its host), ``acks_late`` with
``reject_on_worker_lost``. The task is a thin adapter around ``supervisor.supervise``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import Celery, signals
from sqlalchemy.orm import Session, sessionmaker

from server.db import make_engine, session_factory
from server.queue import BOX, EVALUATE, TASK, make_celery
from server.settings import get_settings

log = logging.getLogger("roundhouse.worker")
settings = get_settings()
app: Celery = make_celery(settings)
_sessions: dict[int, sessionmaker[Session]] = {}
_stop = threading.Event()
_inference: list[Any] = []  # the inference service's process, started with the worker


def sessions() -> sessionmaker[Session]:
    """This process's sessions: a forked pool process never reuses its parent's connections."""
    pid = os.getpid()
    if pid not in _sessions:
        _sessions[pid] = session_factory(make_engine(settings.url))
    return _sessions[pid]


@app.task(name=TASK, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self: Any, job_id: str) -> str:
    """Run one fine-tuning job (by id) to its outcome."""
    from server.worker.supervisor import supervise

    outcome = supervise(settings, sessions(), job_id=job_id, worker_id=str(self.request.hostname))
    log.info("job %s: %s", job_id, outcome)
    return outcome


@app.task(name=BOX, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_box(self: Any, job_id: str, generation: int, rank: int) -> str:
    """Run this host's box (``rank``) of a job's run on several hosts (``generation``)."""
    from server.worker.boxes import supervise_box

    worker_id = str(self.request.hostname)
    outcome = supervise_box(
        settings, sessions(), job_id=job_id, generation=generation, rank=rank, worker_id=worker_id
    )
    log.info("job %s box %d: %s", job_id, rank, outcome)
    return outcome


@app.task(name=EVALUATE, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_evaluation(self: Any, evaluation_id: str) -> str:
    """Evaluate one checkpoint (by evaluation id) and record the result."""
    from server.worker.evaluator import supervise_evaluation

    worker_id = str(self.request.hostname)
    outcome = supervise_evaluation(settings, sessions(), evaluation_id=evaluation_id, worker_id=worker_id)
    log.info("evaluation %s: %s", evaluation_id, outcome)
    return outcome


@signals.worker_ready.connect
def _resume_evaluations(sender: Any = None, **_: Any) -> None:
    from server.worker.evaluator import resume

    try:
        resume(settings, sessions(), worker_id=str(getattr(sender, "hostname", "worker")))
    except Exception:  # the database or the broker is not there yet: queued ones wait for the next start
        log.exception("could not resume the queued evaluations")


@signals.worker_ready.connect
def _start_housekeeping(sender: Any = None, **_: Any) -> None:
    from server.worker import inference_link
    from server.worker.supervisor import telemetry_loop

    worker_id = str(getattr(sender, "hostname", "worker"))
    # the inference service beside this worker: the housekeeping records where it answers
    proc, link = inference_link.start(settings)
    _inference.append(proc)
    thread = threading.Thread(
        target=telemetry_loop,
        args=(settings, sessions()),
        kwargs={"worker_id": worker_id, "stop": _stop, "inference": (link.url, link.token)},
        name="roundhouse-telemetry",
        daemon=True,
    )
    thread.start()
    from server.hf_hub import runner

    runner.start(settings, sessions(), worker_id=worker_id, stop=_stop)  # Hub pulls and pushes


@signals.worker_shutdown.connect
def _stop_housekeeping(**_: Any) -> None:
    from server.worker import inference_link

    _stop.set()
    for proc in _inference:
        inference_link.stop(proc)
