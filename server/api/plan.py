"""``/api/plan``: will a job fit on the workers' GPUs (or CPU), and how long will it take?"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.errors import documented
from server.schemas import PlanPublic, PlanRequest
from server.services import plans

router = APIRouter(
    prefix="/api", tags=["plan"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


@router.post("/plan", response_model=PlanPublic, responses=documented(400, 404, 409))
def plan(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, body: PlanRequest
) -> dict[str, Any]:
    """Fit (and what to change), memory by stage, host RAM, longest sequence, tokens/s and ETA of a job."""
    return plans.plan(session, request=body, settings=settings, storage=storage)
