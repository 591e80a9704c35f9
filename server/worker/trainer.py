"""The training child process: ``python -m server.worker.trainer JOB_ID [--boxes K --rank R ...]``.

It loads the job's TrainConfig, runs ``engine.training.run.train`` with a sink that writes metrics,
events and checkpoints to the database, stops at a step boundary on SIGTERM, and exits with
``EXIT_OK``, ``EXIT_CANCELLED``, ``EXIT_FAILED`` or ``EXIT_DISK_FULL`` (a checkpoint did not fit:
the job pauses; the reason in ``ERROR_FILE`` of its folder, as for a failure). A box of a job on
several hosts (``--boxes``) trains its share of every batch with the others (``engine.distributed``);
the first writes the run's rows, the others' sinks keep their events only (``BoxSink``); one that
loses another box exits with ``EXIT_BOX_LOST``, the lost host in ``BOX_LOST_FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from engine import DiskFull, SavedCheckpoint, saved_message
from engine.training import CheckpointKind
from server.db import make_engine, session_factory
from server.kinds import EventKind
from server.services import checkpoints, jobs, progress
from server.settings import get_settings
from server.tables import JobEvent
from server.worker import files
from server.worker import tracking as job_tracking
from server.worker.writes import Write, Writes

if TYPE_CHECKING:
    from server.storage import Storage

EXIT_OK, EXIT_FAILED, EXIT_CANCELLED, EXIT_DISK_FULL, EXIT_BOX_LOST = 0, 1, 3, 4, 5
ERROR_FILE = "error.txt"
BOX_LOST_FILE = "box_lost.json"  # a box of several lost another: {"host", "rank", "message"}
DRAIN_S = 3600.0  # how long a run that ended waits for a database that is away to write what it logged
FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that found no space
# the latest values a checkpoint row records with it (DPO and GRPO runs: their reward figures too)
KEEP = (
    "loss/train",
    "loss/val",
    "optim/lr",
    "throughput/tokens_per_s",
    "dpo/reward_margin",
    "dpo/reward_accuracy",
    "reward/mean",
    "reward/val",
)


class DatabaseSink:
    """The engine's Sink, writing to the job's rows (thread-safe: the optimizer thread logs too).
    While the database is away the run trains on and its writes wait in memory, in order
    (``server.worker.writes``); ``close()`` waits for them."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        *,
        store: Storage | None = None,
        output_dir: str | None = None,
        keep_last: int = 1,
    ) -> None:
        """With ``store``, each checkpoint the run saves under ``output_dir`` (the job's key) is put
        there before its row names it, and the ones its ``keep_last`` drops are deleted."""
        self.sessions, self.job_id = sessions, job_id
        self.store, self.output_dir, self.keep_last = store, output_dir, keep_last
        self.lock = threading.Lock()
        self.latest: dict[str, float] = {}
        self.writes = Writes(sessions, job_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        metrics = dict(metrics)  # written now or later, as logged

        def apply(session: Session, at: datetime) -> JobEvent:
            event = jobs.add_event(
                session, job_id=self.job_id, kind=EventKind.METRICS, step=step, data=metrics, commit=False
            )
            event.created_at = at
            if "progress/step" in metrics:  # the step counter, trained tokens, estimated finish
                progress.record(session, job_id=self.job_id, metrics=metrics, commit=False)
            return event

        with self.lock:
            self.latest.update({k: v for k, v in metrics.items() if k in KEEP})
            self.writes.write(Write(apply, EventKind.METRICS))

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        step = data.get("step")

        def apply(session: Session, at: datetime) -> JobEvent:
            event = jobs.add_event(
                session, job_id=self.job_id, kind=kind, message=message, data=data, step=step, commit=False
            )
            event.created_at = at
            return event

        with self.lock:
            self.writes.write(Write(apply, kind))

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        """Store the checkpoint (before a row names it), then write its row and a ``checkpoint``
        event (data: step, the key, kind, bytes) with the latest metrics."""
        key = str(path)
        if self.output_dir is not None:
            key = files.push_checkpoint(
                self.store,
                output_dir=self.output_dir,
                path=Path(path),
                keep_last=self.keep_last,
                on_retry=self._store_retry,
            )
        message = saved_message(SavedCheckpoint(step, Path(path), kind, bytes))
        data = {"step": step, "path": key, "kind": str(kind), "bytes": bytes}

        def apply(session: Session, at: datetime) -> JobEvent:
            # the row first, then its event: a write made again (its outcome unknown when the
            # database went away) records the row again, which replaces itself; the row looks
            # at the store, so it waits for it as the push does

            def record() -> None:
                session.rollback()  # nothing read by a try that waited for the store is kept
                checkpoints.record(
                    session,
                    job_id=self.job_id,
                    step=step,
                    path=key,
                    kind=str(kind),
                    metrics=latest,
                    storage=self.store,
                )

            files.store_retrying(record, what=f"recording checkpoint {key}", on_retry=self._store_retry)
            event = jobs.add_event(
                session,
                job_id=self.job_id,
                kind=EventKind.CHECKPOINT,
                message=message,
                data=data,
                step=step,
                commit=False,
            )
            event.created_at = at
            return event

        with self.lock:
            latest = dict(self.latest)
            self.writes.write(Write(apply, EventKind.CHECKPOINT, alone=True))

    def _store_retry(self, message: str, wait_s: float) -> None:
        """A job event for each retry of a store that did not answer (its own session)."""
        with self.sessions() as session:
            data = {"storage_unavailable": True, "retry_in_s": round(wait_s, 1)}
            jobs.add_event(session, job_id=self.job_id, kind=EventKind.LOG, message=message, data=data)

    def close(self) -> None:
        """Wait for the writes kept while the database was away (up to ``DRAIN_S``).

        Raises:
            RuntimeError: the database did not come back in time: what the run logged since is lost.
        """
        left = self.writes.drain(DRAIN_S)
        if left:
            raise RuntimeError(f"the database was away for {DRAIN_S:g} s: {left} writes of the run lost")


def _watch_parent(parent: int) -> None:
    """The supervisor is gone (its worker died): stop now; the job is requeued elsewhere."""
    while True:
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)


