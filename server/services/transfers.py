"""Hub transfers in the database (``HubTransfer``): a model pull, a checkpoint push or a dataset
pull, created once per ``active_key`` (a second request for what an active transfer already does
returns that one), claimed by one worker at a time with a lease, their progress recorded,
cancelled, listed."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.tables import HubTransfer, now

QUEUED, RUNNING, CANCELLING = "queued", "running", "cancelling"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
ACTIVE = (QUEUED, RUNNING, CANCELLING)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
PULL, PUSH, DATASET_PULL = "pull", "push", "dataset_pull"  # a model pull is a "pull"
KINDS = (PULL, PUSH, DATASET_PULL)


def create(
    session: Session,
    *,
    kind: str,
    repo_id: str,
    revision: str | None,
    active_key: str,
    target: str,
    plan: dict[str, Any],
    bytes_total: int,
) -> tuple[HubTransfer, bool]:
    """A new queued transfer, or the active one with the same ``active_key`` (False: not new)."""
    row = HubTransfer(
        id=uuid.uuid4().hex,
        kind=kind,
        repo_id=repo_id,
        revision=revision,
        active_key=active_key,
        status=QUEUED,
        plan=plan,
        target=target,
        bytes_total=bytes_total,
        bytes_done=0,
        progress_seq=0,
        attempts=0,
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        existing = active(session, active_key=active_key)
        if existing is None:  # it finished between the insert and the read: try once more
            session.add(row)
            session.commit()
            return row, True
        return existing, False
    return row, True


def active(session: Session, *, active_key: str) -> HubTransfer | None:
    return session.scalars(select(HubTransfer).where(HubTransfer.active_key == active_key)).first()


def get(session: Session, *, transfer_id: str) -> HubTransfer | None:
    return session.get(HubTransfer, transfer_id)


def get_many(session: Session, *, transfer_ids: list[str]) -> list[HubTransfer]:
    return list(session.scalars(select(HubTransfer).where(HubTransfer.id.in_(transfer_ids))))


def listing(session: Session, *, kind: str | None = None, limit: int = 100) -> list[HubTransfer]:
    query = select(HubTransfer).order_by(HubTransfer.created_at.desc()).limit(limit)
    if kind is not None:
        query = query.where(HubTransfer.kind == kind)
    return list(session.scalars(query))


def claimable(session: Session) -> list[str]:
    """Transfers a worker may take: queued, or running/cancelling with an expired lease."""
    stale = or_(HubTransfer.lease_until.is_(None), HubTransfer.lease_until < now())
    query = (
        select(HubTransfer.id)
        .where(or_(HubTransfer.status == QUEUED, HubTransfer.status.in_((RUNNING, CANCELLING)) & stale))
        .order_by(HubTransfer.created_at)
    )
    return list(session.scalars(query))


def claim(session: Session, *, transfer_id: str, worker_id: str, lease_seconds: float) -> HubTransfer | None:
    """Take a transfer with one conditional update; None when another worker has it."""
    row = session.get(HubTransfer, transfer_id)
    if row is None or row.status not in ACTIVE:
        return None
    if row.status != QUEUED and row.lease_until is not None and row.lease_until > now():
        return None
    previous_status = row.status
    taken = session.execute(
        update(HubTransfer)
        .where(
            HubTransfer.id == transfer_id,
            HubTransfer.status == previous_status,
            or_(HubTransfer.lease_until.is_(None), HubTransfer.lease_until < now()),
        )
        .values(
            status=RUNNING if previous_status == QUEUED else previous_status,
            worker_id=worker_id,
            lease_until=now() + timedelta(seconds=lease_seconds),
            attempts=HubTransfer.attempts + 1,
            started_at=now() if row.started_at is None else row.started_at,
            progress_seq=HubTransfer.progress_seq + 1,
        )
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return None
    session.commit()
    session.refresh(row)
    return row


def progress(
    session: Session,
    *,
    transfer_id: str,
    worker_id: str,
    bytes_done: int,
    bytes_per_s: float | None,
    lease_seconds: float,
    bytes_total: int | None = None,
) -> str | None:
    """Record progress (and the total, once known) and renew the lease; returns the status
    (``cancelling``: stop)."""
    values: dict[str, Any] = {
        "bytes_done": bytes_done,
        "bytes_per_s": bytes_per_s,
        "lease_until": now() + timedelta(seconds=lease_seconds),
        "progress_seq": HubTransfer.progress_seq + 1,
    }
    if bytes_total is not None:
        values["bytes_total"] = bytes_total
    session.execute(
        update(HubTransfer)
        .where(HubTransfer.id == transfer_id, HubTransfer.worker_id == worker_id)
        .values(**values)
    )
    session.commit()
    return status_of(session, transfer_id=transfer_id)


def status_of(session: Session, *, transfer_id: str) -> str | None:
    return session.scalars(select(HubTransfer.status).where(HubTransfer.id == transfer_id)).first()


def finish(
    session: Session,
    *,
    transfer_id: str,
    status: str,
    error: str | None = None,
    error_code: str | None = None,
    target: str | None = None,
    bytes_done: int | None = None,
    bytes_total: int | None = None,
    plan: dict[str, Any] | None = None,
) -> None:
    values: dict[str, Any] = {
        "status": status,
        "error": error,
        "error_code": error_code,
        "active_key": None,
        "lease_until": None,
        "finished_at": now(),
        "progress_seq": HubTransfer.progress_seq + 1,
    }
    if target is not None:
        values["target"] = target
    if bytes_done is not None:
        values["bytes_done"] = bytes_done
    if bytes_total is not None:
        values["bytes_total"] = bytes_total
    if plan is not None:
        values["plan"] = plan
    session.execute(update(HubTransfer).where(HubTransfer.id == transfer_id).values(**values))
    session.commit()


def cancel(session: Session, *, transfer_id: str) -> HubTransfer | None:
    """Ask a transfer to stop: a queued one is cancelled at once, a running one becomes
    ``cancelling`` and its worker stops it. Returns the row (None: no such transfer)."""
    row = session.get(HubTransfer, transfer_id)
    if row is None:
        return None
    if row.status == QUEUED:
        finish(session, transfer_id=transfer_id, status=CANCELLED, error="cancelled before it started")
    elif row.status == RUNNING:
        session.execute(
            update(HubTransfer)
            .where(HubTransfer.id == transfer_id, HubTransfer.status == RUNNING)
            .values(status=CANCELLING, progress_seq=HubTransfer.progress_seq + 1)
        )
        session.commit()
    session.refresh(row)
    return row
