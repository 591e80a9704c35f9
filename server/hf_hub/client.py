"""The Hub client, run as a child process (``python -m server.hf_hub.client``) by ``child``.

It reads one JSON request on stdin (the token travels there, never on a command line) and writes
JSON lines on stdout: ``{"event": "progress", "done": bytes}`` while it moves files, then
``{"event": "result", ...}`` or ``{"event": "error", "kind", "status", "message"}``. Its
environment (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``) is set by the parent from the service's settings.

Downloads resume: a file is fetched into ``.parts/<path>.<etag>.part`` with HTTP ranges from where
an interrupted run stopped (``huggingface_hub``'s ``http_get``), checked against its size and, for
large files, its SHA-256, then renamed into place; finished files are never fetched again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from server.hf_hub.files import (
    PARQUET_REVISION,
    SAFETENSORS_INDEX,
    RemoteFile,
    model_files,
    parquet_files,
    split_files,
)

PARTS = ".parts"
FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that found no space
PROGRESS_S = 0.25
CHUNK_BYTES = 1 << 16  # progress and a kill's loss are per chunk: the library's default is 10 MiB
_out = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    with _out:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


class Failure(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


def _api(request: dict[str, Any]) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=request["endpoint"], token=request.get("token") or False)


def _listing(info: Any) -> list[RemoteFile]:
    return [RemoteFile(s.rfilename, int(s.size or 0)) for s in info.siblings or ()]


def _fetch(request: dict[str, Any], *, repo_type: str, revision: str, path: str, dest: Path) -> Path:
    """One file of a repo at ``revision`` into ``dest/path``, resumed from its ``.part`` file."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers
    from huggingface_hub.utils._runtime import is_xet_available

    final = dest / path
    if final.is_file():
        return final
    token = request.get("token") or False
    url = hf_hub_url(
        request["repo_id"], path, repo_type=repo_type, revision=revision, endpoint=request["endpoint"]
    )
    meta = get_hf_file_metadata(url, token=token, endpoint=request["endpoint"])
    if meta.xet_file_data is not None and is_xet_available():
        # a Xet-backed file: hf-xet fetches and de-duplicates its chunks (its own cache resumes)
        hf_hub_download(
            request["repo_id"],
            path,
            repo_type=repo_type,
            revision=revision,
            local_dir=dest / PARTS / "xet",
            token=token,
            endpoint=request["endpoint"],
        )
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(dest / PARTS / "xet" / path, final)
        return final
    etag = (meta.etag or "noetag").replace("/", "_")
    part = dest / PARTS / f"{path}.{etag}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES
    with part.open("ab") as fh:
        have = fh.tell()
        if meta.size is None or have < meta.size:
            http_get(
                meta.location,
                fh,
                resume_size=have,
                headers=build_hf_headers(token=token),
                expected_size=meta.size,
            )
    size = part.stat().st_size
    if meta.size is not None and size != meta.size:
        part.unlink()
        raise Failure("corrupt", f"{path}: {size} bytes arrived, the Hub said {meta.size}")
    if meta.etag and len(meta.etag) == 64 and all(c in "0123456789abcdef" for c in meta.etag):
        digest = hashlib.sha256()
        with part.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != meta.etag:
            part.unlink()
            raise Failure("corrupt", f"{path}: its SHA-256 does not match the Hub's ({meta.etag[:12]}…)")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)
    return final


def _on_disk(dest: Path, files: list[dict[str, Any]]) -> int:
    """Bytes of ``files`` in ``dest``: finished files whole, interrupted ones as far as they got."""
    done = 0
    for f in files:
        final = dest / f["path"]
        if final.is_file():
            done += final.stat().st_size
            continue
        parts = dest / PARTS / f["path"]
        for part in parts.parent.glob(parts.name + ".*.part") if parts.parent.is_dir() else ():
            done += part.stat().st_size
    return done


def _watch(dest: Path, files: list[dict[str, Any]], stop: threading.Event) -> None:
    """Report the bytes on disk while they grow; end this process when its parent is gone."""
    parent, last = os.getppid(), -1
    while not stop.wait(PROGRESS_S):
        if os.getppid() != parent:  # the worker was killed: stop too (the next run resumes)
            os._exit(3)
        done = _on_disk(dest, files)
        if done != last:
            emit("progress", done=done)
            last = done