class BoxSink:
    """The sink of a box other than the first of a job on several hosts: the first box writes the
    run's metrics, checkpoints and progress; this one's events are kept as log lines that name its
    host (kind, data and step in their data), so nothing is written twice."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, *, host: str, rank: int) -> None:
        self.host, self.rank = host, rank
        self.writes = Writes(sessions, job_id)
        self.job_id, self.lock = job_id, threading.Lock()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """The first box logs the run's metrics (the same: the weights are the same on every box)."""

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        tagged = {"event": kind, "host": self.host, "rank": self.rank, **dict(data or {})}
        line = f"{self.host} (box {self.rank}): {message}"

        def apply(session: Session, at: datetime) -> JobEvent:
            event = jobs.add_event(
                session, job_id=self.job_id, kind=EventKind.LOG, message=line, data=tagged, commit=False
            )
            event.created_at = at
            return event

        with self.lock:
            self.writes.write(Write(apply, EventKind.LOG))

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        raise RuntimeError(
            f"box {self.rank} on {self.host} saved a checkpoint: only the first box writes them"
        )

    def close(self) -> None:
        left = self.writes.drain(DRAIN_S)
        if left:
            raise RuntimeError(f"the database was away for {DRAIN_S:g} s: {left} writes of the run lost")


def arguments(argv: list[str]) -> argparse.Namespace:
    """``JOB_ID`` and, for a box of a job on several hosts, where it stands in the run."""
    parser = argparse.ArgumentParser(prog="python -m server.worker.trainer")
    parser.add_argument("job_id")
    parser.add_argument("--boxes", type=int, default=1, help="boxes in the run (1: one host)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--address", default="", help="HOST:PORT of the first box's rendezvous")
    parser.add_argument("--host", default="", help="this box's host name")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--interface", default=None)
    return parser.parse_args(argv)


def box_argv(
    *, boxes: int, rank: int, address: str, host: str, timeout_s: float, interface: str | None
) -> list[str]:
    """``arguments``' options for one box of a run on several hosts."""
    argv = ["--boxes", str(boxes), "--rank", str(rank), "--address", address, "--host", host]
    argv += ["--timeout-s", str(timeout_s)]
    return argv + (["--interface", interface] if interface else [])


