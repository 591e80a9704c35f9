"""``/api/jobs/{id}/checkpoints``: list a job's checkpoints, download them as archives, and clear
a checkpoint's cached merged build."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.deps import JobDep, SessionDep, SettingsDep, current_key
from server.errors import ApiError, documented
from server.schemas import MAX_INT, TAR_FILE, CheckpointsPublic
from server.services import checkpoints
from server.tables import Checkpoint, Job

StepPath = Annotated[int, PathParam(ge=0, le=MAX_INT)]

router = APIRouter(
    prefix="/api/jobs",
    tags=["checkpoints"],
    dependencies=[Depends(current_key)],
    responses=documented(401, 404, 422),
)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The one range ``bytes=A-B``, ``bytes=A-`` or ``bytes=-N`` a Range header asks of ``size``
    bytes, as ``(start, end)`` with ``end`` excluded; None for the whole file (a server may ignore
    a Range it does not serve, and this one serves no other kind)."""
    # at most 18 digits a side: past that no file is that large, and int() of thousands of
    # digits is refused by Python (a 500); such a header is ignored like any other we do not serve
    found = re.fullmatch(r"bytes=(\d{0,18})-(\d{0,18})", header or "")
    if found is None or found[1] == found[2] == "":
        return None
    if found[1] == "":
        start, end = max(0, size - int(found[2])), size
    else:
        start, end = int(found[1]), min(size, int(found[2]) + 1) if found[2] else size
    return (start, end) if start < end else None


class WholeFileResponse(Response):
    """A file (or the one range of it asked for) sent whole or not at all.

    Starlette's ``FileResponse`` takes the Content-Length from a ``stat`` made before it opens the
    file and ends the body cleanly wherever the file ends. This one sends the length of the file
    it opened and raises if that file ends early, so the server drops the connection and the
    client sees an incomplete body rather than a complete-looking short one."""

    chunk_size = 1 << 20

    def __init__(self, path: Path, *, filename: str, media_type: str) -> None:
        self.path, self.status_code, self.media_type, self.background = path, 200, media_type, None
        self.init_headers(
            {"content-disposition": f'attachment; filename="{filename}"', "accept-ranges": "bytes"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stop_on_disconnect() -> None:  # an ASGI 2.3 server ignores sends after it
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(stop_on_disconnect)
            await self._send_file(Headers(scope=scope).get("range"), send)
            group.cancel_scope.cancel()

    async def _send_file(self, range_header: str | None, send: Send) -> None:
        async with await anyio.open_file(self.path, "rb") as f:
            size = os.fstat(f.wrapped.fileno()).st_size
            start, end = byte_range(range_header, size) or (0, size)
            if (start, end) != (0, size):
                self.status_code = 206
                self.headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
                await f.seek(start)
            left = end - start
            self.headers["content-length"] = str(left)
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            while True:
                chunk = await f.read(min(self.chunk_size, left))
                left -= len(chunk)
                if not chunk and left:
                    raise RuntimeError(f"{self.path.name} ended {left} bytes short of its Content-Length")
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
                if not left:
                    return


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(session: SessionDep, job: JobDep) -> Any:
    """The job's checkpoints on disk: step, kind (adapter or full) and the metrics at that step."""
    return {"data": checkpoints.list_for(session, job_id=job.id)}


def _found(session: SessionDep, job: Job, step: int) -> Checkpoint:
    checkpoint = checkpoints.get(session, job_id=job.id, step=step)
    if checkpoint is None:
        raise ApiError(404, "not_found", f"job {job.id!r} has no checkpoint at step {step}", param="step")
    return checkpoint


def _merged_target(job: Job, step: int) -> Path:
    return Path(job.output_dir) / "exports" / f"{job.id[:8]}-step{step:06d}-merged.tar"


@router.get(
    "/{job_id}/checkpoints/{step}/download",
    response_class=Response,
    responses={200: TAR_FILE, 206: TAR_FILE | {"description": "the one byte range asked for (Range)"}},
)
async def download_checkpoint(
    session: SessionDep,
    settings: SettingsDep,
    job: JobDep,
    step: StepPath,
    merged: Annotated[bool, Query(description="LoRA only: merge the adapter into its base model")] = False,
) -> Response:
    """A .tar of the checkpoint's export, one top folder with a README and a SHA-256 manifest."""
    checkpoint = _found(session, job, step)
    from engine.model.export import base_model_name

    model = job.config["model"]
    base_name = base_model_name(model.get("name"), Path(model["path"]))
    folder = Path(checkpoint.path)
    kind = "merged" if merged else checkpoint.kind
    if merged and checkpoint.kind != "adapter":
        raise ApiError(422, "invalid_request", "merged: only a LoRA adapter can be merged", param="merged")
    target = (
        _merged_target(job, step)
        if merged
        else Path(job.output_dir) / "exports" / f"{job.id[:8]}-step{step:06d}-{kind}.tar"
    )
    top = target.name.removesuffix(".tar")
    text = checkpoints.readme(kind=kind, base_name=base_name, top=top, step=step, job_name=job.name)
    if merged:
        from engine.model.loading import resolve_model_path

        base = resolve_model_path(model["path"], settings.models_dir)
        merge = checkpoints.merged_archive
        build = functools.partial(merge, checkpoint, base=base, target=target, readme=text)
    else:
        fixed = checkpoints.adapter_config(folder, base_name=base_name) if kind == "adapter" else {}
        build = functools.partial(checkpoints.build_archive, folder, target, readme=text, replace=fixed)
    archive = await run_in_threadpool(build)
    return WholeFileResponse(archive, media_type="application/x-tar", filename=target.name)


@router.delete("/{job_id}/checkpoints/{step}/merged", status_code=204, responses=documented(404))
def clear_merged(session: SessionDep, job: JobDep, step: StepPath) -> None:
    """Remove the cached merged build of a checkpoint (the next merged download builds it again)."""
    _found(session, job, step)
    leftover = Path(job.output_dir) / "exports" / f"step_{step:06d}-merged"  # older versions' folder
    checkpoints.clear_merged(_merged_target(job, step), leftovers=(leftover,))
