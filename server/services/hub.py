"""Hub requests as the API takes them: a model pull checked and queued, a dataset split pulled and
stored like an upload, a checkpoint push queued. The Hub's refusals come back as
``child.HubError``; the router gives them their HTTP status."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.hf_hub import child
from server.hf_hub.files import RemoteFile, has_weights, total
from server.hf_hub.runner import staging_folder
from server.services import checkpoints, jobs, models, transfers, uploads
from server.services.failures import Conflict, Invalid, NotFound
from server.settings import Settings
from server.storage import Storage
from server.tables import Dataset, HubTransfer, Job

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
    """Check a model repo and queue its pull; a pull of the same repo under way is returned as is
    (False: not new).

    Its ``config.json`` (and the safetensors index) is all that is fetched here: an architecture
    the engine cannot train is refused before any weight moves, and so is a download the disk
    cannot hold (its size from the repo's file list).

    Raises:
        child.HubError: the Hub refused (gated, unknown repo or revision, offline, unreachable).
        Invalid: the model is not one the engine trains, or has no weights (``repo_id``).
        Conflict: the disk lacks the space (``repo_id``).
    """
    check_repo_id(repo_id)
    key = f"pull:{repo_id}"
    running = transfers.active(session, active_key=key)
    if running is not None:
        return running, False
    scratch = Path(tempfile.mkdtemp(prefix="inspect-", dir=_scratch(settings)))
    try:
        found = child.run(settings, "inspect", repo_id=repo_id, revision=revision, scratch=str(scratch))
        row = _accept(
            session, settings, repo_id=repo_id, revision=revision, found=found, key=key, scratch=scratch
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return row


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


def _combine(files: list[Path], out: Path) -> None:
    """A split's files as one file of their kind (the validator then numbers its rows)."""
    suffix = out.suffix
    if len(files) == 1:
        shutil.move(files[0], out)
        return
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.concat_tables([pq.read_table(f) for f in files], promote_options="default"), out)
        return
    with out.open("wb") as sink:
        for i, f in enumerate(files):
            with f.open("rb") as fh:
                if suffix == ".csv" and i > 0:
                    fh.readline()  # one header only
                data = fh.read()
            sink.write(data)
            if data and not data.endswith(b"\n"):
                sink.write(b"\n")


def pull_dataset(
    session: Session,
    settings: Settings,
    storage: Storage,
    *,
    repo_id: str,
    split: str,
    config: str | None,
    revision: str | None,
    name: str | None,
) -> Dataset:
    """Fetch a dataset split's files (the repo's own JSONL/Parquet/CSV, else the Hub's Parquet
    conversion) and store them exactly like an upload (``uploads.upload``: every row validated,
    the same errors by line or row), with the source recorded.

    Raises:
        child.HubError: the Hub refused, or the split is not there (``split_not_found``).
        Invalid, TooLarge: as for an upload.
    """
    check_repo_id(repo_id)
    scratch = Path(tempfile.mkdtemp(prefix="dataset-", dir=_scratch(settings)))
    try:
        found = child.run(
            settings,
            "dataset",
            repo_id=repo_id,
            split=split,
            config=config,
            revision=revision,
            dest=str(scratch / "files"),
        )
        paths = [scratch / "files" / f["path"] for f in found["files"]]
        suffix = Path(found["files"][0]["path"]).suffix.lower()
        stem = re.sub(
            r"[^A-Za-z0-9._-]", "_", f"{repo_id.split('/')[-1]}-{config + '-' if config else ''}{split}"
        )
        combined = scratch / f"{stem}{suffix}"
        _combine(paths, combined)
        origin = {
            "hub": repo_id,
            "config": config,
            "split": split,
            "revision": revision,
            "sha": found.get("sha"),
            "from": found.get("origin"),
            "files": [f["path"] for f in found["files"]],
        }
        with combined.open("rb") as fh:
            return uploads.upload(
                session,
                source=fh,
                filename=combined.name,
                name=name or f"{repo_id} ({split})",
                storage=storage,
                scratch=settings.cache_dir / "incoming",
                max_bytes=settings.max_upload_bytes,
                origin=json.loads(json.dumps(origin)),
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def request_push(
    session: Session,
    settings: Settings,
    storage: Storage,
    *,
    job: Job,
    step: int,
    repo_id: str,
    private: bool,
    merged: bool,
) -> tuple[HubTransfer, bool]:
    """Queue a checkpoint's push to ``repo_id``; a push to that repo under way is returned as is.

    Raises:
        NotFound: no checkpoint at ``step``. Invalid: ``merged`` for a checkpoint that is not a
        LoRA adapter. Conflict: no token is set (``hub_token_required``). child.HubError: the Hub
        is off here (``offline``).
    """
    check_repo_id(repo_id)
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
    if merged and checkpoint.kind != "adapter":
        raise Invalid("invalid_request", "merged: only a LoRA adapter can be merged", param="merged")
    plan: dict[str, Any] = {"job_id": job.id, "step": step, "private": private, "merged": merged}
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
    row = transfers.cancel(session, transfer_id=transfer.id) or transfer
    if row.kind == transfers.PULL and row.status == transfers.CANCELLED and row.plan.get("sha"):
        shutil.rmtree(staging_folder(settings, repo_id=row.repo_id, sha=row.plan["sha"]), ignore_errors=True)
    return row
