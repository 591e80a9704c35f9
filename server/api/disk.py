"""``/api/disk``: the disk use of every job's folder and of the datasets, and the space left."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.errors import documented
from server.schemas import DiskPublic
from server.services import disk

router = APIRouter(
    prefix="/api/disk", tags=["disk"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)


@router.get("", response_model=DiskPublic)
def get_disk(session: SessionDep, settings: SettingsDep, storage: StorageDep) -> Any:
    """Bytes on disk: all jobs' folders, the datasets, free space, and jobs paused for space."""
    return disk.usage(
        session, storage=storage, runs_dir=settings.runs_dir, reserve_bytes=settings.checkpoint_reserve_bytes
    )
