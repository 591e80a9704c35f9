"""A dataset split pulled from the Hub (the worker's side of a ``dataset_pull`` transfer).

Its files are downloaded into ``<cache>/dataset-pulls/<org>--<name>@<commit>/<config>--<split>/``,
each resumed from its ``.part`` file like a model pull's (a worker killed mid-download leaves
them, and the next run of that transfer, or a new pull of that split at that commit, goes on from
there); then they are joined into one file and stored exactly like an upload (``uploads.upload``:
every row validated, the dataset's ``source`` saying where it came from). The staging folder goes
once the split is stored, or when it is refused, its disk is full or it is cancelled.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from engine import DiskFull
from server.hf_hub.download import DISK_FULL, Progress, download
from server.services import transfers, uploads
from server.services.failures import Refusal
from server.settings import Settings
from server.storage import open_storage
from server.tables import HubTransfer

FOLDER = "dataset-pulls"  # in the cache folder
JOINED = ".joined"  # in the staging folder: a split's files joined into one
FULL = (errno.ENOSPC, errno.EDQUOT)


def staging_folder(settings: Settings, *, repo_id: str, sha: str, config: str | None, split: str) -> Path:
    return (
        settings.cache_dir
        / FOLDER
        / f"{repo_id.replace('/', '--')}@{sha}"
        / f"{config or 'default'}--{split}"
    )


def staging_of(settings: Settings, row: HubTransfer) -> Path | None:
    """The staging folder of a dataset pull (None: its plan has no commit)."""
    plan = row.plan
    if not plan.get("sha") or not plan.get("split"):
        return None
    return staging_folder(
        settings, repo_id=row.repo_id, sha=plan["sha"], config=plan.get("config"), split=plan["split"]
    )


def remove_staging(settings: Settings, row: HubTransfer) -> None:
    """The staging folder gone, and its commit's folder too once it holds no other split."""
    staging = staging_of(settings, row)
    if staging is None:
        return
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):  # another split of that commit is there, or it never was
        staging.parent.rmdir()


def join(files: list[Path], out: Path) -> Path:
    """A split's files as one file of their kind (the validator then numbers its rows); one file
    is itself."""
    if len(files) == 1:
        return files[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.concat_tables([pq.read_table(f) for f in files], promote_options="default"), out)
        return out
    with out.open("wb") as sink:
        for i, f in enumerate(files):
            with f.open("rb") as fh:
                if out.suffix == ".csv" and i > 0:
                    fh.readline()  # one header only
                data = fh.read()
            sink.write(data)
            if data and not data.endswith(b"\n"):
                sink.write(b"\n")
    return out


def file_name(row: HubTransfer) -> str:
    """The stored file's name: ``<name>-[<config>-]<split><suffix>``."""
    plan = row.plan
    config = plan.get("config")
    stem = f"{row.repo_id.split('/')[-1]}-{config + '-' if config else ''}{plan['split']}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem) + Path(plan["files"][0]["path"]).suffix.lower()


def origin(row: HubTransfer) -> dict[str, Any]:
    """The dataset's ``source``: the repo, config, split, revision asked for, commit and files."""
    plan = row.plan
    return {
        "hub": row.repo_id,
        "config": plan.get("config"),
        "split": plan["split"],
        "revision": row.revision,
        "sha": plan["sha"],
        "from": plan.get("origin"),
        "files": [f["path"] for f in plan["files"]],
    }


def run(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, reporter: Progress) -> str:
    """Download, join, validate and store the split; the transfer's final status."""
    plan = row.plan
    staging = staging_of(settings, row)
    if staging is None:
        raise ValueError(f"dataset pull {row.id}: its plan has no commit or split")
    ended = download(
        settings,
        sessions,
        row,
        reporter,
        staging,
        repo_type="dataset",
        on_cancel=lambda: _end(settings, sessions, row, transfers.CANCELLED, error="cancelled", bytes_done=0),
        on_disk_full=lambda: _disk_full(settings, sessions, row, staging),
    )
    if ended is not None:
        return ended
    paths = [staging / f["path"] for f in plan["files"]]
    name = file_name(row)
    try:
        joined = join(paths, staging / JOINED / name)
        if joined not in paths:  # the download, once joined, makes room for the upload's copy
            for path in paths:
                path.unlink()
        with sessions() as session, joined.open("rb") as source:
            stored = uploads.upload(
                session,
                source=source,
                filename=name,
                name=row.target,
                storage=open_storage(settings),
                scratch=settings.cache_dir / "incoming",
                max_bytes=settings.max_upload_bytes,
                origin=origin(row),
            )
            dataset_id = stored.id
    except Refusal as exc:  # invalid rows (by line, as for an upload), too large, a bad file type
        failed = {**plan, "errors": exc.details or [], **(exc.extra or {})}
        return _end(
            settings, sessions, row, transfers.FAILED, error=exc.message, error_code=exc.code, plan=failed
        )
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        return _disk_full(settings, sessions, row, Path(exc.filename or staging))
    return _end(
        settings,
        sessions,
        row,
        transfers.SUCCEEDED,
        bytes_done=row.bytes_total,
        plan={**plan, "dataset_id": dataset_id},
    )


def _end(
    settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, status: str, **fields: Any
) -> str:
    """The staging folder removed and the transfer finished with ``status``."""
    remove_staging(settings, row)
    with sessions() as session:
        transfers.finish(session, transfer_id=row.id, status=status, **fields)
    return status


def _disk_full(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, path: Path) -> str:
    """A disk filled up while the split was downloaded or stored: its files go, and the transfer
    fails naming what was written, the bytes a pull needs in the cache folder (the download and its
    copy as an upload, with ``hub_keep_free_bytes``) and the bytes free once they are gone."""
    remove_staging(settings, row)
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    needed = 2 * row.bytes_total + settings.hub_keep_free_bytes
    full = DiskFull(str(path), needed_bytes=needed, free_bytes=shutil.disk_usage(where).free)
    message = f"{full}; the pull's files were removed: free some space (GET /api/disk) and pull again"
    with sessions() as session:
        transfers.finish(
            session,
            transfer_id=row.id,
            status=transfers.FAILED,
            error=message,
            error_code=DISK_FULL,
            bytes_done=0,
        )
    return transfers.FAILED