def _lost(folder: Path, exc: Exception) -> None:
    """What the supervisor records of a lost box: its host and rank (``BOX_LOST_FILE``)."""
    lost = {"host": getattr(exc, "host", None), "rank": getattr(exc, "rank", None), "message": str(exc)}
    with contextlib.suppress(OSError):
        (folder / BOX_LOST_FILE).write_text(json.dumps(lost))


def main(argv: list[str]) -> int:
    try:
        args = arguments(argv)
    except SystemExit:
        return EXIT_FAILED
    job_id, rank, several = args.job_id, args.rank, args.boxes > 1
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cancel = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: cancel.set())
    settings = get_settings()
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        job = jobs.get_job(session, job_id=job_id)
        if job is None:
            print(f"no job {job_id}", file=sys.stderr)
            return EXIT_FAILED
        stored, output_dir, base_model = dict(job.config), job.output_dir, job.base_model
    folder = files.run_folder(settings, output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ERROR_FILE).unlink(missing_ok=True)
    (folder / BOX_LOST_FILE).unlink(missing_ok=True)
    try:
        from engine import TrainConfig, train

        store = files.open_store(settings)
        raw = files.local_config(settings, store, config=stored, base_model=base_model, output_dir=output_dir)
        if rank == 0:  # the other boxes get the state from the first over the group: no files
            with sessions() as session:
                saved = checkpoints.list_for(session, job_id=job_id, storage=store)
            latest = saved[-1].path if saved else None
            if files.pull_checkpoint(store, key=latest, folder=folder, output_dir=output_dir):
                print(f"pulled the stored checkpoint {latest}", flush=True)
        config = TrainConfig.parse(raw)  # a ConfigError's message shows no secret a value held
        keep = config.checkpoint.keep_last
        sink: DatabaseSink | BoxSink
        if rank == 0:
            sink = DatabaseSink(sessions, job_id, store=store, output_dir=output_dir, keep_last=keep)
            judged: Any = job_tracking.early_stopping(sink, sessions, job_id, cancel)  # a sweep's trial
            tracking = job_tracking.options(settings, sessions, job_id)
        else:
            sink = judged = BoxSink(sessions, job_id, host=args.host, rank=rank)
            tracking = None
        reserve = settings.checkpoint_reserve_bytes
        extra: dict[str, Any] = {}
        if several:
            from engine.distributed import Boxes

            extra["boxes"] = Boxes(
                world_size=args.boxes,
                rank=rank,
                address=args.address,
                timeout_s=args.timeout_s,
                host=args.host,
                interface=args.interface,
            )
        try:
            result = train(
                config,
                judged,
                cancel,
                models_dir=settings.models_dir,
                reserve_bytes=reserve,
                tracking=tracking,
                **extra,
            )
        finally:
            sink.close()  # what the run logged while the database was away, written before the exit
        if rank == 0:
            job_tracking.keep_tensorboard(store, config, output_dir=output_dir, folder=folder)
    except Exception as exc:
        from engine.distributed import BoxLost

        if isinstance(exc, BoxLost):  # another box died or lost its network
            traceback.print_exc()
            _lost(folder, exc)
            return EXIT_BOX_LOST
        full = isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in FULL)
        with contextlib.suppress(OSError):  # the log and the reason may not fit on a full disk either
            traceback.print_exc()
            (folder / ERROR_FILE).write_text(failure_text(exc)[:4000])
        where = getattr(exc, "fields", None)
        if callable(where) or full:  # where it failed, as data on the job's events too
            data = where() if callable(where) else {"path": getattr(exc, "filename", None)}
            with sessions() as session:
                message = failure_text(exc)
                data = data | {"disk_full": True} if full else data
                jobs.add_event(session, job_id=job_id, kind=EventKind.LOG, message=message, data=data)
        return EXIT_DISK_FULL if full else EXIT_FAILED
    print(f"finished: {result.status} at step {result.step}/{result.total_steps}", flush=True)
    return EXIT_CANCELLED if result.status == "cancelled" else EXIT_OK


def failure_text(exc: BaseException) -> str:
    """What a failed job's ``error`` says: for an engine failure where it happened first ("failed
    in backward stage B3 on cuda:1 at step 120: ..."), else the exception's type and message."""
    if isinstance(exc, DiskFull):
        return str(exc)
    where = getattr(exc, "where", None)
    place = where() if callable(where) else ""
    text = f"{type(exc).__name__}: {exc}"
    return f"failed {place}: {text}" if place else text


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
