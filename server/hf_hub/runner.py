"""The worker's side of Hub transfers: a thread that claims queued transfers (and those whose
worker vanished: their lease expired) and runs them one at a time: model pulls here, dataset pulls
(``dataset_pull``) and pushes (``push``), each reporting to a ``progress.Reporter``.

A model pull downloads into ``models/.pulls/<org>--<name>@<commit>/`` (the models folder's own disk,
so the last step is a rename), then renames that to ``models/<org>/<name>/``; with an S3 store the
folder is also put in the shared models store (``models/<org>/<name>/``), where workers on other
hosts find it. An interrupted pull (a killed worker, a failure) leaves its staging folder, and the
next run of a pull of that commit resumes from it; a cancelled pull removes it.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from engine import DiskFull
from server.hf_hub import dataset_pull
from server.hf_hub.download import DISK_FULL, download
from server.hf_hub.progress import Reporter
from server.hf_hub.push import run_push
from server.services import transfers
from server.settings import Settings
from server.storage import Storage, open_storage
from server.tables import HubTransfer, now

log = logging.getLogger("roundhouse.hub")
POLL_S = 1.0
STAGING = ".pulls"
SOURCE_FILE = ".hub-source.json"  # in a pulled model's folder: where it came from
FULL = (errno.ENOSPC, errno.EDQUOT)
# what a transfer was asked to do besides its repo and revision: a push's, a dataset pull's
# (``merged``: a push queued before pushes had formats)
OPTIONS = ("job_id", "step", "private", "format", "variant", "merged", "split", "config", "name")


def staging_folder(settings: Settings, *, repo_id: str, sha: str) -> Path:
    return settings.models_dir / STAGING / f"{repo_id.replace('/', '--')}@{sha}"


def staging_of(settings: Settings, row: HubTransfer) -> Path | None:
    """Where a pull's files arrive (None: a push, or a pull with no commit in its plan)."""
    if row.kind == transfers.DATASET_PULL:
        return dataset_pull.staging_of(settings, row)
    if row.kind == transfers.PULL and row.plan.get("sha"):
        return staging_folder(settings, repo_id=row.repo_id, sha=row.plan["sha"])
    return None


def remove_staging(settings: Settings, row: HubTransfer) -> None:
    """A cancelled pull's files gone."""
    if row.kind == transfers.DATASET_PULL:
        dataset_pull.remove_staging(settings, row)
        return
    staging = staging_of(settings, row)
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def model_folder(settings: Settings, name: str) -> Path:
    return settings.models_dir.joinpath(*name.split("/"))


