"""``/v1/models``: the base models and the fine-tuned ones (``ft:...`` names), and the download of a
fine-tuned model or checkpoint by its name."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool

from server.api.openai.shapes import ModelList, ModelObject, documented
from server.deps import SessionDep, SettingsDep, StorageDep, current_key
from server.downloads import archive_response
from server.errors import ApiError
from server.schemas import LINE_PATTERN, TAR_FILE
from server.services import archives, fine_tuned, models, openai_compat
from server.settings import Settings
from server.storage import Storage
from server.tables import Checkpoint, Job

router = APIRouter(
    prefix="/v1/models", tags=["openai"], dependencies=[Depends(current_key)], responses=documented(400, 401)
)
# a fine-tuned model's name holds its base model's, which may hold a "/" (an organization/name)
ModelPath = Annotated[str, PathParam(pattern=LINE_PATTERN, max_length=512)]


def _base(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "system"}


def _fine_tuned(name: str, job: Job) -> dict[str, Any]:
    created = openai_compat.unix(job.finished_at or job.created_at) or 0
    return {"id": name, "object": "model", "created": created, "owned_by": fine_tuned.ORGANIZATION}


def _created(info: models.BaseModelInfo) -> int:
    try:
        return int(info.path.stat().st_mtime) if info.path is not None else 0
    except OSError:
        return 0


def _resolve(session: SessionDep, model: str, storage: Storage | None = None) -> tuple[Job, Checkpoint]:
    try:
        return fine_tuned.resolve_model(session, name=model, storage=storage)
    except LookupError as exc:
        raise ApiError(404, "not_found", str(exc), param="model") from exc


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, settings: SettingsDep) -> Any:
    """The base models (as GET /api/models lists them) and every succeeded job's fine-tuned model."""
    base = [_base(m.name, _created(m)) for m in models.discover(settings.models_dir, settings.hf_cache_dir)]
    tuned = [_fine_tuned(fine_tuned.model_name(j), j) for j in fine_tuned.fine_tuned_jobs(session)]
    return {"object": "list", "data": base + tuned}


def _base_model(settings: Settings, model: str) -> dict[str, Any] | None:
    info = models.find(model, settings.models_dir, settings.hf_cache_dir)
    return _base(info.name, _created(info)) if info is not None else None


@router.get(
    "/{model:path}/content",
    response_class=Response,
    responses={200: TAR_FILE, **documented(404)},
)
async def download_model(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    model: ModelPath,
    merged: Annotated[bool, Query(description="LoRA only: merge the adapter into its base model")] = False,
) -> Response:
    """Download a fine-tuned model or checkpoint by name: GET /api/jobs/{id}/checkpoints/{step}/download."""
    job, checkpoint = await run_in_threadpool(_resolve, session, model, storage)  # it asks the store
    choice = archives.choose(merged=merged)
    return await archive_response(job, checkpoint, choice, settings=settings, storage=storage)


@router.get("/{model:path}", response_model=ModelObject, responses=documented(404))
def retrieve_model(session: SessionDep, settings: SettingsDep, model: ModelPath) -> Any:
    """One model: a base model, a fine-tuned model or a checkpoint (``ft:...``)."""
    if fine_tuned.parse_model(model) is None:
        found = _base_model(settings, model)
        if found is None:
            raise ApiError(404, "not_found", f"no model {model!r} (see GET /v1/models)", param="model")
        return found
    job, _ = _resolve(session, model)
    return _fine_tuned(model, job)
