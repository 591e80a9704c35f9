"""The worker's side of a job's experiment trackers (``engine.tracking``): the credentials from
the settings, the job's and dataset's names and hash, and its TensorBoard files kept in the store."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from engine import Sink, TrainConfig
from engine.tracking import TENSORBOARD_DIR, TrackerSecrets, TrackingOptions
from engine.training import CheckpointKind
from server.db import unavailable
from server.kinds import EventKind
from server.services import jobs, sweeps
from server.settings import Settings
from server.storage import Storage
from server.tables import Dataset, Job, Sweep


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
        if job is not None and job.sweep_id:
            tags["roundhouse.sweep"] = job.sweep_id
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


class EarlyStopping:
    """The job's sink, and for a trial of a sweep with early stopping: each time the sweep's metric
    is logged, ``sweeps.early_stop`` judges the trial; one clearly worse than the others at the
    same step stops at the next step boundary (a ``log`` event says why)."""

    def __init__(
        self, sink: Sink, sessions: sessionmaker[Session], job_id: str, cancel: threading.Event, metric: str
    ) -> None:
        self.sink, self.sessions, self.job_id, self.cancel, self.metric = (
            sink,
            sessions,
            job_id,
            cancel,
            metric,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log(metrics, step)
        if self.metric not in metrics or self.cancel.is_set():
            return
        try:
            worse = self._judge(step, float(metrics[self.metric]))
        except DBAPIError as exc:
            if not unavailable(exc):
                raise
            return  # the database is away (the sink keeps the metrics): a later step is judged
        if worse:
            self.cancel.set()

    def _judge(self, step: int, value: float) -> bool:
        """Whether the trial stops at ``step`` (a ``log`` event says why)."""
        with self.sessions() as session:
            reason = sweeps.early_stop(session, job_id=self.job_id, step=step, value=value)
            if reason is None:
                return False
            message = (
                f"stopped early: {self.metric} {reason['value']:.4g} at step {step} is worse than the "
                f"median {reason['median']:.4g} of {reason['trials']} other trials of its sweep"
            )
            jobs.add_event(
                session,
                job_id=self.job_id,
                kind=EventKind.LOG,
                message=message,
                data={sweeps.EARLY_STOP: reason},
            )
        return True

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.sink.event(kind, message, data)

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.sink.checkpoint_saved(step, path, kind, bytes)

    def close(self) -> None:
        self.sink.close()


def early_stopping(sink: Sink, sessions: sessionmaker[Session], job_id: str, cancel: threading.Event) -> Sink:
    """``sink`` itself, or wrapped in ``EarlyStopping`` for a trial of a sweep that asks for it."""
    with sessions() as session:
        job = session.get(Job, job_id)
        sweep = session.get(Sweep, job.sweep_id) if job is not None and job.sweep_id else None
        if sweep is None or not sweep.spec.get("early_stopping"):
            return sink
        metric = str(sweep.spec["metric"])
    return EarlyStopping(sink, sessions, job_id, cancel, metric)
