"""``/api/plan``: will a job fit on the workers' GPUs (or CPU), and how long will it take?"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from server import schemas
from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.errors import documented
from server.schemas import PlanRequest
from server.services import plans


class PlanExchange(BaseModel):
    """A job on several hosts: the gradient exchange of each step (``engine.planner.exchange``)."""

    hosts: int = Field(description="the boxes the job spans")
    gradient_bytes: float = Field(description="the fp32 gradients of the trained weights each box holds")
    bytes_per_step: float = Field(description="what each box sends (and receives) a step: a ring all-reduce")
    seconds: float = Field(description="the exchange's time a step")
    link_gbps: float = Field(description="the link it was priced at, Gbit/s")
    link_measured: bool = Field(
        description="the rate an earlier job on these hosts measured (false: their NICs' nominal speed, "
        "or 10 Gbit/s when none is reported, at 85% of it)"
    )
    hidden: bool = Field(description="the asynchronous optimizer hides it behind the next iteration")
    exposed_s: float = Field(description="what it adds to each step (0 when hidden)")


class PlanPublic(schemas.PlanPublic):
    """The planner's answer (``engine.planner.PlanReport``); sizes in GB (1e9 bytes). A job on
    several hosts (``placement.hosts``) is planned as one box's share of each batch, with the
    gradient exchange between the boxes priced in."""

    hosts: int = Field(1, description='the boxes the job is planned on (placement.hosts; "auto": those free)')
    exchange: PlanExchange | None = Field(
        None, description="the gradient exchange of each step between the boxes; null on one host"
    )
    one_box: dict[str, Any] | None = Field(
        None, description="the whole batch on one box: fits, step_s, tokens_per_s; null on one host"
    )
    scaling: float | None = Field(
        None,
        description="the job's tokens/s over one box's with the whole batch (e.g. 1.86 on 2 hosts); null on "
        "one host or when either does not fit",
    )


router = APIRouter(
    prefix="/api", tags=["plan"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


@router.post("/plan", response_model=PlanPublic, responses=documented(400, 404, 409))
def plan(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, body: PlanRequest
) -> dict[str, Any]:
    """Fit (and what to change), memory by stage, host RAM, longest sequence, tokens/s and ETA of a job."""
    return plans.plan(session, request=body, settings=settings, storage=storage)
