"""Download responses: a local file sent whole or not at all (with one byte range), or an object
of the store streamed from it, or a redirect to a presigned URL of it; a checkpoint's archive
(``GET /api/jobs/{id}/checkpoints/{step}/download``, ``GET /v1/models/{model}/content``).

An object streamed from the store is opened before the response starts, so a store that does not
answer is a 503 (``StorageUnavailable``, ``server.errors``), and it is sent with the store's
Content-Length: a store that breaks off mid-body drops the connection, and the client sees an
incomplete body, never a complete-looking short one."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import anyio
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.services import archives
from server.settings import Settings
from server.storage import Storage
from server.tables import Checkpoint, Job


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


def stored_response(
    storage: Storage,
    key: str,
    *,
    filename: str,
    media_type: str,
    presigned: bool,
    local: Path | None = None,
) -> Response:
    """The download of object ``key``: a 307 to a presigned URL of it when ``presigned`` (the
    setting ``storage_presigned_downloads``) and the store makes one; else the local file
    (``local``, or the store's own) with byte ranges; else the object streamed from the store,
    opened here (this blocks: call it off the event loop) with its size as the Content-Length.

    Raises:
        StorageUnavailable: the store did not answer (nothing was sent).
        FileNotFoundError: no such object.
    """
    if presigned:
        url = storage.presigned_url(key, filename=filename)
        if url is not None:
            return RedirectResponse(url, status_code=307)
    own = local or storage.local_path(key)
    if own is not None:
        return WholeFileResponse(own, filename=filename, media_type=media_type)
    size, chunks = storage.stream(key)
    headers = {"content-disposition": f'attachment; filename="{filename}"', "content-length": str(size)}
    return StreamingResponse(chunks, media_type=media_type, headers=headers)


async def archive_response(
    job: Job,
    checkpoint: Checkpoint,
    choice: archives.ExportChoice,
    *,
    settings: Settings,
    storage: Storage,
) -> Response:
    """The download of a checkpoint's archive in the export format ``choice`` asks for (built on
    first use, off the event loop)."""
    archive = await run_in_threadpool(
        functools.partial(
            archives.checkpoint_archive,
            job=job,
            checkpoint=checkpoint,
            choice=choice,
            settings=settings,
            storage=storage,
        )
    )
    return await run_in_threadpool(
        functools.partial(
            stored_response,
            storage,
            archive.key,
            filename=archive.filename,
            media_type="application/x-tar",
            presigned=settings.storage_presigned_downloads,
            local=archive.local,
        )
    )
