"""Our datasets, jobs, events and checkpoints as the OpenAI fine-tuning API's objects, and its
requests as ours: ids, statuses, "auto" hyperparameters, paging.

A file is a dataset (``file-<dataset id>``), a fine-tuning job a job (``ftjob-<job id>``), an event
``ftevent-<event id>``, a checkpoint ``ftckpt-<job id>-<step>``; fine-tuned models are named as
``server.services.fine_tuned`` says.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine import MAX_SEED
from engine.methods import METHODS
from server.kinds import EventKind, JobStatus
from server.services import checkpoints, integrations, methods
from server.services.fine_tuned import ORGANIZATION, checkpoint_name, model_name
from server.storage import Storage
from server.tables import Checkpoint, Dataset, Job, JobEvent

FILE, JOB, EVENT, CHECKPOINT = "file-", "ftjob-", "ftevent-", "ftckpt-"
RESULTS = "results-"  # a job's result file: "file-results-<job id>" (``openai_results``)
# what "auto" (or a hyperparameter left out) stands for; the learning rate multiplies the base
# rate of what is trained (or roundhouse.hyper.learning_rate when the request sets one)
AUTO_EPOCHS = 1
AUTO_BATCH_SIZE = 8
AUTO_LEARNING_RATE_MULTIPLIER = 1.0
AUTO_BETA = 0.1
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}
REINFORCEMENT_OBJECTIVE = "grpo"  # what OpenAI's method.type "reinforcement" runs
# /v1's method.type of each registered method: OpenAI's names for the methods OpenAI has
# (supervised, dpo, reinforcement); ours, as an extension, by their own name (orpo, kto, ...)
OPENAI_TYPES = {"sft": "supervised", REINFORCEMENT_OBJECTIVE: "reinforcement"}
METHOD_TYPES = {OPENAI_TYPES.get(name, name): name for name in METHODS}  # method.type -> objective
EXTENSIONS = tuple(t for t in METHOD_TYPES if t not in ("supervised", "dpo", "reinforcement"))


def takes_beta(objective: str) -> bool:
    """Whether a method's options have a beta (OpenAI's dpo hyperparameter, and ours)."""
    return "beta" in METHODS[objective].options.model_fields


# ours -> OpenAI's (a job being cancelled or paused still runs until its next step)
STATUSES: dict[str, str] = {
    JobStatus.VALIDATING: "validating_files",
    JobStatus.QUEUED: "queued",
    JobStatus.INTERRUPTED: "queued",
    JobStatus.RUNNING: "running",
    JobStatus.CANCELLING: "running",
    JobStatus.PAUSING: "running",
    JobStatus.SUCCEEDED: "succeeded",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
    JobStatus.PAUSED: "paused",
}
FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
RUNNING = (JobStatus.RUNNING, JobStatus.CANCELLING, JobStatus.PAUSING)


class Invalid(ValueError):
    """A request the API refuses; ``param`` names the field (OpenAI's name for it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def ours(ident: str, prefix: str) -> str:
    """Our id of an OpenAI-style id (our own is taken as it is)."""
    return ident.removeprefix(prefix)


# -- files -------------------------------------------------------------------------------------------
def file_object(dataset: Dataset) -> dict[str, Any]:
    return {
        "id": FILE + dataset.id,
        "object": "file",
        "bytes": dataset.size_bytes,
        "created_at": unix(dataset.created_at),
        "filename": dataset.filename,
        "purpose": "fine-tune",
        "status": "processed",  # a stored dataset was validated row by row
        "expires_at": None,
        "status_details": None,
        "roundhouse": {
            "dataset_id": dataset.id,
            "name": dataset.name,
            "format": dataset.format,
            "rows": dataset.rows,
            "sha256": dataset.sha256,
        },
    }


def page_files(
    session: Session, *, after: str | None, limit: int, newest_first: bool
) -> tuple[list[Dataset], bool]:
    """A page of datasets by creation time, after the file ``after``; and whether more follow.

    Raises:
        Invalid: (``after``) no such file.
    """
    order = (
        (Dataset.created_at.desc(), Dataset.id.desc()) if newest_first else (Dataset.created_at, Dataset.id)
    )
    q = select(Dataset).where(Dataset.deleted_at.is_(None)).order_by(*order)
    if after is not None:
        last = session.get(Dataset, ours(after, FILE))
        if last is None or last.deleted_at is not None:
            raise Invalid("after", f"no file {after!r}")
        if newest_first:
            q = q.where(
                (Dataset.created_at < last.created_at)
                | ((Dataset.created_at == last.created_at) & (Dataset.id < last.id))
            )
        else:
            q = q.where(
                (Dataset.created_at > last.created_at)
                | ((Dataset.created_at == last.created_at) & (Dataset.id > last.id))
            )
    rows = list(session.scalars(q.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- jobs --------------------------------------------------------------------------------------------
def job_object(job: Job) -> dict[str, Any]:
    config = job.config
    method, hyper = config.get("method") or {}, config.get("hyper") or {}
    epochs = hyper.get("epochs")
    rate = float(hyper.get("learning_rate") or 0)
    shown: dict[str, Any] = {
        "batch_size": hyper.get("batch_size"),
        "learning_rate_multiplier": rate / BASE_LEARNING_RATE[methods.tuning_of(method)],
        "n_epochs": int(epochs) if isinstance(epochs, float) and epochs.is_integer() else epochs or "auto",
    }
    objective = methods.objective_of(method)
    # method.type: supervised, dpo, reinforcement (GRPO), or our extension's (orpo, kto, ...)
    kind = OPENAI_TYPES.get(objective, objective)
    if takes_beta(objective):
        shown["beta"] = method.get("beta")
    if kind == "reinforcement":
        every = (config.get("eval") or {}).get("every_steps")
        shown |= {
            "eval_interval": every or "auto",
            "group_size": method.get("group_size"),
            "max_completion_tokens": method.get("max_completion_tokens"),
        }
    options: dict[str, Any] = {"hyperparameters": shown}
    if kind == "reinforcement":
        options["grader"] = method.get("grader") or {}
    failed = job.status == JobStatus.FAILED
    # once it stopped (paused too): its metrics as a result file, and the tokens its steps trained
    stopped = job.status in FINISHED or job.status == JobStatus.PAUSED
    return {
        "id": JOB + job.id,
        "object": "fine_tuning.job",
        "created_at": unix(job.created_at),
        "error": {"code": "training_failed", "message": job.error or "the run failed", "param": None}
        if failed
        else None,
        "fine_tuned_model": model_name(job) if job.status == JobStatus.SUCCEEDED else None,
        "finished_at": unix(job.finished_at) if job.status in FINISHED else None,
        "hyperparameters": shown,
        "model": job.base_model,
        "organization_id": ORGANIZATION,
        "result_files": [f"{FILE}{RESULTS}{job.id}"] if stopped and job.step > 0 else [],
        "seed": int(hyper.get("seed") or 0),
        "status": STATUSES.get(job.status, "running"),
        "trained_tokens": job.trained_tokens if stopped else None,
        "training_file": FILE + job.dataset_id,
        "validation_file": FILE + job.validation_dataset_id if job.validation_dataset_id else None,
        "estimated_finish": unix(job.estimated_finish) if job.status in RUNNING else None,
        "integrations": integrations.shown(job.config),
        "metadata": job.meta,
        "method": {"type": kind, kind: options},
        "roundhouse": {
            "job_id": job.id,
            "name": job.name,
            "status": job.status,
            "step": job.step,
            "total_steps": job.total_steps,
        },
    }


def _auto(value: Any, default: Any) -> Any:
    return default if value is None or value == "auto" else value


def train_sections(
    *,
    method_type: str,
    hyperparameters: dict[str, Any],
    seed: int | None,
    options: dict[str, Any],
    grader: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``method``, ``hyper`` and ``eval`` sections of ``POST /api/jobs`` for an OpenAI
    request: ``options`` (our extension's sections) with the OpenAI fields over them, "auto"
    resolved. A reinforcement request (``grader``: its ``method.reinforcement.grader``) is a GRPO
    job (``method.objective: "grpo"``); its ``eval_interval`` is ``eval.every_steps``.

    Raises:
        Invalid: a method we do not run, or an extension that contradicts the method.
    """
    method, hyper = dict(options.get("method") or {}), dict(options.get("hyper") or {})
    evaluation = dict(options.get("eval") or {})
    kind = method.get("kind")
    given = methods.objective_of(method) if ("kind" in method or "objective" in method) else None
    if method_type == "reinforcement":
        if given not in (None, REINFORCEMENT_OBJECTIVE):
            raise Invalid(
                "roundhouse.method.kind",
                f"{kind or method.get('objective')!r} contradicts method.type reinforcement (GRPO)",
            )
        method.pop("kind", None)
        method["objective"] = REINFORCEMENT_OBJECTIVE
        if grader is not None:
            method["grader"] = grader
        interval = hyperparameters.get("eval_interval")
        if interval not in (None, "auto"):
            evaluation["every_steps"] = interval
    elif method_type in METHOD_TYPES and method_type != "supervised":  # dpo, and our extensions
        objective = METHOD_TYPES[method_type]
        if given not in (None, objective):
            raise Invalid(
                "roundhouse.method.kind",
                f"{kind or method.get('objective')!r} contradicts method.type {method_type}: use tuning",
            )
        method.pop("kind", None)
        method["objective"] = objective
        if takes_beta(objective):
            method["beta"] = _auto(hyperparameters.get("beta"), method.get("beta", AUTO_BETA))
    elif given not in (None, "sft"):
        raise Invalid(
            "roundhouse.method.kind",
            f"{kind or method.get('objective')!r}: a supervised job is lora or full "
            "(dpo, orpo, reinforcement: method.type)",
        )
    base = hyper.get(
        "learning_rate", BASE_LEARNING_RATE.get(methods.tuning_of(method), BASE_LEARNING_RATE["lora"])
    )
    if not isinstance(base, int | float) or isinstance(base, bool):
        raise Invalid("roundhouse.hyper.learning_rate", f"must be a number, got {base!r}")
    multiplier = _auto(hyperparameters.get("learning_rate_multiplier"), AUTO_LEARNING_RATE_MULTIPLIER)
    hyper["learning_rate"] = base * multiplier
    hyper["epochs"] = _auto(hyperparameters.get("n_epochs"), hyper.get("epochs", AUTO_EPOCHS))
    hyper["batch_size"] = _auto(hyperparameters.get("batch_size"), hyper.get("batch_size", AUTO_BATCH_SIZE))
    if seed is not None:
        hyper["seed"] = seed
    elif "seed" not in hyper:  # as OpenAI does: one is generated, and the job shows it
        hyper["seed"] = secrets.randbelow(min(MAX_SEED, 2**31 - 1))
    return {"method": method, "hyper": hyper, "eval": evaluation}


# our config's fields -> the OpenAI request's, for the param of an error
PARAMS = {
    "base_model": "model",
    "dataset_id": "training_file",
    "validation_dataset_id": "validation_file",
    "hyper.epochs": "n_epochs",
    "hyper.batch_size": "batch_size",
    "hyper.learning_rate": "learning_rate_multiplier",
    "hyper.seed": "seed",
    "method.beta": "beta",
    "eval.every_steps": "eval_interval",
}


def request_param(param: str | None, *, method_type: str, given: set[str]) -> str | None:
    """The OpenAI request's name of a field of ours: one it set (``given``: the hyperparameters
    and seed it did not leave "auto"), else our extension's."""
    name = PARAMS.get(param or "")
    if param is None or name in ("model", "training_file", "validation_file"):
        return name or param
    if method_type == "reinforcement" and (param == "method.grader" or param.startswith("method.grader.")):
        return f"method.reinforcement.{param.removeprefix('method.')}"  # the grader the request gave
    if name == "seed" and name in given:
        return name
    if name is not None and name in given:
        return f"method.{method_type}.hyperparameters.{name}"
    return f"roundhouse.{param}"


def label(session: Session, *, job: Job, metadata: dict[str, str] | None, suffix: str | None) -> None:
    """Keep a job's metadata and suffix (what its fine-tuned model's name carries)."""
    job.meta, job.suffix = metadata, suffix
    session.commit()


def page_jobs(
    session: Session,
    *,
    after: str | None,
    limit: int,
    metadata: dict[str, str] | None,
    without_metadata: bool,
) -> tuple[list[Job], bool]:
    """Jobs newest first, after the job ``after``, those whose metadata has every pair of
    ``metadata`` (or, ``without_metadata``, that have none); and whether more follow.

    Raises:
        Invalid: (``after``) no such job.
    """
    q = select(Job).order_by(Job.created_at.desc(), Job.id.desc())
    if after is not None:
        last = session.get(Job, ours(after, JOB))
        if last is None:
            raise Invalid("after", f"no fine-tuning job {after!r}")
        q = q.where(
            (Job.created_at < last.created_at) | ((Job.created_at == last.created_at) & (Job.id < last.id))
        )
    if without_metadata:
        q = q.where(Job.meta.is_(None))
    for key, value in (metadata or {}).items():
        q = q.where(Job.meta[key].as_string() == value)
    rows = list(session.scalars(q.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- events and checkpoints --------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def event_object(event: JobEvent, *, total_steps: int | None) -> dict[str, Any]:
    """An event as OpenAI shows it. A step logs its metrics in two events (the run's progress, the
    engine's loss and rates): each is a ``metrics`` event of that step."""
    data = dict(event.data or {})
    level = "info"
    if event.kind == EventKind.METRICS:
        loss, total = (
            _number(data.get("loss/train")),
            _number(data.get("progress/total_steps")) or total_steps,
        )
        total = int(total) if total else None
        shown = {
            "step": event.step,
            "total_steps": total,
            "train_loss": loss,
            "valid_loss": _number(data.get("loss/val")),
        }
        data = {k: v for k, v in shown.items() if v is not None} | data
        of = f"/{total}" if total else ""
        message = (
            f"Step {event.step}{of}: training loss={loss:.4f}" if loss is not None else f"Step {event.step}"
        )
    else:
        message = event.message or event.kind
        if event.kind == EventKind.STATE and data.get("to") == JobStatus.FAILED:
            level = "error"
        elif event.kind == EventKind.STATE and data.get("to") == JobStatus.INTERRUPTED:
            level = "warn"
    return {
        "id": EVENT + str(event.id),
        "object": "fine_tuning.job.event",
        "created_at": unix(event.created_at),
        "level": level,
        "message": message,
        "data": data | {"kind": event.kind},
        "type": "metrics" if event.kind == EventKind.METRICS else "message",
    }


def event_number(ident: str) -> int:
    """The event id of an ``ftevent-`` id. Raises ``Invalid`` (``after``)."""
    number = ours(ident, EVENT)
    if not (number.isascii() and number.isdigit() and len(number) <= 10):
        raise Invalid("after", f"{ident!r} is not an event id this API returned")
    return int(number)


def page_events(
    session: Session, *, job_id: str, after: int | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """The job's events newest first (the GPU telemetry samples left out), those older than the
    event ``after``; and whether more follow."""
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind != EventKind.TELEMETRY)
    if after is not None:
        q = q.where(JobEvent.id < after)
    rows = list(session.scalars(q.order_by(JobEvent.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoint_object(job: Job, checkpoint: Checkpoint) -> dict[str, Any]:
    metrics = checkpoint.metrics or {}
    shown = {"step": float(checkpoint.step), "train_loss": _number(metrics.get("loss/train"))}
    shown["valid_loss"] = _number(metrics.get("loss/val"))
    return {
        "id": f"{CHECKPOINT}{job.id}-{checkpoint.step}",
        "object": "fine_tuning.job.checkpoint",
        "created_at": unix(checkpoint.created_at),
        "fine_tuned_model_checkpoint": checkpoint_name(job, checkpoint.step),
        "fine_tuning_job_id": JOB + job.id,
        "metrics": {k: v for k, v in shown.items() if v is not None},
        "step_number": checkpoint.step,
        "roundhouse": {
            "kind": checkpoint.kind,
            "download": f"/api/jobs/{job.id}/checkpoints/{checkpoint.step}/download",
        },
    }


def page_checkpoints(
    session: Session, *, job: Job, after: str | None, limit: int, storage: Storage | None = None
) -> tuple[list[Checkpoint], bool]:
    """The job's checkpoints on disk, the latest first, those before the checkpoint ``after``.

    Raises:
        Invalid: (``after``) not a checkpoint id of this job.
    """
    saved = list(reversed(checkpoints.list_for(session, job_id=job.id, storage=storage)))
    if after is not None:
        head, _, step = ours(after, CHECKPOINT).rpartition("-")
        if head != job.id or not (step.isascii() and step.isdigit()):
            raise Invalid("after", f"{after!r} is not a checkpoint id of job {JOB + job.id}")
        saved = [c for c in saved if c.step < int(step)]
    return saved[:limit], len(saved) > limit
