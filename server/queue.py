"""The Celery app: Redis when ``ROUNDHOUSE_REDIS_URL`` is set, else a no-server folder transport.

The API only sends job ids; the worker (``server/worker/``) runs them. Nothing here imports torch.
"""

from __future__ import annotations

from celery import Celery

from server.settings import Settings

TASK = "roundhouse.run_job"


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


def enqueue(settings: Settings, job_id: str) -> None:
    """Send a job id to the workers."""
    celery_for(settings).send_task(TASK, args=[job_id], queue=settings.queue)
