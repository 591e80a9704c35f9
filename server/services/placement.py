"""Placement: where a job may run (one host by name, a GPU count, several hosts), as Celery queues.

Every worker consumes the default queue, ``host.<its host name>`` and ``gpus.<k>`` for k = 1 up
to its GPU count (a CPU-only worker counts 1). A job pinned to a host is sent to that host's
queue; one asking for N GPUs to ``gpus.<N>``; one asking for both to the host's queue (the claim
checks the count). The claim checks the placement again, so a message that reaches the wrong
worker (a requeue, an old message) is left for another one.

A job on several hosts (``hosts`` N or "auto") goes to the default queue: the worker that takes
it reserves the hosts (``services.boxes``) and sends each its box's task on its host queue.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from server.kinds import EventKind
from server.services.job_states import add_event
from server.tables import Job

HOST_QUEUE = "host."
GPUS_QUEUE = "gpus."
AUTO = "auto"  # ``hosts``: as many free hosts as fit


def normalized(placement: dict[str, Any] | None) -> dict[str, Any] | None:
    """The placement as stored: None when it pins nothing."""
    if not placement:
        return None
    out = {k: placement.get(k) for k in ("host", "gpus")}
    if several(placement):  # stored only for a job on several hosts (one host: as before)
        out |= {"hosts": placement["hosts"], "min_hosts": placement.get("min_hosts")}
    return out if any(v is not None for v in out.values()) else None


def several(placement: dict[str, Any] | None) -> bool:
    """Whether the placement asks for more than one host (``hosts`` above 1, or "auto")."""
    hosts = (placement or {}).get("hosts")
    return hosts == AUTO or (isinstance(hosts, int) and hosts > 1)


def host_range(placement: dict[str, Any] | None, *, online: int) -> tuple[int, int]:
    """(fewest, most) hosts the job may run on now: N and ``min_hosts`` (default N); for "auto",
    ``min_hosts`` (default 1) up to the ``online`` hosts that fit it."""
    placement = placement or {}
    hosts = placement.get("hosts")
    if hosts == AUTO:
        return int(placement.get("min_hosts") or 1), max(online, 1)
    most = int(hosts or 1)
    return int(placement.get("min_hosts") or most), most


def gpu_slots(gpus: int) -> int:
    """The GPU count a worker offers to placement: a CPU-only worker runs one-device jobs."""
    return max(gpus, 1)


def queue_for(default: str, placement: dict[str, Any] | None) -> str:
    """The queue a job with this placement is sent to."""
    placement = normalized(placement)
    if placement is None or several(placement):
        return default
    if placement.get("host"):
        return host_queue(default, placement["host"])
    return f"{default}.{GPUS_QUEUE}{int(placement['gpus'])}"


def worker_queues(default: str, *, host: str, gpus: int) -> list[str]:
    """The queues a worker on ``host`` with ``gpus`` GPUs consumes."""
    return [
        default,
        host_queue(default, host),
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


def host_queue(default: str, host: str) -> str:
    """The queue only the workers of ``host`` consume (a box's task goes there)."""
    return f"{default}.{HOST_QUEUE}{host}"


def describe(placement: dict[str, Any] | None) -> str:
    """For people: "host gpu-b with 4 GPUs", "a host with 2 GPUs", "any host", "2 hosts (at
    least 1) with 4 GPUs each"."""
    placement = normalized(placement)
    if placement is None:
        return "any host"
    count = placement.get("gpus")
    with_gpus = f" with {count} GPU{'s' if count != 1 else ''}" if count is not None else ""
    if several(placement):
        hosts, fewest = placement["hosts"], placement.get("min_hosts")
        many = "as many hosts as fit" if hosts == AUTO else f"{hosts} hosts"
        least = f" (at least {fewest})" if fewest is not None else ""
        return f"{many}{least}{with_gpus}{' each' if with_gpus else ''}"
    return f"host {placement['host']}{with_gpus}" if placement.get("host") else f"a host{with_gpus}"


def satisfiable(placement: dict[str, Any] | None, hosts: list[dict[str, Any]]) -> bool:
    """Whether online workers (``gpus.hosts`` rows) fit the placement now: one, or for a job on
    several hosts, as many hosts as it needs at the fewest."""
    online = {
        h["hostname"]
        for h in hosts
        if h.get("online") and fits(placement, host=h["hostname"], gpus=len(h["devices"]))
    }
    return bool(online) and len(online) >= host_range(placement, online=len(online))[0]


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
