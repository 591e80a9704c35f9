"""``/api/models``: the base models a job can start from."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.deps import SettingsDep, current_key
from server.errors import documented
from server.schemas import ModelsPublic
from server.services import models

router = APIRouter(
    prefix="/api/models", tags=["models"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


@router.get("", response_model=ModelsPublic)
def list_models(settings: SettingsDep) -> Any:
    """Base models: the demo, the models folder, and the local Hugging Face cache.

    Each says its family and, for a mixture of experts, its expert counts. A folder the engine
    cannot train (an unknown architecture, a broken ``config.json``) is listed too, with
    ``supported`` false and the reason; a job or plan with it is refused."""
    found = models.discover(settings.models_dir, settings.hf_cache_dir)
    return {"data": [vars(m) for m in found]}
