"""``/api/methods``: the training methods a job can use (``method.objective``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.deps import current_key
from server.errors import documented
from server.schemas import MethodsPublic
from server.services import methods

router = APIRouter(
    prefix="/api/methods",
    tags=["methods"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 422),
)


@router.get("", response_model=MethodsPublic)
def list_methods() -> Any:
    """The training methods: the data each needs, its fields, its metrics, what it can train."""
    return {"data": methods.listing()}
