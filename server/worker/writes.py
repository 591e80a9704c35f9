"""The training process's writes to the database (metrics, progress, events, checkpoint rows),
kept through an outage of the database server.

Each write is one transaction, made at once while the database answers. When the server cannot be
reached (``db.unavailable``: stopped, restarting), that write and every later one are kept in
memory, in order, and a thread writes them as soon as it is back (many in one transaction, so it
catches up with a run that trains on meanwhile), retrying with backoff. Each write's event is
dated when the write was made, a time unique in the process: a try whose commit was cut (its
outcome unknown) is looked for by it before it is made again, so none is written twice.
``drain()`` waits for the kept writes (at the end of a run).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from server.db import unavailable
from server.tables import JobEvent, now

FIRST_RETRY_S = 0.5  # the first retry after a failed one; doubled up to MAX_RETRY_S
MAX_RETRY_S = 2.0
MAX_BATCH = 500  # kept writes made in one transaction at most
# the writes kept at most: past it a write waits for the database (the run pauses on it) rather
# than the memory growing without end (a day-long outage of a fast run)
MAX_KEPT = 200_000
TICK = timedelta(microseconds=1)


@dataclass
class Write:
    """One write: ``apply(session, at)`` adds its rows to a session, its event dated ``at``, and
    returns that event. ``alone``: it commits some of its rows itself (a checkpoint's row), so it is
    never made in one transaction with others."""

    apply: Callable[[Session, datetime], JobEvent]
    kind: str  # its event's
    alone: bool = False
    at: datetime | None = None  # when it was made: set by ``Writes.write``, unique in the process
    tried: int | None = None  # the failed try it was in last: that commit may have gone through


class Writes:
    """The writes of one job's training process, in the order they were made (thread-safe)."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str) -> None:
        self.sessions, self.job_id = sessions, job_id
        self.kept: deque[Write] = deque()
        self.changed = threading.Condition()
        self.flusher: threading.Thread | None = None
        self.failed: BaseException | None = None
        self.last_at: datetime | None = None
        self.tries = 0  # failed commits of writes (each a try whose outcome is unknown)
        self.late = 0  # writes kept and since written, in this outage

    def write(self, write: Write) -> None:
        """Make ``write`` now, or keep it (after the ones kept before it) while the database is away.

        Raises:
            Exception: what a write raised that is not the database's absence, now or in the thread
                that makes the kept ones.
        """
        with self.changed:
            self.changed.wait_for(lambda: len(self.kept) < MAX_KEPT or self.failed is not None)
            if self.failed is not None:
                raise self.failed
            at = now()
            write.at = self.last_at = at if self.last_at is None or at > self.last_at else self.last_at + TICK
            if not self.kept:
                try:
                    self._commit([write])
                    return
                except DBAPIError as exc:
                    if not unavailable(exc):
                        raise
                    print(f"database unavailable ({_first_line(exc)}): keeping the run's writes", flush=True)
            self.kept.append(write)
            if self.flusher is None:
                self.flusher = threading.Thread(target=self._flush, name="roundhouse-writes", daemon=True)
                self.flusher.start()

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the kept writes to be made; returns how many are left.

        Raises:
            Exception: a kept write failed for another reason than the database's absence.
        """
        with self.changed:
            self.changed.wait_for(lambda: not self.kept or self.failed is not None, timeout=timeout)
            if self.failed is not None:
                raise self.failed
            return len(self.kept)

    def _commit(self, batch: list[Write]) -> int:
        """Make ``batch`` in one transaction. Returns how many of its first writes are now in the
        database: all, or those of an earlier try that went through after all (found by their
        first event), which are not made again.

        Only a failed commit marks the batch as tried (its outcome unknown, every write of it in
        or out together); a try that failed before its commit (the lookup, a write's own query)
        changed nothing, and marking it would join writes whose earlier tries differ: the first
        found would then take the others, never written, with it."""
        first = batch[0]
        with self.sessions() as session:
            if first.tried is not None and self._found(session, first):
                return sum(1 for _ in itertools.takewhile(lambda w: w.tried == first.tried, batch))
            for write in batch:
                assert write.at is not None
                write.apply(session, write.at)
            try:
                session.commit()
            except DBAPIError as exc:
                if unavailable(exc):
                    self._tried(batch)
                raise
        return len(batch)

    def _found(self, session: Session, write: Write) -> bool:
        """Whether ``write``'s event is in the database (by its kind and its unique time)."""
        q = select(JobEvent.id).where(
            JobEvent.job_id == self.job_id, JobEvent.kind == write.kind, JobEvent.created_at == write.at
        )
        return session.scalar(q.limit(1)) is not None

    def _tried(self, batch: list[Write]) -> None:
        with self.changed:
            self.tries += 1
            for write in batch:
                write.tried = self.tries

    def _batch(self) -> list[Write]:
        """The kept writes made next in one transaction: the oldest ones, up to one that is alone."""
        if self.kept[0].alone:
            return [self.kept[0]]
        together = itertools.takewhile(lambda w: not w.alone, self.kept)
        return list(itertools.islice(together, MAX_BATCH))

    def _flush(self) -> None:
        """The kept writes, oldest first, as soon as the database answers again."""
        delay = FIRST_RETRY_S
        while True:
            with self.changed:
                if not self.kept:
                    print(f"database back: {self.late} kept writes written", flush=True)
                    self.late, self.flusher = 0, None
                    self.changed.notify_all()
                    return
                batch = self._batch()
            try:
                done = self._commit(batch)
            except DBAPIError as exc:
                if unavailable(exc):
                    time.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_S)
                    continue
                self._fail(exc)
                return
            except Exception as exc:
                self._fail(exc)
                return
            delay = FIRST_RETRY_S
            with self.changed:
                for _ in range(done):
                    self.kept.popleft()
                self.late += done
                self.changed.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self.changed:
            print(f"a kept write failed: {exc!r}", flush=True)
            self.failed, self.flusher = exc, None
            self.changed.notify_all()


def _first_line(exc: DBAPIError) -> str:
    text = str(exc.orig).strip()
    return text.splitlines()[0] if text else type(exc.orig).__name__