def _publish(settings: Settings, store: Storage, *, name: str, staging: Path, row: HubTransfer) -> Path:
    """The finished staging folder as the model ``name`` (and in the shared store with S3)."""
    shutil.rmtree(staging / child_parts(), ignore_errors=True)
    (staging / SOURCE_FILE).write_text(
        json.dumps(
            {
                "repo_id": row.repo_id,
                "revision": row.revision,
                "sha": row.plan.get("sha"),
                "pulled_at": now().isoformat(),
            }
        )
    )
    folder = model_folder(settings, name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # a pull of a newer commit replaces the old folder
        old = folder.with_name(f".{folder.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    staging.rename(folder)
    if store.local_path(f"models/{name}") is None:  # a remote store: every host pulls it from there
        store.put_tree(f"models/{name}", folder)
    return folder


def child_parts() -> str:
    from server.hf_hub.client import PARTS

    return PARTS


def run_pull(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, worker_id: str) -> str:
    plan = row.plan
    staging = staging_folder(settings, repo_id=row.repo_id, sha=plan["sha"])
    reporter = Reporter(settings, sessions, row, worker_id)
    ended = download(
        settings,
        sessions,
        row,
        reporter,
        staging,
        repo_type="model",
        on_cancel=lambda: _cancelled(sessions, row, staging),
        on_disk_full=lambda: _disk_full(settings, sessions, row, staging),
    )
    if ended is not None:
        return ended
    try:
        folder = _publish(settings, open_storage(settings), name=row.target, staging=staging, row=row)
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        return _disk_full(settings, sessions, row, staging)
    from server.services import models

    models.forget()
    with sessions() as session:
        transfers.finish(session, transfer_id=row.id, status=transfers.SUCCEEDED, bytes_done=row.bytes_total)
    log.info("pulled %s into %s", row.repo_id, folder)
    return transfers.SUCCEEDED


def _disk_full(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, staging: Path) -> str:
    """The models folder's disk filled up: the partial download goes (a pull that resumed it
    would find the disk as full), and the transfer fails saying where, the bytes a pull needs
    there (with ``hub_keep_free_bytes``) and the bytes free once it is gone. Nothing is
    registered: the model folder appears only when a pull is whole."""
    shutil.rmtree(staging, ignore_errors=True)
    needed = (row.bytes_total or 0) + settings.hub_keep_free_bytes
    full = DiskFull(str(staging), needed_bytes=needed, free_bytes=shutil.disk_usage(settings.models_dir).free)
    message = f"{full}; the partial download was removed: free some space (GET /api/disk) and pull again"
    with sessions() as session:
        transfers.finish(
            session,
            transfer_id=row.id,
            status=transfers.FAILED,
            error=message,
            error_code=DISK_FULL,
            bytes_done=0,
        )
    log.warning("pull %s of %s: %s", row.id, row.repo_id, message)
    return transfers.FAILED


def _cancelled(sessions: sessionmaker[Session], row: HubTransfer, staging: Path) -> str:
    shutil.rmtree(staging, ignore_errors=True)
    with sessions() as session:
        transfers.finish(
            session, transfer_id=row.id, status=transfers.CANCELLED, error="cancelled", bytes_done=0
        )
    return transfers.CANCELLED


def run_one(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, worker_id: str) -> str:
    try:
        if row.kind == transfers.PULL:
            return run_pull(settings, sessions, row, worker_id)
        if row.kind == transfers.DATASET_PULL:
            return dataset_pull.run(settings, sessions, row, Reporter(settings, sessions, row, worker_id))
        return run_push(settings, sessions, row, worker_id)
    except Exception as exc:  # a bug or a full disk: the transfer fails with the reason, the loop goes on
        log.exception("transfer %s failed", row.id)
        with sessions() as session:
            transfers.finish(
                session,
                transfer_id=row.id,
                status=transfers.FAILED,
                error=f"{type(exc).__name__}: {exc}"[:2000],
                error_code="failed",
            )
        return transfers.FAILED


def loop(
    settings: Settings, sessions: sessionmaker[Session], *, worker_id: str, stop: threading.Event
) -> None:
    """Claim and run transfers until ``stop`` is set (the worker's housekeeping starts it)."""
    while not stop.wait(POLL_S):
        try:
            with sessions() as session:
                due = transfers.claimable(session)
                row = None
                for transfer_id in due:
                    row = transfers.claim(
                        session,
                        transfer_id=transfer_id,
                        worker_id=worker_id,
                        lease_seconds=settings.lease_seconds,
                    )
                    if row is not None:
                        session.expunge(row)
                        break
            if row is None:
                continue
            if row.status == transfers.CANCELLING:  # asked to stop while its worker was gone
                remove_staging(settings, row)
                with sessions() as session:
                    transfers.finish(
                        session,
                        transfer_id=row.id,
                        status=transfers.CANCELLED,
                        error="cancelled",
                        bytes_done=0,
                    )
                continue
            log.info(
                "transfer %s (%s %s): %s",
                row.id,
                row.kind,
                row.repo_id,
                run_one(settings, sessions, row, worker_id),
            )
        except Exception:  # the database is away: try again at the next tick
            log.exception("hub transfers: a poll failed")


def start(
    settings: Settings, sessions: sessionmaker[Session], *, worker_id: str, stop: threading.Event
) -> threading.Thread:
    thread = threading.Thread(
        target=loop,
        args=(settings, sessions),
        kwargs={"worker_id": worker_id, "stop": stop},
        name="roundhouse-hub",
        daemon=True,
    )
    thread.start()
    return thread


def transfer_payload(row: HubTransfer) -> dict[str, Any]:
    """A transfer as the API shows it: with the ETA from the remaining bytes and the speed."""
    speed = row.bytes_per_s
    remaining = max(0, row.bytes_total - row.bytes_done)
    eta = remaining / speed if speed and row.status == transfers.RUNNING else None
    return {
        "id": row.id,
        "kind": row.kind,
        "repo_id": row.repo_id,
        "revision": row.revision,
        "status": row.status,
        "target": row.target,
        "bytes_total": row.bytes_total,
        "bytes_done": row.bytes_done,
        "bytes_per_s": speed,
        "eta_s": eta,
        "files": row.plan.get("files", []),
        "commit": row.plan.get("sha") or row.plan.get("commit"),
        "options": {k: row.plan[k] for k in OPTIONS if k in row.plan},
        "dataset_id": row.plan.get("dataset_id"),
        "details": row.plan.get("errors", []),
        "error": row.error,
        "error_code": row.error_code,
        "attempts": row.attempts,
        "created_at": row.created_at,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
    }
