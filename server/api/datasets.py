"""``/api/datasets``: upload (streamed, validated), list, get, preview, delete."""

from __future__ import annotations

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool

from server.deps import SessionDep, SettingsDep, current_key
from server.errors import ApiError, documented
from server.schemas import DatasetPublic, DatasetsPublic, PreviewPublic, StatsPublic
from server.services import datasets, models
from server.settings import Settings

router = APIRouter(
    prefix="/api/datasets",
    tags=["datasets"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 422),
)


def _found(session: SessionDep, dataset_id: str) -> Any:
    found = datasets.get_dataset(session, dataset_id=dataset_id)
    if found is None:
        raise ApiError(404, "not_found", f"no dataset {dataset_id!r}", param="dataset_id")
    return found


_tokenizers: dict[str, Any] = {}
_tokenizer_lock = threading.Lock()  # the first import of transformers is not safe from two threads


def _tokenizer(settings: Settings, model: str) -> Any:
    """The tokenizer of a base model, loaded once per folder."""
    folder = models.usable_folder(model, settings.models_dir, settings.hf_cache_dir)
    if folder is None:
        raise ApiError(404, "not_found", f"no base model {model!r} (see GET /api/models)", param="model")
    from engine.model.loading import load_tokenizer

    with _tokenizer_lock:
        key = str(folder)
        if key not in _tokenizers:
            if len(_tokenizers) >= 8:
                _tokenizers.pop(next(iter(_tokenizers)))
            _tokenizers[key] = load_tokenizer(folder)
        return _tokenizers[key]


@router.post("", response_model=DatasetPublic, status_code=201, responses=documented(413))
async def upload_dataset(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File(description="JSONL, CSV or Parquet")],
    name: Annotated[str | None, Form(max_length=255)] = None,
) -> Any:
    """Upload a dataset file; it is validated row by row and kept only if every row is valid."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > settings.max_upload_bytes + 65536:
        raise ApiError(413, "too_large", f"the upload exceeds the limit of {settings.max_upload_bytes} bytes")
    try:
        stored, report = await run_in_threadpool(
            datasets.store_upload,
            session,
            source=file.file,
            filename=file.filename or "dataset",
            name=name,
            datasets_dir=settings.datasets_dir,
            max_bytes=settings.max_upload_bytes,
        )
    except datasets.TooLarge as exc:
        raise ApiError(413, "too_large", str(exc), param="file") from exc
    except ValueError as exc:
        raise ApiError(422, "invalid_dataset", str(exc), param="file") from exc
    if stored is None:
        errors = report.to_dict()["errors"]
        head = "; ".join(f"{e['unit']} {e['line']}: {e['message']}" for e in errors[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        message = f"{len(errors)} invalid row(s), nothing was stored: {head}{more}"
        raise ApiError(422, "invalid_dataset", message, param="file", details=errors)
    return stored


@router.get("", response_model=DatasetsPublic)
def list_datasets(session: SessionDep) -> Any:
    """Every stored dataset, newest first."""
    return {"data": datasets.list_datasets(session)}


@router.get("/{dataset_id}", response_model=DatasetPublic, responses=documented(404))
def get_dataset(session: SessionDep, dataset_id: str) -> Any:
    """One dataset."""
    return _found(session, dataset_id)


@router.get("/{dataset_id}/preview", response_model=PreviewPublic, responses=documented(404))
def preview_dataset(
    session: SessionDep,
    settings: SettingsDep,
    dataset_id: str,
    model: Annotated[str, Query(description="base model whose chat template renders the rows")] = "demo",
    limit: Annotated[int, Query(ge=1, le=50)] = 5,
    max_length: Annotated[int, Query(ge=8, le=1 << 17)] = 1024,
) -> Any:
    """The first rows rendered through a model's chat template, trained tokens marked."""
    dataset = _found(session, dataset_id)
    tokenizer = _tokenizer(settings, model)
    rows = datasets.preview(dataset, tokenizer=tokenizer, limit=limit, max_length=max_length)
    return {"dataset_id": dataset.id, "model": model, "rows": rows}


@router.get("/{dataset_id}/stats", response_model=StatsPublic, responses=documented(404))
def dataset_stats(
    session: SessionDep,
    settings: SettingsDep,
    dataset_id: str,
    model: Annotated[str, Query(description="base model whose tokenizer counts the tokens")] = "demo",
    max_length: Annotated[int, Query(ge=8, le=1 << 20)] = 1024,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 2000,
) -> Any:
    """Token-length histogram of the first rows, and the share longer than ``max_length``."""
    dataset = _found(session, dataset_id)
    tokenizer = _tokenizer(settings, model)
    return datasets.token_stats(dataset, tokenizer=tokenizer, max_length=max_length, limit=limit)


@router.delete("/{dataset_id}", status_code=204, responses=documented(404, 409))
def delete_dataset(session: SessionDep, dataset_id: str) -> None:
    """Delete a dataset that no job uses."""
    dataset = _found(session, dataset_id)
    user = datasets.in_use(session, dataset_id=dataset_id)
    if user is not None:
        raise ApiError(409, "in_use", f"dataset {dataset_id!r} is used by job {user!r}", param="dataset_id")
    datasets.delete_dataset(session, dataset=dataset)
