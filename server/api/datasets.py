"""``/api/datasets``: upload (streamed, validated), list, get, preview, delete; the data formats."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from engine.data import Family
from server.deps import IdPath, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.limits import LimitedBodyRoute
from server.schemas import (
    LINE_PATTERN,
    DatasetPublic,
    DatasetsPublic,
    PreviewPublic,
    StatsPublic,
)
from server.services import datasets, tokenizers, uploads
from server.settings import Settings
from server.storage import Storage

router = APIRouter(
    prefix="/api/datasets",
    tags=["datasets"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 422),
    route_class=LimitedBodyRoute,  # the upload is refused while it arrives, past the limit
)


# the data formats' listing (engine.data.formats): its shape belongs with server/schemas.py's
class DataFormatPublic(BaseModel):
    """A data format (``engine.data.formats``): a row shape a dataset file can hold."""

    name: str = Field(description='the value of data.format and a dataset\'s format, e.g. "chat"')
    title: str = Field(description='a short label, e.g. "prompt/completion"')
    family: Family = Field(description="the data_format of the methods that train on it (GET /api/methods)")
    description: str = Field(description="the row's fields in a line")
    measures: str = Field(description="what a row's token statistics count, when not the row itself")


class DataFormatsPublic(BaseModel):
    data: list[DataFormatPublic]


def _found(session: SessionDep, dataset_id: str) -> Any:
    found = datasets.get_dataset(session, dataset_id=dataset_id)
    if found is None:
        raise ApiError(404, "not_found", f"no dataset {dataset_id!r}", param="dataset_id")
    return found


def _scratch(settings: Settings) -> Path:
    """Where uploads arrive (and hold the image lock)."""
    return settings.cache_dir / "incoming"


def _file(storage: Storage, settings: Settings, dataset: Any) -> Any:
    """The dataset's file on this host (a copy in the cache when the store is remote)."""
    try:
        return datasets.local_file(storage, dataset, cache=settings.cache_dir)
    except FileNotFoundError as exc:
        raise ApiError(
            404, "not_found", f"dataset {dataset.id!r}: its file is gone", param="dataset_id"
        ) from exc


def _images(storage: Storage, settings: Settings, dataset: Any) -> Path | None:
    """The image store's folder on this host with the dataset's images (None: it names none)."""
    try:
        return datasets.local_images(storage, dataset, cache=settings.cache_dir)
    except FileNotFoundError as exc:
        raise ApiError(404, "not_found", f"dataset {dataset.id!r}: {exc}", param="dataset_id") from exc


@contextlib.contextmanager
def _refused(model: str) -> Iterator[None]:
    """A row the model cannot render (images, and a text model) as a 422 naming ``model``."""
    try:
        yield
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"model {model!r}: {exc}", param="model") from exc


@router.post("", response_model=DatasetPublic, status_code=201, responses=documented(400, 413))
async def upload_dataset(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    file: Annotated[
        UploadFile,
        File(
            description="JSONL, CSV or Parquet; or a zip, tar or tar.gz of one with the image files it names"
        ),
    ],
    name: Annotated[str | None, Form(max_length=255, pattern=LINE_PATTERN)] = None,
) -> Any:
    """Upload a dataset file, or a zip/tar of one with its images; it is validated row by row and
    kept only if every row is valid (its images stored once each)."""

    def upload() -> Any:
        return uploads.upload(
            session,
            source=file.file,
            filename=file.filename,
            name=name,
            storage=storage,
            scratch=_scratch(settings),
            max_bytes=settings.max_upload_bytes,
            fetch_urls=settings.allow_image_urls,
        )

    return await run_in_threadpool(upload)


@router.get("/formats", response_model=DataFormatsPublic)
def list_formats() -> Any:
    """Every data format a dataset file may hold, in the order uploads are described."""
    return {"data": datasets.formats()}


@router.get("", response_model=DatasetsPublic)
def list_datasets(session: SessionDep) -> Any:
    """Every stored dataset, newest first."""
    return {"data": datasets.list_datasets(session)}


@router.get("/{dataset_id}", response_model=DatasetPublic, responses=documented(404))
def get_dataset(session: SessionDep, dataset_id: IdPath) -> Any:
    """One dataset."""
    return _found(session, dataset_id)


@router.get("/{dataset_id}/preview", response_model=PreviewPublic, responses=documented(404))
def preview_dataset(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    dataset_id: IdPath,
    model: Annotated[str, Query(description="base model whose chat template renders the rows")] = "demo",
    limit: Annotated[int, Query(ge=1, le=50)] = 5,
    max_length: Annotated[int, Query(ge=8, le=1 << 17)] = 1024,
) -> Any:
    """The first rows through a model's chat template, trained tokens marked (preference: both
    answers; prompts: the prompt and its grader fields, ``item``)."""
    dataset = _found(session, dataset_id)
    tokenizer = tokenizers.of_model(model, models_dir=settings.models_dir, hf_cache=settings.hf_cache_dir)
    file, images_dir = _file(storage, settings, dataset), _images(storage, settings, dataset)
    with _refused(model):
        rows = datasets.preview(
            dataset, file=file, tokenizer=tokenizer, limit=limit, max_length=max_length, images_dir=images_dir
        )
    return {"dataset_id": dataset.id, "model": model, "rows": rows}


@router.get("/{dataset_id}/stats", response_model=StatsPublic, responses=documented(404))
def dataset_stats(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    dataset_id: IdPath,
    model: Annotated[str, Query(description="base model whose tokenizer counts the tokens")] = "demo",
    max_length: Annotated[int, Query(ge=8, le=1 << 20)] = 1024,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 2000,
) -> Any:
    """Token-length histogram of the first rows, and the share longer than ``max_length``."""
    dataset = _found(session, dataset_id)
    tokenizer = tokenizers.of_model(model, models_dir=settings.models_dir, hf_cache=settings.hf_cache_dir)
    file, images_dir = _file(storage, settings, dataset), _images(storage, settings, dataset)
    with _refused(model):
        return datasets.token_stats(
            dataset, file=file, tokenizer=tokenizer, max_length=max_length, limit=limit, images_dir=images_dir
        )


@router.delete("/{dataset_id}", status_code=204, responses=documented(404, 409))
def delete_dataset(
    session: SessionDep, settings: SettingsDep, storage: StorageDep, dataset_id: IdPath
) -> None:
    """Delete a dataset no unfinished job uses (a finished job keeps its record, and cannot resume)."""
    dataset = _found(session, dataset_id)
    user = datasets.in_use(session, dataset_id=dataset_id)
    if user is not None:
        message = f"dataset {dataset_id!r} is used by job {user!r}, which has not finished"
        raise ApiError(409, "in_use", message, param="dataset_id")
    datasets.delete_dataset(session, dataset=dataset, storage=storage, lock_dir=_scratch(settings))
