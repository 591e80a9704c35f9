"""The worker's side of a job's experiment trackers (``engine.tracking``): the credentials from
the settings, the job's and dataset's names and hash, and its TensorBoard files kept in the store."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from engine.config import TrainConfig
from engine.tracking import TrackerSecrets, TrackingOptions
from engine.tracking.trackers import TENSORBOARD_DIR
from server.settings import Settings
from server.storage import Storage
from server.tables import Dataset, Job


def secrets(settings: Settings) -> TrackerSecrets:
    def value(secret: object) -> str | None:
        return secret.get_secret_value() if secret is not None else None  # type: ignore[attr-defined]

    return TrackerSecrets(
        wandb_api_key=value(settings.wandb_api_key),
        mlflow_token=value(settings.mlflow_tracking_token),
        mlflow_username=settings.mlflow_tracking_username,
        mlflow_password=value(settings.mlflow_tracking_password),
    )


def options(settings: Settings, sessions: sessionmaker[Session], job_id: str) -> TrackingOptions:
    """The job's name, its dataset's name and SHA-256 (as uploaded) and its tags, for the trackers."""
    with sessions() as session:
        job = session.get(Job, job_id)
        dataset = session.get(Dataset, job.dataset_id) if job is not None else None
        name = job.name if job is not None else job_id
        tags = {"roundhouse.job": job_id}
        sweep = getattr(job, "sweep_id", None)
        if sweep:
            tags["roundhouse.sweep"] = sweep
    return TrackingOptions(
        secrets=secrets(settings),
        name=name,
        dataset=dataset.name if dataset is not None else None,
        dataset_sha256=dataset.sha256 if dataset is not None else None,
        tags=tags,
    )


def keep_tensorboard(store: Storage | None, config: TrainConfig, *, output_dir: str, folder: Path) -> None:
    """Put the run's TensorBoard files in the store (a store on another host: the run wrote them
    in this host's copy of its folder)."""
    local = folder / TENSORBOARD_DIR
    if store is None or not config.tracking.tensorboard or not local.is_dir():
        return
    key = f"{output_dir}/{TENSORBOARD_DIR}"
    own = store.local_path(key)
    if own is not None and own.resolve() == local.resolve():
        return
    store.put_tree(key, local)
