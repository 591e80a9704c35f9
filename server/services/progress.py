"""A job's progress as its run logs it: the step counter, the tokens trained and the estimated
finish (what OpenAI's fine-tuning job shows as ``trained_tokens`` and ``estimated_finish``), and
its logged metrics step by step (its result file)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server.kinds import EventKind
from server.tables import Job, JobEvent, now


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def record(session: Session, *, job_id: str, metrics: dict[str, Any], commit: bool = True) -> None:
    """The run's progress metrics of a step (``progress/step``, ``progress/total_steps``, and
    ``tokens/batch``, ``time/eta_s`` when logged): the job's step counter, trained tokens and
    estimated finish.

    The trained tokens are those of the batches of steps 1..step (padding left out), each step
    counted once: a run that resumed from an earlier checkpoint trains the steps after it again,
    and the sum is then taken again from the events (the latest of each step)."""
    step = int(metrics["progress/step"])
    values: dict[str, Any] = {"step": step, "total_steps": int(metrics["progress/total_steps"])}
    eta = _number(metrics.get("time/eta_s"))
    if eta is not None:
        values["estimated_finish"] = now() + timedelta(seconds=eta)
    tokens = _number(metrics.get("tokens/batch"))
    where = update(Job).where(Job.id == job_id)
    if tokens is None:
        session.execute(where.values(values))
    else:
        added = values | {"trained_tokens": func.coalesce(Job.trained_tokens, 0) + int(tokens)}
        following = session.execute(where.where(Job.step == step - 1).values(added))
        if following.rowcount != 1:  # type: ignore[attr-defined]  # a step again, or one skipped
            values["trained_tokens"] = trained_through(session, job_id=job_id, step=step)
            session.execute(where.values(values))
    if commit:
        session.commit()


def trained_through(session: Session, *, job_id: str, step: int) -> int:
    """The tokens of the batches of steps 1..``step``, each step's latest logged value."""
    per_step: dict[int, float] = {}
    q = (
        select(JobEvent.step, JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.METRICS, JobEvent.step <= step)
        .order_by(JobEvent.id)
    )
    for at, data in session.execute(q):
        tokens = _number((data or {}).get("tokens/batch"))
        if at is not None and tokens is not None:
            per_step[at] = tokens
    return int(sum(per_step.values()))


def step_table(
    session: Session, *, job_id: str, columns: dict[str, str]
) -> list[tuple[int, dict[str, float]]]:
    """The job's metrics by step, oldest step first: ``columns`` maps a column to a metric key;
    a step trained again after a resume shows its latest values. Steps that logged none of the
    keys are left out."""
    wanted = set(columns.values())
    rows: dict[int, dict[str, float]] = {}
    q = (
        select(JobEvent.step, JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.METRICS, JobEvent.step.is_not(None))
        .order_by(JobEvent.id)
    )
    for at, data in session.execute(q):
        found = {k: v for k in wanted & set(data or {}) if (v := _number(data[k])) is not None}
        if found:
            row = rows.setdefault(int(at), {})
            row.update({column: found[key] for column, key in columns.items() if key in found})
    return sorted(rows.items())
