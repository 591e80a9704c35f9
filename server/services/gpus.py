"""GPU telemetry: the latest sample of every worker host, written by the workers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.tables import Worker, now


@dataclass(frozen=True)
class Endpoint:
    """Where the other boxes of a job on several hosts reach a worker (``worker.network``): its
    advertised address, its rendezvous port, its NIC and the NIC's nominal speed in Gb/s."""

    address: str
    port: int
    interface: str | None
    link_gbps: float | None


def record(
    session: Session,
    *,
    worker_id: str,
    hostname: str,
    devices: list[dict[str, Any]],
    cpu: dict[str, float],
    message: str,
    inference: tuple[str, str] | None = None,
    endpoint: Endpoint | None = None,
) -> None:
    """Store a host's latest sample (one row per worker, replaced each time), where its
    inference service answers (``(url, token)``), if it runs one, and where the other boxes of a
    job on several hosts reach it (``endpoint``)."""
    row = session.get(Worker, worker_id)
    if row is None:
        row = Worker(id=worker_id, hostname=hostname)
        session.add(row)
    stamp = now()
    row.hostname, row.devices, row.cpu, row.message = hostname, devices, cpu, message
    row.sampled_at = row.heartbeat_at = stamp
    row.inference_url, row.inference_token = inference or (None, None)
    if endpoint is not None:
        row.address, row.rendezvous_port = endpoint.address, endpoint.port
        row.interface, row.link_gbps = endpoint.interface, endpoint.link_gbps
    session.commit()


def job_sample(session: Session, *, worker_id: str) -> dict[str, float]:
    """The host's latest sample as flat keys (``gpu/<i>/utilization``, ``host/memory_used``...), for
    a job's telemetry events, so a job keeps its devices' history. Empty for an unknown worker."""
    row = session.get(Worker, worker_id)
    if row is None:
        return {}
    out = {
        "host/cpu_utilization": float(row.cpu.get("utilization", 0.0)),
        "host/memory_used": float(row.cpu.get("memory_used", 0.0)),
    }
    for d in row.devices:
        for key in ("utilization", "memory_used"):
            if d.get(key) is not None:
                out[f"gpu/{d['index']}/{key}"] = float(d[key])
    return out


def hosts(session: Session, *, stale_after: float) -> list[dict[str, Any]]:
    """Every worker host with its devices; ``online`` is false once it stopped sampling."""
    limit = now() - timedelta(seconds=stale_after)
    out = []
    for row in session.scalars(select(Worker).order_by(Worker.hostname, Worker.id)):
        out.append(
            {
                "worker": row.id,
                "hostname": row.hostname,
                "gpu": bool(row.devices),
                "message": row.message,
                "devices": row.devices,
                "cpu": row.cpu,
                "sampled_at": row.sampled_at,
                "heartbeat_at": row.heartbeat_at,
                "online": row.heartbeat_at >= limit,
                "address": row.address,
                "rendezvous_port": row.rendezvous_port,
                "interface": row.interface,
                "link_gbps": row.link_gbps,
                "link_measured_gbps": row.link_measured_gbps,
            }
        )
    return out


def by_host(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``hosts()``'s workers grouped by host name (a job runs on one host's GPUs): each host with
    its workers (online first, newest heartbeat first), whether one is online, its GPU count (the
    most an online worker reports) and when it was last seen."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        grouped.setdefault(w["hostname"], []).append(w)
    out = []
    for name, members in sorted(grouped.items()):
        members.sort(key=lambda w: (not w["online"], -w["heartbeat_at"].timestamp()))
        online = [w for w in members if w["online"]]
        out.append(
            {
                "hostname": name,
                "online": bool(online),
                "gpus": max((len(w["devices"]) for w in online), default=0),
                "last_seen": max(w["heartbeat_at"] for w in members),
                "workers": members,
            }
        )
    return out


def plan_host(session: Session, *, stale_after: float, host: str | None) -> dict[str, Any] | None:
    """The one host a plan is made for (a job runs on one host's GPUs): ``host`` when named, else
    the online host with the most GPUs (by name among equals); as its newest online worker's row
    (``hosts()``: hostname, devices, cpu). None when no worker of it is online."""
    online = [h for h in by_host(hosts(session, stale_after=stale_after)) if h["online"]]
    if host is not None:
        online = [h for h in online if h["hostname"] == host]
    if not online:
        return None
    best = min(online, key=lambda h: (-h["gpus"], h["hostname"]))
    worker: dict[str, Any] = best["workers"][0]
    return worker
