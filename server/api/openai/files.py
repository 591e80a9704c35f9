"""``/v1/files``: OpenAI's Files API over our datasets (a file is a stored, validated dataset),
and each stopped job's result file (``file-results-<job id>``, its metrics by step as a CSV)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response

from server.api.openai.shapes import FileDeleted, FileList, FileObject, documented
from server.deps import IdPath, SessionDep, SettingsDep, StorageDep, current_key
from server.downloads import stored_response
from server.errors import ApiError
from server.limits import LimitedBodyRoute
from server.services import datasets, jobs, openai_compat, openai_results, uploads
from server.services.openai_compat import FILE
from server.tables import Dataset, Job

router = APIRouter(
    prefix="/v1/files",
    tags=["openai"],
    dependencies=[Depends(current_key)],
    responses=documented(400, 401),
    route_class=LimitedBodyRoute,  # the upload is refused while it arrives, past the limit
)


def found_file(session: SessionDep, file_id: IdPath) -> Dataset:
    """The dataset a ``{file_id}`` names (``file-<dataset id>``, or the dataset id), or the 404."""
    dataset = datasets.get_dataset(session, dataset_id=openai_compat.ours(file_id, FILE))
    if dataset is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}", param="file_id")
    return dataset


def found_results(session: SessionDep, file_id: IdPath) -> Job | None:
    """The job whose result file ``{file_id}`` names, None for another file; or the 404."""
    job_id = openai_results.job_id_of(file_id)
    if job_id is None:
        return None
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}", param="file_id")
    return job


ResultsDep = Annotated[Job | None, Depends(found_results)]


@router.post("", response_model=FileObject, responses=documented(413))
async def create_file(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    file: Annotated[
        UploadFile, File(description="JSONL, CSV or Parquet rows (chat, prompt/completion, ...)")
    ],
    purpose: Annotated[str, Form(description='"fine-tune", the one purpose kept here')],
) -> Any:
    """Upload a training file: validated row by row, and stored only if every row is valid."""
    if purpose != "fine-tune":
        raise ApiError(
            400, "invalid_purpose", f"purpose {purpose!r}: only 'fine-tune' is kept", param="purpose"
        )
    stored = await run_in_threadpool(
        uploads.upload,
        session,
        source=file.file,
        filename=file.filename,
        name=None,
        storage=storage,
        scratch=settings.cache_dir / "incoming",
        max_bytes=settings.max_upload_bytes,
        fetch_urls=settings.allow_image_urls,
    )
    return openai_compat.file_object(stored)


@router.get("", response_model=FileList)
def list_files(
    session: SessionDep,
    after: Annotated[
        str | None, Query(max_length=255, description="the last file id of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Literal["asc", "desc"], Query(description="by created_at")] = "desc",
    purpose: Annotated[str | None, Query(max_length=255, description="only files of this purpose")] = None,
) -> Any:
    """The files (every stored dataset), newest first by default, paged by ``after``."""
    if purpose not in (None, "fine-tune"):
        return {"object": "list", "data": [], "has_more": False}
    try:
        page, more = openai_compat.page_files(session, after=after, limit=limit, newest_first=order == "desc")
    except openai_compat.Invalid as exc:
        raise ApiError(400, "invalid_request", str(exc), param=exc.param) from exc
    data = [openai_compat.file_object(d) for d in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "has_more": more, "first_id": first, "last_id": last}


@router.get("/{file_id}", response_model=FileObject, responses=documented(404))
def retrieve_file(session: SessionDep, file_id: IdPath, results: ResultsDep) -> Any:
    """One file."""
    if results is not None:
        size = len(openai_results.content(session, job=results))
        return openai_results.file_object(results, size=size)
    return openai_compat.file_object(found_file(session, file_id))


@router.delete("/{file_id}", response_model=FileDeleted, responses=documented(404, 409))
def delete_file(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, file_id: IdPath, results: ResultsDep
) -> Any:
    """Delete a file that no unfinished fine-tuning job uses (finished jobs keep their record)."""
    if results is not None:
        message = f"{file_id!r} is the result file of job 'ftjob-{results.id}': it goes when the job does"
        raise ApiError(409, "in_use", message, param="file_id")
    dataset = found_file(session, file_id)
    user = datasets.in_use(session, dataset_id=dataset.id)
    if user is not None:
        message = (
            f"file {FILE + dataset.id!r} is used by fine-tuning job 'ftjob-{user}', which has not finished"
        )
        raise ApiError(409, "in_use", message, param="file_id")
    ident = FILE + dataset.id
    datasets.delete_dataset(
        session, dataset=dataset, storage=storage, lock_dir=settings.cache_dir / "incoming"
    )
    return {"id": ident, "object": "file", "deleted": True}


@router.get(
    "/{file_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}, "text/csv": {}}},
        307: {"description": "a presigned URL of it in the store (storage_presigned_downloads)"},
        **documented(404),
    },
)
def file_content(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, file_id: IdPath, results: ResultsDep
) -> Response:
    """The file's bytes, as uploaded; a result file's CSV as it is now."""
    if results is not None:
        disposition = f'attachment; filename="{openai_results.FILENAME}"'
        body = openai_results.content(session, job=results)
        return Response(body, media_type="text/csv", headers={"Content-Disposition": disposition})
    dataset = found_file(session, file_id)
    return stored_response(
        storage,
        storage.key_of(dataset.path),
        filename=dataset.filename,
        media_type="application/octet-stream",
        presigned=settings.storage_presigned_downloads,
    )
