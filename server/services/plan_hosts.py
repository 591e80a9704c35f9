"""The boxes a plan is for: a job's ``placement.hosts`` (N, or "auto": as many online hosts as fit
it, within what its batch gives work to and no fewer than ``min_hosts``), the host planned among
them, and the network between them.

The link is what the hosts registered (``gpus.hosts``): the all-reduce rate their last job on
several hosts measured when every box has one (the slowest), else their NICs' nominal speed
(the slowest reported), else ``NOMINAL_LINK_GBPS`` (10 Gbit/s), said to be nominal. Every box is
planned as the smallest of the hosts picked (the fewest GPUs): the slowest box sets the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from engine.planner import NOMINAL_LINK_GBPS, Hosts, Workload, max_hosts
from server.services import gpus, placement


@dataclass(frozen=True)
class PlannedHosts:
    """A plan's boxes: ``hosts`` (count and link), the host to plan the box for (None: the
    service's usual pick, ``gpus.plan_host``) and what the plan says of where they come from."""

    hosts: Hosts
    host: str | None
    facts: dict[str, Any] = field(default_factory=dict)


def planned_hosts(
    session: Session, *, where: dict[str, Any] | None, workload: Workload, stale_after: float
) -> PlannedHosts:
    """The boxes of a job request's ``placement`` (``where``, as a dict) and their link.

    Args:
        where: the request's placement (``host``, ``gpus``, ``hosts``, ``min_hosts``), or None.
        workload: the job (its batch bounds "auto").
        stale_after: seconds after which a worker that stopped sampling counts as offline.
    """
    where = where or {}
    asked = where.get("hosts") or 1
    if asked == 1:
        return PlannedHosts(Hosts(), where.get("host"))
    # the hosts the scheduler may reserve (``boxes.reserve``): online, fitting, reachable (an
    # address registered), by name
    fitting = [
        h
        for h in gpus.by_host(gpus.hosts(session, stale_after=stale_after))
        if h["online"]
        and h["workers"][0].get("address")
        and placement.fits(where, host=h["hostname"], gpus=h["gpus"])
    ]
    fewest, most = placement.host_range(where, online=len(fitting))
    # "auto": as many as are free, within what the batch gives work to; N: N, free now or not
    count = max(fewest, min(most, max_hosts(workload))) if asked == placement.AUTO else most
    picked = fitting[:count]
    rows = [h["workers"][0] for h in picked]  # each host's newest online worker
    measured = [r.get("link_measured_gbps") for r in rows]
    nics = [r["link_gbps"] for r in rows if r.get("link_gbps")]
    if rows and len(rows) == count and all(measured):
        link, source = min(float(m) for m in measured if m), "measured"
    elif nics:
        link, source = min(float(n) for n in nics), "nic"
    else:
        link, source = NOMINAL_LINK_GBPS, "nominal"
    facts = {
        "hosts_requested": asked,
        "hosts_online": len(fitting),
        "hosts_planned": [h["hostname"] for h in picked],
        "link_source": source,
    }
    smallest = min(picked, key=lambda h: (h["gpus"], h["hostname"]))["hostname"] if picked else None
    return PlannedHosts(Hosts(count, link_gbps=link, link_measured=source == "measured"), smallest, facts)
