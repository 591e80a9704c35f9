"""Evaluations: a job's checkpoint scored on a dataset by a worker (``engine.inference.evaluate``).

``queued -> running -> succeeded | failed``. A worker claims an evaluation with one conditional
update (so a duplicate message does nothing), writes the whole result as
``<checkpoint>/evaluations/<id>.json`` and records its summary figures here (``path``: the
result's key in the store).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from server.kinds import EvaluationStatus
from server.storage import Storage
from server.tables import Evaluation, Worker, now

FOLDER = "evaluations"  # inside a checkpoint folder


def create(
    session: Session,
    *,
    job_id: str,
    step: int,
    dataset_id: str,
    max_rows: int,
    max_new_tokens: int,
    num_samples: int,
) -> Evaluation:
    """A queued evaluation of the job's checkpoint at ``step`` on a dataset."""
    row = Evaluation(
        id=uuid.uuid4().hex,
        job_id=job_id,
        step=step,
        dataset_id=dataset_id,
        status=EvaluationStatus.QUEUED,
        max_rows=max_rows,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        metrics={},
    )
    session.add(row)
    session.commit()
    return row


def list_for(session: Session, *, job_id: str) -> list[Evaluation]:
    """The job's evaluations, newest first."""
    q = select(Evaluation).where(Evaluation.job_id == job_id)
    return list(session.scalars(q.order_by(Evaluation.created_at.desc(), Evaluation.id)))


def get(session: Session, *, evaluation_id: str, job_id: str | None = None) -> Evaluation | None:
    row = session.get(Evaluation, evaluation_id)
    return row if row is not None and (job_id is None or row.job_id == job_id) else None


def claim(session: Session, *, evaluation_id: str, worker_id: str) -> bool:
    """Take a queued evaluation for ``worker_id`` (one conditional update); False if not queued."""
    taken = session.execute(
        update(Evaluation)
        .where(Evaluation.id == evaluation_id, Evaluation.status == EvaluationStatus.QUEUED)
        .values(status=EvaluationStatus.RUNNING, worker_id=worker_id, started_at=now(), error=None)
    )
    session.commit()
    return bool(taken.rowcount == 1)  # type: ignore[attr-defined]


def finish(
    session: Session,
    *,
    evaluation_id: str,
    worker_id: str,
    path: str | None = None,
    metrics: dict[str, Any] | None = None,
    error: str | None = None,
) -> bool:
    """Record the outcome of a running evaluation this worker holds: succeeded with its result
    file and summary ``metrics``, or failed with ``error``."""
    done = session.execute(
        update(Evaluation)
        .where(
            Evaluation.id == evaluation_id,
            Evaluation.worker_id == worker_id,
            Evaluation.status == EvaluationStatus.RUNNING,
        )
        .values(
            status=EvaluationStatus.FAILED if error is not None else EvaluationStatus.SUCCEEDED,
            path=path,
            metrics=metrics or {},
            error=error,
            finished_at=now(),
        )
    )
    session.commit()
    return bool(done.rowcount == 1)  # type: ignore[attr-defined]


def requeue_abandoned(session: Session, *, worker_id: str, silent_before: datetime) -> list[str]:
    """Running evaluations whose worker is gone go back to the queue: those of ``worker_id`` (which
    has just started, so runs none) and those of a worker silent since ``silent_before``. Returns
    every queued evaluation's id, oldest first (their messages may be lost: send them again; the
    claim makes a duplicate harmless)."""
    alive = select(Worker.id).where(Worker.heartbeat_at >= silent_before)
    session.execute(
        update(Evaluation)
        .where(
            Evaluation.status == EvaluationStatus.RUNNING,
            (Evaluation.worker_id == worker_id) | Evaluation.worker_id.not_in(alive),
        )
        .values(status=EvaluationStatus.QUEUED, worker_id=None, started_at=None)
    )
    session.commit()
    q = (
        select(Evaluation.id)
        .where(Evaluation.status == EvaluationStatus.QUEUED)
        .order_by(Evaluation.created_at)
    )
    return list(session.scalars(q))


def result_path(checkpoint: str | Path, evaluation_id: str) -> Path:
    """Where an evaluation's whole result lives: in its checkpoint's folder."""
    return Path(checkpoint) / FOLDER / f"{evaluation_id}.json"


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a result file atomically: a temporary file beside it, flushed to disk, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(result, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(name, 0o644)
        os.replace(name, path)
    finally:
        Path(name).unlink(missing_ok=True)


def read_result(evaluation: Evaluation, storage: Storage | None = None) -> dict[str, Any] | None:
    """The whole result of a succeeded evaluation, from the store (``path``: its key) or, without
    ``storage``, from the file the path names on this host; None when it is gone (the checkpoint
    was pruned or deleted) or unreadable."""
    if evaluation.path is None:
        return None
    try:
        if storage is None:
            text = Path(evaluation.path).read_bytes()
        else:
            text = b"".join(storage.iter_bytes(storage.key_of(evaluation.path)))
        found = json.loads(text)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of a result kept in the database (everything but the samples)."""
    return {k: v for k, v in result.items() if k not in ("samples", "evaluation")}
