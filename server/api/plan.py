"""``/api/plan``: will a job fit on the workers' GPUs (or CPU), and how long will it take?"""

from __future__ import annotations

import json
import statistics
from typing import Any

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.planner import HARDWARE_RANGES, Hardware, Shape, Workload, calibrate, plan_job
from server.deps import SessionDep, SettingsDep, current_key
from server.errors import ApiError, documented
from server.schemas import PlanPublic, PlanRequest
from server.services import datasets, jobs, models, plans
from server.settings import Settings
from server.storage import open_storage
from server.tables import Dataset

router = APIRouter(
    prefix="/api", tags=["plan"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


def _config_of(name: str, settings: Settings) -> dict[str, Any]:
    found = models.find(name, settings.models_dir, settings.hf_cache_dir)
    if found is None:
        raise ApiError(404, "not_found", f"no base model {name!r} (see GET /api/models)", param="base_model")
    if not found.supported:
        reason = f"base model {name!r} cannot be fine-tuned: {found.unsupported_reason}"
        raise ApiError(422, "unsupported_model", reason, param="base_model")
    if found.path is None:  # the demo before its first preparation: its config ships with the engine
        from engine.model.loading import demo_config

        return demo_config()
    return dict(json.loads((found.path / "config.json").read_text()))


def _dataset(session: Session, dataset_id: str | None, *, param: str = "dataset_id") -> Dataset | None:
    if dataset_id is None:
        return None
    dataset = datasets.get_dataset(session, dataset_id=dataset_id)
    if dataset is None:
        raise ApiError(404, "not_found", f"no dataset {dataset_id!r}", param=param)
    return dataset


def _token_lengths(dataset: Dataset | None, body: PlanRequest, settings: Settings) -> list[int] | None:
    """The training rows' token counts through the base model's tokenizer; None without a
    dataset, for a plan of a bare config.json, before the model's folder is ready (the demo before
    its preparation), or for a dataset the job's method does not train on (``POST /api/jobs``
    refuses that job: preference pairs are DPO's alone): the plan then assumes every sequence is
    ``max_length`` long. A preference dataset's list each pair's two sequences."""
    if dataset is None or body.config is not None:
        return None
    if (dataset.format == "preference") != (body.method.get("kind") == "dpo"):
        return None
    folder = models.usable_folder(body.base_model or "demo", settings.models_dir, settings.hf_cache_dir)
    if folder is None:
        return None
    try:
        file = datasets.local_file(open_storage(settings), dataset, cache=settings.cache_dir)
        return plans.token_lengths(dataset, tokenizer_folder=folder, file=file) or None
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable tokenizer or file: no counts
        return None


def _calibrated(session: Session, settings: Settings, job_id: str, hardware: Hardware) -> Hardware:
    """Scale the assumed rate by what a finished or running job measured on this box."""
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="calibrate_job_id")
    rates = jobs.measured_rates(session, job_id=job_id)
    if not rates:
        raise ApiError(
            409, "not_measured", f"job {job_id!r} has no throughput measured yet", param="calibrate_job_id"
        )
    past = Workload.from_train_config(TrainConfig.model_validate(job.config), on_gpu=hardware.device != "cpu")
    model_config = _config_of(job.base_model, settings)
    try:
        predicted = plan_job(model_config, hardware, past).tokens_per_s
        return calibrate(
            hardware, predicted_tokens_per_s=predicted, measured_tokens_per_s=statistics.median(rates)
        )
    except ValueError as exc:  # e.g. the past job does not fit the hardware given: nothing to scale
        raise ApiError(422, "invalid_request", str(exc), param="calibrate_job_id") from exc


@router.post("/plan", response_model=PlanPublic, responses=documented(400, 404, 409))
def plan(session: SessionDep, settings: SettingsDep, body: PlanRequest) -> dict[str, Any]:
    """Fit (and what to change), memory by stage, host RAM, longest sequence, tokens/s and ETA of a job."""
    model_config = body.config if body.config is not None else _config_of(body.base_model or "demo", settings)
    try:
        Shape.from_config(model_config)
    except ConfigError as exc:
        where = f"config.{exc.field}" if body.config is not None else "base_model"
        raise ApiError(422, "invalid_config", str(exc), param=where) from exc
    dataset = _dataset(session, body.dataset_id)
    validation = _dataset(session, body.validation_dataset_id, param="validation_dataset_id")
    given = body.hardware.model_dump(exclude_none=True)
    host = body.placement.host if body.placement is not None else None
    hardware = plans.hardware(session, given=given, stale_after=settings.telemetry_seconds * 5, host=host)
    try:
        workload = plans.workload(
            request=body.model_dump(),
            num_sequences=int(dataset.rows) if dataset is not None else None,
            on_gpu=hardware.device != "cpu",
            token_lengths=_token_lengths(dataset, body, settings),
            num_validation=int(validation.rows) if validation is not None else None,
        )
    except ValueError as exc:
        field = exc.field if isinstance(exc, ConfigError) else None
        raise ApiError(422, "invalid_config", str(exc), param=field) from exc
    if body.calibrate_job_id:
        hardware = _calibrated(session, settings, body.calibrate_job_id, hardware)
    try:
        report = plan_job(model_config, hardware, workload)
    except ValueError as exc:  # a ConfigError names the field; the partitioner's own checks do not
        param = exc.field if isinstance(exc, ConfigError) else None
        if param in HARDWARE_RANGES:  # given, detected on a worker, or calibrated
            param = f"hardware.{param}"
        raise ApiError(422, "invalid_request", str(exc), param=param) from exc
    return report.to_dict() | {"calibrated_from": body.calibrate_job_id}
