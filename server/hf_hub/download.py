"""The download step a pull of a model (``runner``) and of a dataset split (``dataset_pull``)
share: the Hub child fetches the plan's files into the staging folder, reporting progress; a
cancel, a full disk and any other Hub failure end the transfer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from server.hf_hub import child
from server.services import transfers
from server.settings import Settings
from server.tables import HubTransfer

DISK_FULL = "disk_full"  # the error code of a pull the disk could not hold


class Progress(Protocol):
    """What a pull reports to (``progress.Reporter``)."""

    def progress(self, done: int) -> None: ...

    def cancelled(self) -> bool: ...

    def tick(self, *, force: bool = True) -> bool: ...


def download(
    settings: Settings,
    sessions: sessionmaker[Session],
    row: HubTransfer,
    reporter: Progress,
    staging: Path,
    *,
    repo_type: str,
    on_cancel: Callable[[], str],
    on_disk_full: Callable[[], str],
) -> str | None:
    """Fetch ``row``'s planned files into ``staging``: None when they all arrived, else the
    transfer's final status (``on_cancel``'s, ``on_disk_full``'s, or failed with the Hub's error;
    the files that arrived stay, so a pull of the same commit resumes from them)."""
    plan = row.plan
    try:
        child.run(
            settings,
            "download",
            on_progress=reporter.progress,
            cancelled=reporter.cancelled,
            repo_id=row.repo_id,
            repo_type=repo_type,
            revision=plan["sha"],
            files=plan["files"],
            dest=str(staging),
        )
    except child.Cancelled:
        return on_cancel()
    except child.HubError as exc:
        if exc.kind == DISK_FULL:
            return on_disk_full()
        with sessions() as session:
            transfers.finish(
                session, transfer_id=row.id, status=transfers.FAILED, error=exc.message, error_code=exc.kind
            )
        return transfers.FAILED
    if reporter.tick():  # cancelled as the last bytes arrived: still cancelled
        return on_cancel()
    return None
