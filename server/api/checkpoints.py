"""``/api/jobs/{id}/checkpoints``: list a job's checkpoints, download them as archives, and clear
a checkpoint's cached merged build.

A download is a .tar built once per checkpoint (and kind) from the checkpoint's export and kept
in the store beside it, ``runs/<job id>/exports/<name>.tar``; with a remote store the export
(not its resume state) is pulled into the API host's cache (``home/cache/<key>``) to build it,
and a merged build takes its base model from this host's models, else from the store's
``models/<name>``. Later downloads send the
stored archive: from the local file (byte ranges served), streamed from the store, or, with
``storage_presigned_downloads``, as a 307 redirect to a presigned URL of it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response

from server.api.downloads import WholeFileResponse as WholeFileResponse
from server.api.downloads import byte_range as byte_range
from server.api.downloads import stored_response
from server.deps import JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.schemas import MAX_INT, TAR_FILE, CheckpointsPublic
from server.services import checkpoints
from server.storage import Storage, join
from server.tables import Checkpoint, Job

StepPath = Annotated[int, PathParam(ge=0, le=MAX_INT)]

router = APIRouter(
    prefix="/api/jobs",
    tags=["checkpoints"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 404, 422),
)


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(session: SessionDep, storage: StorageDep, job: JobDep) -> Any:
    """The job's checkpoints in the store: step, kind (adapter or full) and the metrics at that step."""
    return {"data": checkpoints.list_for(session, job_id=job.id, storage=storage)}


def _found(session: SessionDep, storage: Storage, job: Job, step: int) -> Checkpoint:
    checkpoint = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if checkpoint is None:
        raise ApiError(404, "not_found", f"job {job.id!r} has no checkpoint at step {step}", param="step")
    return checkpoint


def _export_key(storage: Storage, job: Job, name: str) -> str:
    return join(storage.key_of(job.output_dir), checkpoints.EXPORTS, name)


def _merged_name(job: Job, step: int) -> str:
    return f"{job.id[:8]}-step{step:06d}-merged.tar"


@router.get(
    "/{job_id}/checkpoints/{step}/download",
    response_class=Response,
    responses={
        200: TAR_FILE,
        206: TAR_FILE | {"description": "the one byte range asked for (Range)"},
        307: {"description": "the archive's presigned URL in the store (storage_presigned_downloads)"},
    },
)
async def download_checkpoint(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    job: JobDep,
    step: StepPath,
    merged: Annotated[bool, Query(description="LoRA only: merge the adapter into its base model")] = False,
) -> Response:
    """A .tar of the checkpoint's export, one top folder with a README and a SHA-256 manifest."""
    checkpoint = _found(session, storage, job, step)
    from engine.model.export import base_model_name

    model = job.config["model"]
    base_name = base_model_name(model.get("name"), Path(model["path"]))
    kind = "merged" if merged else checkpoint.kind
    if merged and checkpoint.kind != "adapter":
        raise ApiError(422, "invalid_request", "merged: only a LoRA adapter can be merged", param="merged")
    name = _merged_name(job, step) if merged else f"{job.id[:8]}-step{step:06d}-{kind}.tar"
    key = _export_key(storage, job, name)
    top = name.removesuffix(".tar")
    text = checkpoints.readme(kind=kind, base_name=base_name, top=top, step=step, job_name=job.name)
    cache = settings.cache_dir

    def build(target: Path) -> Path:
        folder = checkpoints.export_folder(storage, storage.key_of(checkpoint.path), cache=cache)
        if merged:
            from engine.model.loading import resolve_model_path

            path = str(model["path"])
            stored_base = f"models/{job.base_model}"  # a base model only the store holds
            here = path == "demo" or (Path(path) / "config.json").is_file()
            if not here and storage.exists(f"{stored_base}/config.json"):
                path = str(storage.materialize(stored_base, cache))
            base = resolve_model_path(path, settings.models_dir)
            return checkpoints.merged_archive(folder, base=base, target=target, readme=text)
        fixed = checkpoints.adapter_config(folder, base_name=base_name) if kind == "adapter" else {}
        return checkpoints.build_archive(folder, target, readme=text, replace=fixed)

    stored = functools.partial(checkpoints.stored_archive, storage, key, cache=cache, build=build)
    archive = await run_in_threadpool(stored)
    return stored_response(
        storage,
        key,
        filename=name,
        media_type="application/x-tar",
        presigned=settings.storage_presigned_downloads,
        local=archive,
    )


@router.delete("/{job_id}/checkpoints/{step}/merged", status_code=204, responses=documented(404))
def clear_merged(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, job: JobDep, step: StepPath
) -> None:
    """Remove the cached merged build of a checkpoint (the next merged download builds it again)."""
    _found(session, storage, job, step)
    key = _export_key(storage, job, _merged_name(job, step))
    exports = key.rsplit("/", 1)[0]
    leftover = storage.local_path(join(exports, f"step_{step:06d}-merged"))  # older versions' folder
    local = storage.local_path(key) or settings.cache_dir.joinpath(*key.split("/"))
    checkpoints.clear_merged(local, leftovers=(leftover,) if leftover is not None else ())
    storage.delete(key)
