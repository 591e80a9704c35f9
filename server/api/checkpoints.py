"""``/api/jobs/{id}/checkpoints``: list a job's checkpoints and download them as archives."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from server.deps import JobDep, SessionDep, SettingsDep, current_key
from server.errors import ApiError, documented
from server.schemas import CheckpointsPublic
from server.services import checkpoints

router = APIRouter(
    prefix="/api/jobs",
    tags=["checkpoints"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 404, 422),
)


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(session: SessionDep, job: JobDep) -> Any:
    """The job's checkpoints on disk: step, kind (adapter or full) and the metrics at that step."""
    return {"data": checkpoints.list_for(session, job_id=job.id)}


@router.get("/{job_id}/checkpoints/{step}/download")
async def download_checkpoint(
    session: SessionDep,
    settings: SettingsDep,
    job: JobDep,
    step: int,
    merged: Annotated[bool, Query(description="LoRA only: merge the adapter into its base model")] = False,
) -> FileResponse:
    """A .tar of the checkpoint's export with a SHA-256 manifest (optionally merged into the base)."""
    checkpoint = checkpoints.get(session, job_id=job.id, step=step)
    if checkpoint is None:
        raise ApiError(404, "not_found", f"job {job.id!r} has no checkpoint at step {step}", param="step")
    exports = Path(job.output_dir) / "exports"
    folder = Path(checkpoint.path)
    name = f"{job.id[:8]}-step{step:06d}"
    if merged:
        if checkpoint.kind != "adapter":
            raise ApiError(
                422, "invalid_request", "merged: only a LoRA adapter can be merged", param="merged"
            )
        from engine.model.loading import resolve_model_path

        base = resolve_model_path(job.config["model"]["path"], settings.models_dir)
        folder = await run_in_threadpool(checkpoints.merged_folder, checkpoint, base=base, exports=exports)
        name += "-merged"
    else:
        name += f"-{checkpoint.kind}"
    archive = await run_in_threadpool(checkpoints.build_archive, folder, exports / f"{name}.tar")
    return FileResponse(archive, media_type="application/x-tar", filename=f"{name}.tar")
