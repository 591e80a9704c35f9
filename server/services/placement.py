"""Placement: where a job may run (one host by name, a GPU count), as Celery queues.

Every worker consumes the default queue, ``host.<its host name>`` and ``gpus.<k>`` for k = 1 up
to its GPU count (a CPU-only worker counts 1). A job pinned to a host is sent to that host's
queue; one asking for N GPUs to ``gpus.<N>``; one asking for both to the host's queue (the claim
checks the count). The claim checks the placement again, so a message that reaches the wrong
worker (a requeue, an old message) is left for another one.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from server.kinds import EventKind
from server.services.job_states import add_event
from server.tables import Job

HOST_QUEUE = "host."
GPUS_QUEUE = "gpus."


def normalized(placement: dict[str, Any] | None) -> dict[str, Any] | None:
    """The placement as stored: None when it pins nothing."""
    if not placement:
        return None
    out = {k: placement.get(k) for k in ("host", "gpus")}
    return out if any(v is not None for v in out.values()) else None


def gpu_slots(gpus: int) -> int:
    """The GPU count a worker offers to placement: a CPU-only worker runs one-device jobs."""
    return max(gpus, 1)


def queue_for(default: str, placement: dict[str, Any] | None) -> str:
    """The queue a job with this placement is sent to."""
    placement = normalized(placement)
    if placement is None:
        return default
    if placement.get("host"):
        return f"{default}.{HOST_QUEUE}{placement['host']}"
    return f"{default}.{GPUS_QUEUE}{int(placement['gpus'])}"


def worker_queues(default: str, *, host: str, gpus: int) -> list[str]:
    """The queues a worker on ``host`` with ``gpus`` GPUs consumes."""
    return [
        default,
        f"{default}.{HOST_QUEUE}{host}",
        *(f"{default}.{GPUS_QUEUE}{k}" for k in range(1, gpu_slots(gpus) + 1)),
    ]


def fits(placement: dict[str, Any] | None, *, host: str, gpus: int) -> bool:
    """Whether a worker on ``host`` with ``gpus`` GPUs may run a job with this placement."""
    placement = normalized(placement)
    if placement is None:
        return True
    if placement.get("host") and placement["host"] != host:
        return False
    return placement.get("gpus") is None or int(placement["gpus"]) <= gpu_slots(gpus)


def describe(placement: dict[str, Any] | None) -> str:
    """For people: "host gpu-b with 4 GPUs", "a host with 2 GPUs", "any host"."""
    placement = normalized(placement)
    if placement is None:
        return "any host"
    count = placement.get("gpus")
    with_gpus = f" with {count} GPU{'s' if count != 1 else ''}" if count is not None else ""
    return f"host {placement['host']}{with_gpus}" if placement.get("host") else f"a host{with_gpus}"


def satisfiable(placement: dict[str, Any] | None, hosts: list[dict[str, Any]]) -> bool:
    """Whether an online worker (``gpus.hosts`` rows) fits the placement now."""
    return any(fits(placement, host=h["hostname"], gpus=len(h["devices"])) for h in hosts if h.get("online"))


def record(session: Session, *, job: Job, where: dict[str, Any], hosts: list[dict[str, Any]]) -> None:
    """Store a new job's placement (before its message is sent). A placement no online worker fits
    is accepted (a worker may start later) with a log event that says what it waits for."""
    job.placement = where
    if not satisfiable(where, hosts):
        add_event(
            session,
            job_id=job.id,
            kind=EventKind.LOG,
            message=f"waiting for {describe(where)}: no online worker has it now",
            data={"placement": where, "waiting": True},
            commit=False,
        )
    session.commit()
