"""``/api/datasets``: upload (streamed, validated), list, get, preview, delete."""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, Response, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from starlette.types import Message

from server.deps import IdPath, SessionDep, SettingsDep, StorageDep, app_settings, caller, current_key
from server.errors import ApiError, documented
from server.schemas import LINE_PATTERN, DatasetPublic, DatasetsPublic, PreviewPublic, StatsPublic
from server.services import datasets, models
from server.settings import Settings
from server.storage import Storage

MULTIPART_OVERHEAD = 65536  # allowed past the file limit for the form's name field, part headers, boundaries


def _too_large(settings: Settings) -> ApiError:
    limit = settings.max_upload_bytes
    return ApiError(413, "too_large", f"the upload exceeds the limit of {limit} bytes", param="file")


def _anonymous(request: Request) -> bool:
    with request.app.state.sessions() as session:
        return caller(request, session) is None


class LimitedBodyRoute(APIRoute):
    """A route whose request body is refused once it passes the upload limit, while it arrives:
    by its Content-Length before any of it is read, and by counting a chunked body as it is read.
    (FastAPI parses a multipart form, spooling the whole file to disk, before the route runs.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            settings = app_settings(request)
            # the caller's key before any of the body: a stranger must not make the server take in
            # (and spool) up to the limit (the route's own key check runs only after the form is read)
            if request.method == "POST" and await run_in_threadpool(_anonymous, request):
                raise ApiError(
                    401, "unauthorized", "a valid API key is required (Authorization: Bearer <key>)"
                )
            limit = settings.max_upload_bytes + MULTIPART_OVERHEAD
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                raise _too_large(settings)
            received = 0

            async def receive() -> Message:
                nonlocal received
                message = await request.receive()
                received += len(message.get("body", b""))
                if received > limit:  # the form parser stops, closes (and so deletes) its temp file
                    raise _too_large(settings)
                return message

            try:
                return await handler(Request(request.scope, receive))
            except Exception:
                if received > limit:  # FastAPI turns any error of the form parser into a 400
                    raise _too_large(settings) from None
                raise

        return limited


router = APIRouter(
    prefix="/api/datasets",
    tags=["datasets"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 422),
    route_class=LimitedBodyRoute,
)


def _found(session: SessionDep, dataset_id: str) -> Any:
    found = datasets.get_dataset(session, dataset_id=dataset_id)
    if found is None:
        raise ApiError(404, "not_found", f"no dataset {dataset_id!r}", param="dataset_id")
    return found


def _file(storage: Storage, settings: Settings, dataset: Any) -> Any:
    """The dataset's file on this host (a copy in the cache when the store is remote)."""
    try:
        return datasets.local_file(storage, dataset, cache=settings.cache_dir)
    except FileNotFoundError as exc:
        raise ApiError(
            404, "not_found", f"dataset {dataset.id!r}: its file is gone", param="dataset_id"
        ) from exc


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


@router.post("", response_model=DatasetPublic, status_code=201, responses=documented(400, 413))
async def upload_dataset(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    file: Annotated[UploadFile, File(description="JSONL, CSV or Parquet")],
    name: Annotated[str | None, Form(max_length=255, pattern=LINE_PATTERN)] = None,
) -> Any:
    """Upload a dataset file; it is validated row by row and kept only if every row is valid."""
    for param, value in (("file", file.filename), ("name", name)):
        if value is not None and "\x00" in value:
            raise ApiError(422, "invalid_request", f"{param}: a NUL byte is not allowed in it", param=param)
    try:
        stored, report = await run_in_threadpool(
            datasets.store_upload,
            session,
            source=file.file,
            filename=file.filename or "dataset",
            name=name,
            storage=storage,
            scratch=settings.cache_dir / "incoming",
            max_bytes=settings.max_upload_bytes,
        )
    except datasets.TooLarge as exc:
        raise ApiError(413, "too_large", str(exc), param="file") from exc
    except ValueError as exc:
        raise ApiError(422, "invalid_dataset", str(exc), param="file") from exc
    if stored is None:
        errors = report.to_dict()["errors"]  # the first MAX_REPORTED_ERRORS
        total = report.errors_total
        head = "; ".join(f"{e['unit']} {e['line']}: {e['message']}" for e in errors[:3])
        more = f" (and {total - 3} more)" if total > 3 else ""
        message = f"{total} invalid row(s), nothing was stored: {head}{more}"
        extra = {"errors_total": total, "errors_truncated": total > len(errors)}
        raise ApiError(422, "invalid_dataset", message, param="file", details=errors, extra=extra)
    return stored


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
    """The first rows through a model's chat template, trained tokens marked (preference: both answers)."""
    dataset = _found(session, dataset_id)
    tokenizer = _tokenizer(settings, model)
    file = _file(storage, settings, dataset)
    rows = datasets.preview(dataset, file=file, tokenizer=tokenizer, limit=limit, max_length=max_length)
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
    tokenizer = _tokenizer(settings, model)
    file = _file(storage, settings, dataset)
    return datasets.token_stats(dataset, file=file, tokenizer=tokenizer, max_length=max_length, limit=limit)


@router.delete("/{dataset_id}", status_code=204, responses=documented(404, 409))
def delete_dataset(session: SessionDep, storage: StorageDep, dataset_id: IdPath) -> None:
    """Delete a dataset that no job uses."""
    dataset = _found(session, dataset_id)
    user = datasets.in_use(session, dataset_id=dataset_id)
    if user is not None:
        raise ApiError(409, "in_use", f"dataset {dataset_id!r} is used by job {user!r}", param="dataset_id")
    datasets.delete_dataset(session, dataset=dataset, storage=storage)
