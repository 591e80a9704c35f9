"""A fine-tuning job's result file as OpenAI's API gives one: a CSV of the job's metrics by step
(``file-results-<job id>``), made from its metric events when it is asked for, so it never goes
stale and takes no room in the store."""

from __future__ import annotations

import csv
import io
from typing import Any

from sqlalchemy.orm import Session

from server.services import progress
from server.services.openai_compat import FILE, RESULTS, ours, unix
from server.tables import Job

FILENAME = "step_metrics.csv"
PURPOSE = "fine-tune-results"
# OpenAI's columns -> our metric keys; the accuracies are the share of label tokens whose most
# likely next token (argmax) is the label (supervised jobs; DPO and ORPO jobs leave them empty)
COLUMNS = {
    "train_loss": "loss/train",
    "train_accuracy": "accuracy/train",
    "valid_loss": "loss/val",
    "valid_mean_token_accuracy": "accuracy/val",
}


def job_id_of(file_id: str) -> str | None:
    """The job id a result file's id names (``file-results-<job id>``), or None for another file."""
    name = ours(file_id, FILE)
    return name.removeprefix(RESULTS) if name.startswith(RESULTS) else None


def content(session: Session, *, job: Job) -> bytes:
    """The CSV: a header, then one row per step that logged any of ``COLUMNS`` (the latest values of
    a step trained again after a resume), each value as logged (empty where none was)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *COLUMNS])
    for step, row in progress.step_table(session, job_id=job.id, columns=COLUMNS):
        writer.writerow([step, *(repr(row[c]) if c in row else "" for c in COLUMNS)])
    return out.getvalue().encode()


def file_object(job: Job, *, size: int) -> dict[str, Any]:
    return {
        "id": f"{FILE}{RESULTS}{job.id}",
        "object": "file",
        "bytes": size,
        "created_at": unix(job.finished_at or job.created_at),
        "filename": FILENAME,
        "purpose": PURPOSE,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
        "roundhouse": {"job_id": job.id, "columns": {"step": "progress/step", **COLUMNS}},
    }
