"""The Celery app: Redis when ``ROUNDHOUSE_REDIS_URL`` is set, else a no-server folder transport.

The API only sends job ids; the worker (``server/worker/``) runs them. Nothing here imports torch.

The database, not the broker, says which jobs must run: a job records when its message was sent,
and ``reconcile`` (every worker's housekeeping) sends again each claimable job whose message is
pending (the broker was down) or is no longer in the broker's queue (Redis restarted or flushed)
a while after it was sent. The claim makes a duplicate message harmless.
"""

from __future__ import annotations

import base64
import json
import logging
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session

from server.kinds import EventKind, JobStatus
from server.services import jobs, placement
from server.settings import Settings
from server.tables import now

log = logging.getLogger("roundhouse.queue")

TASK = "roundhouse.run_job"
EVALUATE = "roundhouse.run_evaluation"  # an evaluation id (server/worker/evaluator.py)
BOX = "roundhouse.run_box"  # one host's box of a job on several hosts (server/worker/boxes.py)


def make_celery(settings: Settings) -> Celery:
    app = Celery("roundhouse", set_as_current=False)
    conf: dict[str, object] = {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "task_ignore_result": True,
        "task_default_queue": settings.queue,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if settings.redis_url:
        conf["broker_url"] = settings.redis_url
        # a job runs for days: an unacknowledged message must not be redelivered meanwhile (the
        # sweep requeues jobs whose worker died; the claim makes a redelivery harmless anyway)
        conf["broker_transport_options"] = {"visibility_timeout": 7 * 24 * 3600}
    else:
        folder = settings.broker_dir.resolve()
        for sub in ("queue", "control", "processed"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        conf["broker_url"] = "filesystem://"
        conf["broker_transport_options"] = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "control_folder": str(folder / "control"),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
        }
    app.conf.update(conf)
    return app


_apps: dict[str, Celery] = {}


def celery_for(settings: Settings) -> Celery:
    """One Celery app per distinct settings (the API's sender, or the worker)."""
    key = settings.model_dump_json()
    if key not in _apps:
        _apps[key] = make_celery(settings)
    return _apps[key]


def enqueue(settings: Settings, job_id: str, *, where: dict[str, Any] | None = None) -> None:
    """Send a job id to the workers: to the queue of its placement ``where`` (``services.placement``)."""
    queue = placement.queue_for(settings.queue, where)
    celery_for(settings).send_task(TASK, args=[job_id], queue=queue, routing_key=queue)


def send_box(settings: Settings, job_id: str, *, generation: int, rank: int, host: str) -> None:
    """Send a reserved host its box of a job's run (``services.boxes``), on that host's queue."""
    queue = placement.host_queue(settings.queue, host)
    celery_for(settings).send_task(BOX, args=[job_id, generation, rank], queue=queue, routing_key=queue)


def send_evaluation(settings: Settings, evaluation_id: str) -> None:
    """Send an evaluation id to the workers (the same queue: a worker runs it between jobs)."""
    celery_for(settings).send_task(EVALUATE, args=[evaluation_id], queue=settings.queue)


def _send(settings: Settings, session: Session, *, job_id: str, stale_before: datetime, note: str) -> bool:
    """Send a due job's message and record it as a log event, unless another sender just did or a
    worker claimed it. On a broker error the job's send is pending again, and the error raised."""
    sends = jobs.take_send(session, job_id=job_id, stale_before=stale_before)
    if sends is None:
        return False
    job = jobs.get_job(session, job_id=job_id)
    try:
        enqueue(settings, job_id, where=job.placement if job is not None else None)
    except Exception:
        jobs.send_failed(session, job_id=job_id)
        raise
    message = f"{note} (send {sends})"
    jobs.add_event(session, job_id=job_id, kind=EventKind.LOG, message=message, data={"sends": sends})
    return True


def _job_of(raw: bytes | str) -> str | None:
    """The job id a Celery message carries (protocol 2: the body is ``[args, kwargs, embed]``)."""
    try:
        message = json.loads(raw)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def waiting(settings: Settings, queues: set[str] | None = None) -> set[str]:
    """The jobs whose message waits in the broker's ``queues`` (default: the default queue), not
    yet taken by a worker."""
    raws: list[Any] = []
    names = sorted(queues or {settings.queue})
    if settings.redis_url:
        import redis

        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
        try:
            for name in names:
                raws += list(client.lrange(name, 0, -1))
        finally:
            client.close()
    else:
        for name in names:
            for path in (settings.broker_dir / "queue").glob(f"*.{name}.msg"):
                try:
                    raws.append(path.read_bytes())
                except OSError:  # taken by a worker meanwhile
                    continue
    return {job for job in map(_job_of, raws) if job is not None}


def _placement(session: Session, job_id: str) -> dict[str, Any] | None:
    job = jobs.get_job(session, job_id=job_id)
    return job.placement if job is not None else None


def _note(status: str, sent_at: datetime | None, settings: Settings) -> str:
    if status == JobStatus.INTERRUPTED:
        return "requeued: sent to the job queue"
    if sent_at is None:
        return "sent to the job queue, which was unreachable before"
    return (
        f"sent to the job queue again: no worker claimed it within {settings.requeue_after_seconds:g} s"
        " and the broker no longer holds its message"
    )


def reconcile(settings: Settings, session: Session) -> list[str]:
    """Send every claimable job whose send is pending (the broker was down, or the job was just
    requeued), and again every one sent more than ``requeue_after_seconds`` ago that no worker
    claimed and whose message is not waiting in the broker (it lost it). Returns the ids sent.

    Raises:
        Exception: the broker's error, at the first send that fails (the rest stay due).
    """
    stale_before = now() - timedelta(seconds=settings.requeue_after_seconds)
    due = jobs.due_sends(session, stale_before=stale_before)
    if not due:
        return []
    present: set[str] = set()
    if any(sent_at is not None for _, _, sent_at in due):
        queues = {placement.queue_for(settings.queue, _placement(session, job_id)) for job_id, _, _ in due}
        present = waiting(settings, queues)
    sent = []
    for job_id, status, sent_at in due:
        if job_id in present:  # queued behind other jobs: its message is still there
            continue
        note = _note(status, sent_at, settings)
        if _send(settings, session, job_id=job_id, stale_before=stale_before, note=note):
            sent.append(job_id)
    return sent
