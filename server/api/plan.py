"""``/api/plan``: will a job fit on the workers' GPUs, and how long will it take (before starting it)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from fastapi import APIRouter, Depends
from sqlalchemy import select

from server.deps import SessionDep, SettingsDep, current_key
from server.errors import ApiError
from server.schemas import PlanRequest
from server.services import gpus, jobs, models

router = APIRouter(prefix="/api", tags=["plan"], dependencies=[Depends(current_key)])


def _config_of(name: str, settings: Any) -> dict[str, Any]:
    found = models.find(name, settings.models_dir, settings.hf_cache_dir)
    if found is None:
        raise ApiError(404, "not_found", f"no base model {name!r} (see GET /api/models)", param="base_model")
    if found.path is None:  # the demo before its first preparation: its config ships with the engine
        from engine.model.loading import demo_config

        return demo_config()
    return dict(json.loads((found.path / "config.json").read_text()))


def _hardware(session: Any, settings: Any, body: PlanRequest) -> Any:
    """The request's hardware; what it leaves out is read off the workers' telemetry when one has GPUs."""
    from engine.planner import Hardware

    given = body.hardware.model_dump(exclude_none=True)
    detected = []
    hosts = [h for h in gpus.hosts(session, stale_after=settings.telemetry_seconds * 5) if h["online"]]
    with_gpus = [h for h in hosts if h["gpu"]]
    if with_gpus:
        devices = with_gpus[0]["devices"]
        if "num_gpus" not in given:
            given["num_gpus"] = len(devices)
            detected.append("GPU count")
        memory = [d["memory_total"] for d in devices if d.get("memory_total")]
        if memory and "gpu_memory_gb" not in given:
            given["gpu_memory_gb"] = min(memory) / 1e9
            detected.append("GPU memory")
    if hosts and "host_ram_gb" not in given and hosts[0]["cpu"].get("memory_total"):
        given["host_ram_gb"] = hosts[0]["cpu"]["memory_total"] / 1e9
        detected.append("host RAM")
    return Hardware(**given, detected=tuple(detected))


def _workload(body: PlanRequest) -> Any:
    from engine.planner import Workload

    return Workload(
        seq_len=body.seq_len,
        batch_size=body.batch_size,
        method=body.method,
        lora_r=body.lora_r,
        num_microbatches=body.num_microbatches,
        compute_dtype=body.compute_dtype,
        async_optimizer=body.async_optimizer,
        steps=body.steps,
    )


def _calibrated(session: Any, settings: Any, job_id: str, hardware: Any) -> Any:
    """Scale the assumed rate by what a finished or running job measured on this box."""
    from engine.planner import Workload, calibrate, plan_job

    job = session.get(jobs.Job, job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="calibrate_job_id")
    q = select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id, jobs.JobEvent.kind == "metrics")
    rates = [
        float(e.data["throughput/tokens_per_s"])
        for e in session.scalars(q)
        if "throughput/tokens_per_s" in e.data
    ]
    if not rates:
        raise ApiError(
            409, "not_measured", f"job {job_id!r} has no throughput measured yet", param="calibrate_job_id"
        )
    cfg = job.config
    dtype = cfg["engine"]["compute_dtype"]
    past = Workload(
        seq_len=cfg["data"]["max_length"],
        batch_size=cfg["hyper"]["batch_size"],
        method=cfg["method"]["kind"],
        lora_r=cfg["method"]["lora_r"],
        num_microbatches=cfg["engine"]["num_microbatches"],
        compute_dtype="bfloat16" if dtype == "auto" else dtype,
        async_optimizer=cfg["engine"]["async_optimizer"],
    )
    predicted = plan_job(_config_of(job.base_model, settings), hardware, past).tokens_per_s
    return calibrate(
        hardware, predicted_tokens_per_s=predicted, measured_tokens_per_s=statistics.median(rates)
    )


@router.post("/plan")
def plan(session: SessionDep, settings: SettingsDep, body: PlanRequest) -> dict[str, Any]:
    """Per-stage GPU memory, host RAM, fit (and what to change), predicted tokens/s and ETA."""
    from engine.planner import plan_job

    config = body.config if body.config is not None else _config_of(body.base_model or "demo", settings)
    try:
        hardware = _hardware(session, settings, body)
        if body.calibrate_job_id:
            hardware = _calibrated(session, settings, body.calibrate_job_id, hardware)
        report = plan_job(config, hardware, _workload(body))
    except ValueError as exc:
        param = str(exc).split("=", 1)[0].split(":")[0].strip() or None
        raise ApiError(422, "invalid_request", str(exc), param=param) from exc
    return report.to_dict() | {"calibrated_from": body.calibrate_job_id}
