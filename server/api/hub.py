"""The Hugging Face Hub: model pulls (``/api/models/pulls``), dataset pulls (``/api/datasets/pulls``),
checkpoint pushes, and the transfers they all are (``/api/transfers``: progress, events, cancel)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import StreamingResponse

from server.deps import IdPath, JobDep, SessionDep, SettingsDep, StorageDep, current_key
from server.errors import ApiError, documented
from server.hf_hub.child import HubError
from server.hf_hub.runner import transfer_payload
from server.schemas import (
    EVENT_STREAM,
    MAX_INT,
    DatasetPullCreate,
    ModelDeleted,
    ModelPullCreate,
    PushCreate,
    TransferKind,
    TransferPublic,
    TransfersPublic,
)
from server.services import hub, transfers
from server.settings import Settings
from server.streams import stream_key, transfer_stream

router = APIRouter(
    prefix="/api", tags=["hub"], dependencies=[Depends(current_key)], responses=documented(401, 422)
)
stream_router = APIRouter(prefix="/api", tags=["hub"], responses=documented(401, 422))
# the Hub refused (403, 404), is off here (409), or cannot be reached or failed (424: the request
# depended on the Hub; a 5xx would say this server is broken, and the user can act on it)
HUB_ERRORS = (403, 404, 409, 424)


def refused(
    exc: HubError, settings: Settings, *, repo_id: str, revision: str | None = None, param: str = "repo_id"
) -> ApiError:
    """The Hub's refusal as this API's error: what happened and what to do about it."""
    token = settings.hub_token is not None
    page = f"{settings.hub_endpoint.rstrip('/')}/{repo_id}"
    if exc.kind == "offline":
        return ApiError(409, "hub_offline", exc.message, param=param)
    if exc.kind == "gated":
        todo = (
            "the token's account has not accepted its licence: accept it on the Hub"
            if token
            else "accept its licence on the Hub, then set ROUNDHOUSE_HUB_TOKEN to a token of that account"
        )
        return ApiError(403, "hub_gated", f"{repo_id} is a gated repo ({page}): {todo}", param=param)
    if exc.kind == "forbidden":
        todo = "the token has no access to it" if token else "set ROUNDHOUSE_HUB_TOKEN to a token with access"
        message = (
            f"the Hub refused access to {repo_id} (HTTP {exc.status}): {todo}"
            " (a gated repo: accept its licence on the Hub)"
        )
        return ApiError(403, "hub_forbidden", message, param=param)
    if exc.kind == "repo_not_found":
        hint = "" if token else " (a private repo needs ROUNDHOUSE_HUB_TOKEN)"
        return ApiError(404, "not_found", f"no repo {repo_id!r} on the Hub{hint}", param=param)
    if exc.kind == "revision_not_found":
        return ApiError(
            404, "not_found", f"{repo_id} has no revision {revision!r} on the Hub", param="revision"
        )
    if exc.kind == "split_not_found":
        return ApiError(404, "not_found", exc.message, param="split")
    if exc.kind == "bad_split":
        return ApiError(422, "invalid_dataset", exc.message, param="split")
    if exc.kind == "no_config":
        return ApiError(422, "unsupported_model", exc.message, param=param)
    if exc.kind == "unreachable":
        return ApiError(
            424,
            "hub_unreachable",
            f"the Hub at {settings.hub_endpoint} cannot be reached (check the network, or"
            f" ROUNDHOUSE_HUB_ENDPOINT; ROUNDHOUSE_HUB_OFFLINE=1 turns the Hub off): {exc.message}",
        )
    return ApiError(424, "hub_error", f"the Hub at {settings.hub_endpoint} failed: {exc.message}")


def _found(session: SessionDep, transfer_id: IdPath) -> Any:
    row = transfers.get(session, transfer_id=transfer_id)
    if row is None:
        raise ApiError(404, "not_found", f"no transfer {transfer_id!r}", param="transfer_id")
    return row


@router.post(
    "/models/pulls", response_model=TransferPublic, status_code=201, responses=documented(400, *HUB_ERRORS)
)
def pull_model(session: SessionDep, settings: SettingsDep, body: ModelPullCreate, response: Response) -> Any:
    """Pull a model from the Hub into the models folder (a worker downloads it).

    Only ``config.json`` is read here: an architecture the engine cannot train, or a download the
    disk cannot hold, is refused before any weight moves. A pull of a repo already under way is
    answered with that pull (200)."""
    try:
        row, created = hub.request_pull(session, settings, repo_id=body.repo_id, revision=body.revision)
    except HubError as exc:
        raise refused(exc, settings, repo_id=body.repo_id, revision=body.revision) from exc
    if not created:
        response.status_code = 200
    return transfer_payload(row)


@router.get("/models/pulls", response_model=TransfersPublic)
def list_pulls(session: SessionDep) -> Any:
    """Model pulls, newest first: status, bytes done and total, speed, ETA."""
    return {"data": [transfer_payload(r) for r in transfers.listing(session, kind=transfers.PULL)]}


@router.delete("/models/{name:path}", response_model=ModelDeleted, responses=documented(404, 409))
def delete_model(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    name: Annotated[str, Path(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")],
) -> Any:
    """Delete a model of the models folder (a pulled one too) and say how many bytes that freed."""
    return {"name": name, "freed_bytes": hub.delete_model(session, settings, storage, name=name)}


@router.post(
    "/datasets/pulls",
    response_model=TransferPublic,
    status_code=202,
    responses=documented(400, 413, *HUB_ERRORS),
)
def pull_dataset(
    session: SessionDep, settings: SettingsDep, body: DatasetPullCreate, response: Response
) -> Any:
    """Pull a dataset split from the Hub and store it like an upload (a worker downloads it).

    Only the file list is read here: a split over the upload limit, or one the disk cannot hold,
    is refused before a byte of it moves. The worker validates every row as for an upload; a
    split with invalid rows fails its transfer with them (``details``, by line). Its progress:
    ``GET /api/transfers/{id}`` and its stream; dataset pulls: ``GET /api/transfers?kind=dataset_pull``.
    A pull of the same split at the same commit under way is answered with that pull (200)."""
    try:
        row, created = hub.request_dataset_pull(
            session,
            settings,
            repo_id=body.repo_id,
            split=body.split,
            config=body.config,
            revision=body.revision,
            name=body.name,
        )
    except HubError as exc:
        raise refused(exc, settings, repo_id=body.repo_id, revision=body.revision) from exc
    if not created:
        response.status_code = 200
    return transfer_payload(row)


@router.post(
    "/jobs/{job_id}/checkpoints/{step}/push",
    response_model=TransferPublic,
    status_code=202,
    responses=documented(400, 404, 409),
)
def push_checkpoint(
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    job: JobDep,
    step: Annotated[int, Path(ge=0, le=MAX_INT)],
    body: PushCreate,
    response: Response,
) -> Any:
    """Push a checkpoint to a Hub repo (created if needed) with a model card (a worker builds the
    export in the format asked for, as a download does, and uploads it)."""
    try:
        row, created = hub.request_push(
            session,
            settings,
            storage,
            job=job,
            step=step,
            repo_id=body.repo_id,
            private=body.private,
            format=body.format.value,
            variant=body.variant,
        )
    except HubError as exc:
        raise refused(exc, settings, repo_id=body.repo_id) from exc
    if not created:
        response.status_code = 200
    return transfer_payload(row)


@router.get("/transfers", response_model=TransfersPublic)
def list_transfers(session: SessionDep, kind: TransferKind | None = None) -> Any:
    """Pulls and pushes, newest first (``kind``: only those)."""
    return {"data": [transfer_payload(r) for r in transfers.listing(session, kind=kind)]}


@router.get("/transfers/{transfer_id}", response_model=TransferPublic, responses=documented(404))
def get_transfer(row: Annotated[Any, Depends(_found)]) -> Any:
    """One pull or push: status, bytes done and total, speed, ETA, error."""
    return transfer_payload(row)


@router.post("/transfers/{transfer_id}/cancel", response_model=TransferPublic, responses=documented(404))
def cancel_transfer(session: SessionDep, settings: SettingsDep, row: Annotated[Any, Depends(_found)]) -> Any:
    """Cancel a pull or push: nothing of a cancelled pull stays on disk."""
    return transfer_payload(hub.cancel(session, settings, transfer=row))


def _stream_transfer(request: Request, transfer_id: IdPath) -> str:
    stream_key(request)
    with request.app.state.sessions() as session:
        return str(_found(session, transfer_id).id)


@stream_router.get(
    "/transfers/{transfer_id}/stream",
    response_class=StreamingResponse,
    responses={200: EVENT_STREAM, **documented(404)},
)
def stream_transfer(
    request: Request, transfer_id: Annotated[str, Depends(_stream_transfer)]
) -> StreamingResponse:
    """Server-sent events of a pull or push: its progress as it changes, then ``end``."""
    return StreamingResponse(
        transfer_stream(request.app.state.streams, transfer_id=transfer_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
