"""The trackers a run can log to: TensorBoard event files, an MLflow server, Weights & Biases.

Each has ``start(info)``, ``log(points)`` (``batch`` points at most) and ``finish(summary, status,
export)``; they run on a background thread (``engine.tracking.background``) and may raise: the
caller retries with the same points, so each delivers a point once: TensorBoard and W&B take one
point per call, and MLflow keeps a repeated row (same key, value, step and time) once. The ids
of the runs they created are kept in ``output_dir/trackers.json``, so a resumed job logs to the
same runs.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.training.checkpoint_layout import export_files

if TYPE_CHECKING:
    from engine.config import MlflowSpec, WandbSpec
    from engine.tracking import RunInfo, TrackerSecrets
    from engine.tracking.spool import Point

IDS_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
_ids_lock = threading.Lock()


def saved_id(output_dir: Path, key: str) -> str | None:
    """The id a tracker saved for this run folder (None: a new run)."""
    try:
        value = json.loads((output_dir / IDS_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def save_id(output_dir: Path, key: str, value: str) -> None:
    with _ids_lock:
        path = output_dir / IDS_FILE
        try:
            ids = json.loads(path.read_text())
        except (OSError, ValueError):
            ids = {}
        ids[key] = value
        output_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids, indent=1))
        tmp.replace(path)


class TensorBoardTracker:
    """Scalars per step, the config as text and the hyperparameters with the final metrics
    (TensorBoard's HParams), in ``output_dir/tensorboard``."""

    name = "tensorboard"
    batch = 1

    def __init__(self) -> None:
        self.writer: Any = None

    def start(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(info.output_dir / TENSORBOARD_DIR), flush_secs=10)
        self.params = info.params
        self.writer.add_text("run/config", "```\n" + json.dumps(info.described(), indent=1) + "\n```")

    def log(self, points: list[Point]) -> None:
        for point in points:
            for key, value in point.metrics.items():
                self.writer.add_scalar(key, value, global_step=point.step, walltime=point.time_ms / 1000)

    def finish(self, summary: dict[str, float], status: str, export: Path | None) -> None:
        from torch.utils.tensorboard.summary import hparams

        # in this run's own file (SummaryWriter.add_hparams would open a second run folder)
        experiment, start, end = hparams(self.params, {f"final/{k}": v for k, v in summary.items()})
        for one in (experiment, start, end):
            self.writer.file_writer.add_summary(one)
        for key, value in summary.items():
            self.writer.add_scalar(f"final/{key}", value)
        self.writer.close()


class MlflowTracker:
    """A run in an experiment of an MLflow server: params, tags (model, dataset and its hash),
    metrics by step, the status, and optionally the final export as the ``adapter`` artifact."""

    name = "mlflow"
    batch = 1_000  # and 1000 values: MLflow's log_batch limit

    def __init__(self, spec: MlflowSpec, secrets: TrackerSecrets) -> None:
        self.spec, self.secrets = spec, secrets
        self.client: Any = None
        self.run_id = ""

    def start(self, info: RunInfo) -> None:
        # MLflow reads its credentials and HTTP policy from these variables only; its own retries
        # (minutes by default) would hold this thread: the background retries instead
        for var, value in (
            ("MLFLOW_TRACKING_TOKEN", self.secrets.mlflow_token),
            ("MLFLOW_TRACKING_USERNAME", self.secrets.mlflow_username),
            ("MLFLOW_TRACKING_PASSWORD", self.secrets.mlflow_password),
        ):
            if value:
                os.environ[var] = value
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        if self.spec.tracking_uri.startswith("file:"):
            # a file: store is a tracking URI we accept (engine.tracking.uris); MLflow 3 refuses
            # its file store unless this opts in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        found = client.get_experiment_by_name(self.spec.experiment)
        experiment = found.experiment_id if found else client.create_experiment(self.spec.experiment)
        self.run_id = saved_id(info.output_dir, "mlflow_run_id") or ""
        tags = {"model": info.model, "dataset": info.dataset, "dataset_sha256": info.dataset_sha256()}
        tags.update(info.tags)
        if self.run_id:
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment, run_name=info.name, tags=tags).info.run_id
            save_id(info.output_dir, "mlflow_run_id", self.run_id)
            params = [Param(k, str(v)[:6000]) for k, v in info.params.items()]
            client.log_batch(self.run_id, params=params, tags=[RunTag(k, v) for k, v in tags.items()])
        self.client = client

    def log(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        # each point's own time: a batch sent again (a timeout the server did get, a spool
        # replayed) repeats rows exactly, which MLflow's database stores keep once
        batch = [Metric(k, float(v), p.time_ms, p.step) for p in points for k, v in p.metrics.items()]
        for at in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[at : at + 1000])

    def finish(self, summary: dict[str, float], status: str, export: Path | None) -> None:
        if self.spec.log_adapter and export is not None and status == "succeeded":
            for path in export_files(export):
                parent = path.parent.relative_to(export)
                where = "adapter" if parent == Path(".") else f"adapter/{parent.as_posix()}"
                self.client.log_artifact(self.run_id, str(path), artifact_path=where)
        final = {"succeeded": "FINISHED", "cancelled": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=final)


class WandbTracker:
    """A W&B run: the config (hyperparameters, model, dataset and its hash), metrics against the
    run's step, the summary; ``mode: offline`` writes the run's files under output_dir/wandb."""

    name = "wandb"
    batch = 1  # one run.log per call: a retried call never logs a step twice

    def __init__(self, spec: WandbSpec, secrets: TrackerSecrets) -> None:
        self.spec, self.secrets = spec, secrets
        self.run: Any = None

    def start(self, info: RunInfo) -> None:
        import wandb

        settings = wandb.Settings(
            api_key=self.secrets.wandb_api_key or None,
            silent=True,
            console="off",
            init_timeout=60,
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
            disable_job_creation=True,
        )
        ident = saved_id(info.output_dir, "wandb_run_id") or uuid.uuid4().hex[:12]
        save_id(info.output_dir, "wandb_run_id", ident)
        config = dict(info.params)
        config.update(model=info.model, dataset=info.dataset, dataset_sha256=info.dataset_sha256())
        self.run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            name=self.spec.name or info.name,
            tags=list(self.spec.tags),
            mode=self.spec.mode,
            dir=str(info.output_dir),
            id=ident,
            resume="allow",
            reinit="create_new",
            config=config,
            settings=settings,
        )
        # the run's own step axis: metrics of a step may arrive after a later step's
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def log(self, points: list[Point]) -> None:
        for point in points:
            self.run.log({"trainer/step": point.step, **point.metrics})

    def finish(self, summary: dict[str, float], status: str, export: Path | None) -> None:
        self.run.summary.update({**summary, "status": status})
        self.run.finish(exit_code=0 if status in ("succeeded", "cancelled") else 1)
