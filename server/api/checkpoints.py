"""``/api/jobs/{id}/checkpoints``: list a job's checkpoints and the export formats they download
in, download them as archives, and clear a checkpoint's cached merged build.

A download is a .tar built once per checkpoint (and format) from the checkpoint's export and kept
in the store beside it, ``runs/<job id>/exports/<name>.tar``; with a remote store the export
(not its resume state) is pulled into the API host's cache (``home/cache/<key>``) to build it,
and a merged build takes its base model from this host's models, else from the store's
``models/<name>``. Later downloads send the
stored archive: from the local file (byte ranges served), streamed from the store, or, with
``storage_presigned_downloads``, as a 307 redirect to a presigned URL of it."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from starlette.responses import Response

from engine.export import GGUF, VARIANTS, FormatInfo, formats_help, variants_help
from server.deps import JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.downloads import archive_response
from server.errors import ApiError, documented
from server.schemas import MAX_INT, TAR_FILE, CheckpointsPublic, ExportFormatName
from server.services import archives, checkpoints
from server.storage import Storage
from server.tables import Checkpoint, Job

StepPath = Annotated[int, PathParam(ge=0, le=MAX_INT)]
# the values a download accepts, from the export-format registry (``engine.export.formats``; its
# formats: ``schemas.ExportFormatName``, which a push takes too)
ExportVariant = StrEnum("ExportVariant", {name: name for name in VARIANTS})  # type: ignore[misc]
GgufQuant = StrEnum("GgufQuant", {name: name for name in GGUF.variants})  # type: ignore[misc]


class ExportFormatsPublic(BaseModel):
    """The export formats of a job's checkpoints (the web UI's downloads)."""

    data: list[FormatInfo]


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


@router.get("/{job_id}/checkpoints/formats", response_model=ExportFormatsPublic)
def list_export_formats(job: JobDep) -> Any:
    """The formats the job's checkpoints download in (format, variants), and why one is refused."""
    return {"data": archives.formats_for(job)}


def _found(session: SessionDep, storage: Storage, job: Job, step: int) -> Checkpoint:
    checkpoint = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if checkpoint is None:
        raise ApiError(404, "not_found", f"job {job.id!r} has no checkpoint at step {step}", param="step")
    return checkpoint


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
    format: Annotated[
        ExportFormatName | None,
        Query(description=formats_help()),
    ] = None,
    variant: Annotated[
        ExportVariant | None,
        Query(description=variants_help()),
    ] = None,
    merged: Annotated[bool, Query(description="the same as format=merged", deprecated=True)] = False,
    gguf: Annotated[
        GgufQuant | None, Query(description="the same as format=gguf&variant=GGUF", deprecated=True)
    ] = None,
) -> Response:
    """A .tar of the checkpoint's export, one top folder with a README and a SHA-256 manifest."""
    checkpoint = await run_in_threadpool(_found, session, storage, job, step)  # it asks the store
    choice = archives.choose(
        format=format and format.value,
        variant=variant and variant.value,
        merged=merged,
        gguf=gguf and gguf.value,
    )
    return await archive_response(job, checkpoint, choice, settings=settings, storage=storage)


@router.delete("/{job_id}/checkpoints/{step}/merged", status_code=204, responses=documented(404))
def clear_merged(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, job: JobDep, step: StepPath
) -> None:
    """Remove the cached merged build of a checkpoint (the next merged download builds it again)."""
    _found(session, storage, job, step)
    archives.clear_merged(job=job, step=step, settings=settings, storage=storage)
