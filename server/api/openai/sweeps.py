"""``/v1/fine_tuning/sweeps`` (our extension): a fine-tuning job request whose hyperparameters a
sweep searches; the trials are fine-tuning jobs (``GET /v1/fine_tuning/jobs/ftjob-...``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.api.openai.fine_tuning import job_request, named
from server.api.openai.shapes import FineTuningSweepCreate, documented
from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError
from server.schemas import SweepCreate, SweepPublic
from server.services import sweeps
from server.services.failures import Refusal

router = APIRouter(
    prefix="/v1/fine_tuning/sweeps",
    tags=["openai"],
    dependencies=[Depends(current_key)],
    responses=documented(400, 401),
)


@router.post("", response_model=SweepPublic, responses=documented(404))
def create_sweep(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, body: FineTuningSweepCreate
) -> Any:
    """Create a sweep of fine-tuning jobs (as POST /api/sweeps)."""
    request, method_type, given = job_request(session, body)
    try:
        spec = SweepCreate(job=request, **body.sweep.model_dump())
        sweep = sweeps.create(session, request=spec, settings=settings, storage=storage)
    except Refusal as exc:
        if exc.param and exc.param.startswith("job."):
            exc.param = exc.param.removeprefix("job.")
            raise named(exc, method_type=method_type, given=given) from exc
        param = f"sweep.{exc.param}" if exc.param else None
        raise ApiError(400, exc.code, exc.message, param=param) from exc
    return sweeps.view(session, sweep=sweep)


@router.get("/{sweep_id}", response_model=SweepPublic, responses=documented(404))
def get_sweep(session: SessionDep, sweep_id: str) -> Any:
    """A sweep with its trials (as GET /api/sweeps/{id})."""
    return sweeps.view(session, sweep=sweeps.get(session, sweep_id=sweep_id))


@router.post("/{sweep_id}/cancel", response_model=SweepPublic, responses=documented(404))
def cancel_sweep(session: SessionDep, sweep_id: str) -> Any:
    """Cancel a sweep's unfinished trials."""
    sweep = sweeps.get(session, sweep_id=sweep_id)
    sweeps.cancel(session, sweep=sweep)
    return sweeps.view(session, sweep=sweep)