def _download_all(
    request: dict[str, Any], *, repo_type: str, revision: str, files: list[dict[str, Any]], dest: Path
) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    emit("progress", done=_on_disk(dest, files))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(dest, files, stop), daemon=True)
    watcher.start()
    try:
        for f in files:
            _fetch(request, repo_type=repo_type, revision=revision, path=f["path"], dest=dest)
    except Exception as exc:
        if not no_space(exc):
            raise
        needed, free = sum(int(f["size"]) for f in files), shutil.disk_usage(dest).free
        raise Failure(
            "disk_full",
            f"disk full: writing {dest}: the download needs {needed} bytes, {free} bytes are free",
        ) from exc
    finally:
        stop.set()
        watcher.join()
    emit("progress", done=_on_disk(dest, files))


def inspect_model(request: dict[str, Any]) -> dict[str, Any]:
    """The repo's commit, the files a pull takes with their sizes, and its ``config.json``: only
    that file (and the safetensors index) is fetched."""
    api = _api(request)
    info = api.model_info(request["repo_id"], revision=request.get("revision"), files_metadata=True)
    listing = _listing(info)
    names = {f.path for f in listing}
    scratch = Path(request["scratch"])
    if "config.json" not in names:
        raise Failure("no_config", f"{request['repo_id']} has no config.json: it is not a transformers model")
    config_path = _fetch(request, repo_type="model", revision=info.sha, path="config.json", dest=scratch)
    config = json.loads(config_path.read_text(encoding="utf-8", errors="replace") or "null")
    index = None
    if SAFETENSORS_INDEX in names:
        index_path = _fetch(
            request, repo_type="model", revision=info.sha, path=SAFETENSORS_INDEX, dest=scratch
        )
        index = json.loads(index_path.read_text())
    files = model_files(listing, index=index)
    return {
        "sha": info.sha,
        "files": [f.as_dict() for f in files],
        "config": config,
        "gated": bool(info.gated),
        "private": bool(info.private),
    }


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a write that found no space."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def download(request: dict[str, Any]) -> dict[str, Any]:
    dest = Path(request["dest"])
    _download_all(
        request,
        repo_type=request.get("repo_type", "model"),
        revision=request["revision"],
        files=request["files"],
        dest=dest,
    )
    return {"done": _on_disk(dest, request["files"])}


def inspect_dataset(request: dict[str, Any]) -> dict[str, Any]:
    """A split's files with their sizes and the commit that holds them: the repo's own, else the
    Hub's Parquet conversion of it. Nothing is downloaded."""
    api = _api(request)
    repo, split, config = request["repo_id"], request["split"], request.get("config")
    info = api.dataset_info(repo, revision=request.get("revision"), files_metadata=True)
    files, problem = split_files(_listing(info), split=split, config=config)
    revision, origin = info.sha, "repo"
    if problem:
        raise Failure("bad_split", f"{repo}: {problem}")
    if not files:
        try:
            converted = api.dataset_info(repo, revision=PARQUET_REVISION, files_metadata=True)
            files = parquet_files(_listing(converted), split=split, config=config)
            revision, origin = converted.sha, "parquet-conversion"
        except Exception as exc:  # no conversion: the split is simply not there
            if _kind(exc)[0] not in ("revision_not_found", "repo_not_found"):
                raise
            files = []
    if not files:
        shown = f"{config}/{split}" if config else split
        raise Failure(
            "split_not_found",
            f"{repo} has no split {shown!r} (no data file names it, and no Parquet conversion has it)",
            404,
        )
    return {"sha": revision, "files": [f.as_dict() for f in files], "origin": origin}


