"""Hub requests as the API takes them: a model pull or a dataset pull checked against the Hub's file
list and queued (a worker downloads it), a checkpoint push queued. The Hub's refusals come back as
``child.HubError``; the router gives them their HTTP status."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.export import CHECKPOINT, format_named
from server.hf_hub import child, dataset_pull
from server.hf_hub.files import RemoteFile, has_weights, total
from server.hf_hub.runner import remove_staging, staging_folder
from server.services import archives, checkpoints, jobs, models, transfers
from server.services.failures import Conflict, Invalid, NotFound, TooLarge
from server.settings import Settings
from server.storage import Storage
from server.tables import HubTransfer, Job

REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def check_repo_id(repo_id: str, *, param: str = "repo_id") -> str:
    if not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith((".", "-")):
        raise Invalid(
            "invalid_request",
            f"{param}: {repo_id[:100]!r} is not a Hub repo id (ORG/NAME: letters, digits, '.', '_', '-')",
            param=param,
        )
    return repo_id


def _free_bytes(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(folder).free


def _on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def request_pull(
    session: Session, settings: Settings, *, repo_id: str, revision: str | None
) -> tuple[HubTransfer, bool]:
    """Check a model repo and queue its pull; a pull of the same repo at the same commit under way
    is returned as is (False: not new).

    Its ``config.json`` (and the safetensors index) is all that is fetched here: an architecture
    the engine cannot train is refused before any weight moves, and so is a download the disk
    cannot hold (its size from the repo's file list).

    Raises:
        child.HubError: the Hub refused (gated, unknown repo or revision, offline, unreachable).
        Invalid: the model is not one the engine trains, or has no weights (``repo_id``).
        Conflict: the disk lacks the space (``repo_id``); the repo is being pulled at another
            commit (``revision``): both would become the same model folder.
    """
    check_repo_id(repo_id)
    key = f"pull:{repo_id}"  # one active pull per model folder
    scratch = Path(tempfile.mkdtemp(prefix="inspect-", dir=_scratch(settings)))
    try:
        found = child.run(settings, "inspect", repo_id=repo_id, revision=revision, scratch=str(scratch))
        running = transfers.active(session, active_key=key)
        if running is not None:
            return _same_commit(running, revision=revision, sha=found["sha"]), False
        row, created = _accept(
            session, settings, repo_id=repo_id, revision=revision, found=found, key=key, scratch=scratch
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return (row, True) if created else (_same_commit(row, revision=revision, sha=found["sha"]), False)


def _same_commit(running: HubTransfer, *, revision: str | None, sha: str) -> HubTransfer:
    """The pull under way when it fetches commit ``sha``; else why a second one cannot start."""
    if running.plan.get("sha") == sha:
        return running
    theirs = running.plan.get("sha") or "?"
    raise Conflict(
        "pull_in_progress",
        f"{running.repo_id} at revision {revision or 'main'!r} is commit {sha[:12]}, but the pull"
        f" {running.id} of the same repo is fetching commit {theirs[:12]} (revision"
        f" {running.revision or 'main'!r}) into the same model folder {running.target!r}: wait for it"
        f" or cancel it (POST /api/transfers/{running.id}/cancel), then pull again",
        param="revision",
    )


def _accept(
    session: Session,
    settings: Settings,
    *,
    repo_id: str,
    revision: str | None,
    found: dict[str, Any],
    key: str,
    scratch: Path,
) -> tuple[HubTransfer, bool]:
    config = found.get("config")
    kind = (
        models._kind(config)
        if isinstance(config, dict)
        else models.ModelKind(None, False, "config.json is not a JSON object")
    )
    if not kind.supported:
        raise Invalid("unsupported_model", f"{repo_id}: {kind.reason}", param="repo_id")
    files = [RemoteFile(str(f["path"]), int(f["size"])) for f in found["files"]]
    if not has_weights(files):
        raise Invalid(
            "no_weights", f"{repo_id} has no .safetensors or .bin weights at its top level", param="repo_id"
        )
    need = total(files)
    staged = _on_disk(staging_folder(settings, repo_id=repo_id, sha=found["sha"]))
    free = _free_bytes(settings.models_dir)
    if free - settings.hub_keep_free_bytes < need - staged:
        raise Conflict(
            "insufficient_disk",
            f"{repo_id} needs {need - staged:,} bytes more ({len(files)} files, {need:,} bytes in all) but"
            f" the models folder has {free:,} bytes free, {settings.hub_keep_free_bytes:,} of which must stay"
            " free (ROUNDHOUSE_HUB_KEEP_FREE_BYTES): nothing was downloaded",
            param="repo_id",
        )
    plan = {"sha": found["sha"], "files": [f.as_dict() for f in files], "architecture": kind.architecture}
    staging = staging_folder(settings, repo_id=repo_id, sha=found["sha"])
    staging.mkdir(parents=True, exist_ok=True)
    for fetched in scratch.iterdir():  # config.json and the index: the download does not fetch them again
        if fetched.is_file() and not (staging / fetched.name).exists():
            shutil.move(fetched, staging / fetched.name)
    return transfers.create(
        session,
        kind=transfers.PULL,
        repo_id=repo_id,
        revision=revision,
        active_key=key,
        target=repo_id,
        plan=plan,
        bytes_total=need,
    )


def _scratch(settings: Settings) -> Path:
    folder = settings.cache_dir / "hub-scratch"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def request_dataset_pull(
    session: Session,
    settings: Settings,
    *,
    repo_id: str,
    split: str,
    config: str | None,
    revision: str | None,
    name: str | None,
) -> tuple[HubTransfer, bool]:
    """Find a dataset split's files (the repo's own JSONL/Parquet/CSV, else the Hub's Parquet
    conversion) and queue their pull: a worker downloads them and stores them like an upload
    (``hf_hub.dataset_pull``). A pull of the same split at the same commit under way is returned as
    is (False: not new); the same split at another commit is a pull of its own.

    Only the file list is read here: a split over ``max_upload_bytes``, or one the cache folder's
    disk cannot hold twice (the download, then its copy as an upload), is refused before a byte of
    it moves.

    Raises:
        child.HubError: the Hub refused, or the split is not there (``split_not_found``).
        TooLarge: the split's files are over ``max_upload_bytes`` (``split``).
        Conflict: the disk lacks the space (``split``).
    """
    check_repo_id(repo_id)
    found = child.run(
        settings, "inspect_dataset", repo_id=repo_id, split=split, config=config, revision=revision
    )
    files = [RemoteFile(str(f["path"]), int(f["size"])) for f in found["files"]]
    sha, need = str(found["sha"]), total(files)
    shown = f"{repo_id} split {f'{config}/{split}' if config else split!r}"
    if need > settings.max_upload_bytes:
        raise TooLarge(
            "too_large",
            f"{shown} is {need:,} bytes ({len(files)} files), over the upload limit of"
            f" {settings.max_upload_bytes:,} bytes (ROUNDHOUSE_MAX_UPLOAD_BYTES): nothing was downloaded",
            param="split",
        )
    staging = dataset_pull.staging_folder(settings, repo_id=repo_id, sha=sha, config=config, split=split)
    more = 2 * need - _on_disk(staging)
    free = _free_bytes(settings.cache_dir)
    if free - settings.hub_keep_free_bytes < more:
        raise Conflict(
            "insufficient_disk",
            f"{shown} needs {more:,} bytes more in the cache folder {settings.cache_dir} (its"
            f" {need:,} bytes downloaded, then copied as an upload) but its disk has {free:,} bytes free,"
            f" {settings.hub_keep_free_bytes:,} of which must stay free (ROUNDHOUSE_HUB_KEEP_FREE_BYTES):"
            " nothing was downloaded",
            param="split",
        )
    plan: dict[str, Any] = {
        "sha": sha,
        "files": [f.as_dict() for f in files],
        "origin": found.get("origin"),
        "split": split,
        "config": config,
        "name": name,
    }
    return transfers.create(
        session,
        kind=transfers.DATASET_PULL,
        repo_id=repo_id,
        revision=revision,
        active_key=f"dataset:{repo_id}@{sha}:{config or 'default'}/{split}",
        target=name or f"{repo_id} ({split})",
        plan=plan,
        bytes_total=need,
    )


def request_push(
    session: Session,
    settings: Settings,
    storage: Storage,
    *,
    job: Job,
    step: int,
    repo_id: str,
    private: bool,
    format: str = CHECKPOINT.name,
    variant: str | None = None,
) -> tuple[HubTransfer, bool]:
    """Queue a checkpoint's push to ``repo_id`` in an export format of the registry
    (``engine.export.formats``: the checkpoint's own files, merged, a GGUF in one of its variants);
    a push to that repo under way is returned as is.

    The format is checked here as a download checks it (``archives.checked_variant``), so a format
    the checkpoint cannot take is refused before anything is built or sent.

    Raises:
        NotFound: no checkpoint at ``step``. Invalid: no such format, a format the checkpoint
        cannot take (``merged`` of a full checkpoint, a GGUF of a family it cannot write), both
        naming ``format``; a variant the format lacks (``variant``). Conflict: no token is set
        (``hub_token_required``). child.HubError: the Hub is off here (``offline``).
    """
    check_repo_id(repo_id)
    try:
        export = format_named(format)
    except ValueError as exc:
        raise Invalid("invalid_request", str(exc), param="format") from exc
    if settings.hub_offline:
        raise child.HubError("offline", "the Hub is off here (ROUNDHOUSE_HUB_OFFLINE=1): nothing was sent")
    if settings.hub_token is None:
        raise Conflict(
            "hub_token_required",
            "a push needs ROUNDHOUSE_HUB_TOKEN, a Hub token with write access to the repo's namespace:"
            " nothing was sent",
        )
    checkpoint = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if checkpoint is None:
        raise NotFound(f"job {job.id!r} has no checkpoint at step {step}", param="step")
    choice = archives.ExportChoice(export, variant)
    chosen = archives.checked_variant(choice, kind=checkpoint.kind, architecture=archives.architecture(job))
    plan: dict[str, Any] = {
        "job_id": job.id,
        "step": step,
        "private": private,
        "format": export.name,
        "variant": chosen,
    }
    url = f"{settings.hub_endpoint.rstrip('/')}/{repo_id}"
    return transfers.create(
        session,
        kind=transfers.PUSH,
        repo_id=repo_id,
        revision=None,
        active_key=f"push:{repo_id}",
        target=url,
        plan=plan,
        bytes_total=0,
    )


def delete_model(session: Session, settings: Settings, storage: Storage, *, name: str) -> int:
    """Delete a model of the models folder (and the shared store's copy); the bytes freed.

    Raises:
        NotFound: no such model. Invalid: the demo or a Hugging Face cache entry (not ours to
        delete). Conflict: a job that is not finished uses it.
    """
    found = next(
        (m for m in models.discover(settings.models_dir, settings.hf_cache_dir) if m.name == name), None
    )
    if found is None or found.path is None:
        raise NotFound(f"no base model {name!r}", param="name")
    if found.source not in ("models", "hub"):
        raise Invalid(
            "invalid_request",
            f"name: {name!r} is the {found.source} model: it cannot be deleted here",
            param="name",
        )
    users = list(
        session.scalars(select(Job.id).where(Job.base_model == name, Job.status.not_in(list(jobs.TERMINAL))))
    )
    if users:
        raise Conflict(
            "model_in_use",
            f"{name!r} is the base model of unfinished job(s) {', '.join(users[:5])}",
            param="name",
        )
    freed = _on_disk(found.path)
    shutil.rmtree(found.path)
    parent = found.path.parent
    if parent != settings.models_dir and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()  # an organisation's folder left empty
    if storage.local_path(f"models/{name}") is None:
        storage.delete_prefix(f"models/{name}")
    models.forget()
    return freed


def cancel(session: Session, settings: Settings, *, transfer: HubTransfer) -> HubTransfer:
    """Cancel a transfer (``transfers.cancel``); a pull cancelled before a worker took it leaves no
    staging folder behind (a running one's worker removes its own)."""
    was = transfer.status
    row = transfers.cancel(session, transfer_id=transfer.id) or transfer
    if was == transfers.QUEUED and row.status == transfers.CANCELLED:
        remove_staging(settings, row)
    return row
