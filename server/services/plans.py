"""Plans: a job request as the planner's workload, and the hardware the workers report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from engine.planner import Hardware, Workload
from server.services import gpus, jobs

NOT_READ = "(not read: planning only)"  # the training file and output folder a plan never touches


def workload(*, request: dict[str, Any], num_sequences: int | None) -> Workload:
    """The workload of a job request, through the TrainConfig ``POST /api/jobs`` would build.

    Args:
        request: the request's fields (``JobBase`` and ``base_model``), as a dict.
        num_sequences: the training dataset's rows, when one is named (steps from ``hyper.epochs``).

    Raises:
        ValueError: an invalid section; a ``ConfigError`` whose ``field`` is the dotted field name.
    """
    config = jobs.build_config(
        request=request,
        model_path=request.get("base_model") or "demo",
        train_path=NOT_READ,
        validation_path=None,
        output_dir=Path(NOT_READ),
    )
    return Workload.from_train_config(config, num_sequences=num_sequences)


def hardware(session: Session, *, given: dict[str, Any], stale_after: float) -> Hardware:
    """The given hardware; what it leaves out is read off the workers' telemetry when one has GPUs.

    Args:
        given: ``Hardware`` fields the caller set (GPU count and memory, rate, link, host RAM).
        stale_after: seconds after which a worker that stopped sampling counts as offline.
    """
    fields = dict(given)
    detected = []
    hosts = [h for h in gpus.hosts(session, stale_after=stale_after) if h["online"]]
    with_gpus = [h for h in hosts if h["gpu"]]
    if with_gpus:
        devices = with_gpus[0]["devices"]
        if "num_gpus" not in fields:
            fields["num_gpus"] = len(devices)
            detected.append("GPU count")
        memory = [d["memory_total"] for d in devices if d.get("memory_total")]
        if memory and "gpu_memory_gb" not in fields:
            fields["gpu_memory_gb"] = min(memory) / 1e9
            detected.append("GPU memory")
    if hosts and "host_ram_gb" not in fields and hosts[0]["cpu"].get("memory_total"):
        fields["host_ram_gb"] = hosts[0]["cpu"]["memory_total"] / 1e9
        detected.append("host RAM")
    return Hardware(**fields, detected=tuple(detected))