def _built(build: dict[str, Any]) -> Path:
    """The folder a push uploads: the checkpoint's export built in its format by the registry's
    builder (``engine.export.formats``, as a download builds it), here in this child: the worker
    never runs torch. The checkpoint's own files are their folder itself, nothing built.

    Raises:
        Failure: ``disk_full`` (the build's model copies would not fit), ``export_failed`` (the
            format's exporter refused the model).
    """
    from engine.export import BuildOptions, format_named
    from engine.model import model_bytes, resolve_model_path

    export = format_named(build["format"])
    source, out = Path(build["source"]), Path(build["out"])
    base = resolve_model_path(build["base"], build["models_dir"]) if build.get("base") else None
    if export.model_copies:
        needed = model_bytes(base or source) * export.model_copies
        free = shutil.disk_usage(out.parent).free
        if free < needed:
            raise Failure(
                "disk_full",
                f"the {export.name} build needs about {needed:,} bytes in {out.parent} but its disk has"
                f" {free:,} bytes free: nothing was sent",
            )
    options = BuildOptions(
        variant=build.get("variant"), base=base, system=build.get("system"), comment=build.get("comment")
    )
    try:
        return export.build(source, out, options).folder
    except ValueError as exc:
        raise Failure("export_failed", f"format: {export.name}: {exc}: nothing was sent") from exc


def push(request: dict[str, Any]) -> dict[str, Any]:
    """Build the export (:func:`_built`), create the repo if needed and commit the export's files
    and the model card (``README.md``, written for the files built) in one commit. The weights go
    first, one file at a time (by Xet or LFS, as the Hub says), each reported as it lands; the
    small text files then travel in the commit itself.

    ``leave_out``: top-level names of the folder not sent (the resume state); ``replace``: new
    text for some of its files (by relative path)."""
    from huggingface_hub import CommitOperationAdd

    from server.hf_hub.card import model_card

    api = _api(request)
    repo_id = request["repo_id"]
    folder = _built(request["build"])
    leave_out = set(request.get("leave_out") or ())
    contents: dict[str, Path | bytes] = {
        rel: p
        for p in sorted(folder.rglob("*"))
        for rel in [p.relative_to(folder).as_posix()]
        if p.is_file() and rel.split("/")[0] not in leave_out
    }
    contents |= {rel: text.encode() for rel, text in (request.get("replace") or {}).items()}
    card = model_card(**request["card"], files=sorted(contents))
    contents["README.md"] = card.encode()
    sizes = {rel: len(c) if isinstance(c, bytes) else c.stat().st_size for rel, c in contents.items()}
    total_bytes = sum(sizes.values())
    emit("total", total=total_bytes)
    url = api.create_repo(repo_id, private=bool(request.get("private")), exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=rel, path_or_fileobj=c if isinstance(c, bytes) else str(c))
        for rel, c in sorted(contents.items())
    ]
    done = 0
    emit("progress", done=done)
    for operation in sorted(operations, key=lambda o: -sizes[o.path_in_repo]):
        api.preupload_lfs_files(repo_id, additions=[operation], free_memory=False)
        if operation._upload_mode == "lfs":
            done += sizes[operation.path_in_repo]
            emit("progress", done=done)
    info = api.create_commit(repo_id, operations=operations, commit_message=request["message"])
    emit("progress", done=total_bytes)
    return {"url": str(url), "commit": info.oid, "files": sorted(contents), "bytes": total_bytes}


COMMANDS = {
    "inspect": inspect_model,
    "inspect_dataset": inspect_dataset,
    "download": download,
    "push": push,
}


def _kind(exc: BaseException) -> tuple[str, int | None]:
    """What went wrong, in the parent's terms, and the Hub's HTTP status."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(exc, GatedRepoError):
        return "gated", status
    if isinstance(exc, RepositoryNotFoundError):
        return "repo_not_found", status
    if isinstance(exc, RevisionNotFoundError):
        return "revision_not_found", status
    if isinstance(exc, RemoteEntryNotFoundError):
        return "entry_not_found", status
    if isinstance(exc, OfflineModeIsEnabled):
        return "offline", None
    if isinstance(exc, HfHubHTTPError):
        return ("forbidden" if status in (401, 403) else "http"), status
    if isinstance(exc, OSError | ConnectionError) or type(exc).__module__.startswith(("httpx", "httpcore")):
        return "unreachable", None
    return "failed", None


def main() -> int:
    request = json.loads(sys.stdin.readline())
    try:
        result = COMMANDS[request["command"]](request)
    except Failure as exc:
        emit("error", kind=exc.kind, status=exc.status, message=exc.message)
        return 1
    except Exception as exc:
        kind, status = _kind(exc)
        message = str(exc).split("\n")[0][:500] or type(exc).__name__
        emit("error", kind=kind, status=status, message=message)
        return 1
    emit("result", **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
