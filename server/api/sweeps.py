"""``/api/sweeps``: price, create, list, get and cancel hyperparameter sweeps (their trials are jobs)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.errors import documented
from server.schemas import SweepCreate, SweepPlanPublic, SweepPublic, SweepsPublic
from server.services import sweeps

router = APIRouter(
    prefix="/api/sweeps", tags=["sweeps"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


@router.post("/plan", response_model=SweepPlanPublic, responses=documented(400, 404))
def plan_sweep(session: SessionDep, settings: SettingsDep, storage: StorageDep, body: SweepCreate) -> Any:
    """Price a sweep without starting it: each trial's fit and ETA, and the total."""
    return sweeps.price(session, request=body, settings=settings, storage=storage)


@router.post("", response_model=SweepPublic, status_code=201, responses=documented(400, 404))
def create_sweep(session: SessionDep, settings: SettingsDep, storage: StorageDep, body: SweepCreate) -> Any:
    """Start a sweep: priced first, then its trials queued as jobs that run one after another."""
    sweep = sweeps.create(session, request=body, settings=settings, storage=storage)
    return sweeps.view(session, sweep=sweep)


@router.get("", response_model=SweepsPublic)
def list_sweeps(session: SessionDep, limit: Annotated[int, Query(ge=1, le=200)] = 50) -> Any:
    """Sweeps, newest first."""
    return {"data": [sweeps.view(session, sweep=s) for s in sweeps.list_sweeps(session, limit=limit)]}


@router.get("/{sweep_id}", response_model=SweepPublic, responses=documented(404))
def get_sweep(session: SessionDep, sweep_id: str) -> Any:
    """One sweep with its trials' table and the best trial."""
    return sweeps.view(session, sweep=sweeps.get(session, sweep_id=sweep_id))


@router.post("/{sweep_id}/cancel", response_model=SweepPublic, responses=documented(404))
def cancel_sweep(session: SessionDep, sweep_id: str) -> Any:
    """Cancel a sweep: its queued trials at once, its running one at its next step."""
    sweep = sweeps.get(session, sweep_id=sweep_id)
    sweeps.cancel(session, sweep=sweep)
    return sweeps.view(session, sweep=sweep)
