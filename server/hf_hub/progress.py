"""A Hub transfer's progress as its worker records it: bytes done, the speed over the last few
seconds, and the lease renewed in the transfer's row; a pull of a model or a dataset and a push
all report through a ``Reporter``, which also tells them when the transfer was cancelled."""

from __future__ import annotations

import threading
import time
from collections import deque

from sqlalchemy.orm import Session, sessionmaker

from server.services import transfers
from server.settings import Settings
from server.tables import HubTransfer

WRITE_EVERY_S = 0.5
SPEED_WINDOW_S = 5.0


class Meter:
    """Bytes done, and the speed over the last few seconds."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()
        self.done = 0

    def add(self, done: int) -> None:
        self.done = done
        t = time.monotonic()
        self.samples.append((t, done))
        while len(self.samples) > 2 and t - self.samples[0][0] > SPEED_WINDOW_S:
            self.samples.popleft()

    def speed(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return max(0.0, (d1 - d0) / (t1 - t0)) if t1 > t0 else None


class Reporter:
    """Progress into the transfer's row (at most every ``WRITE_EVERY_S``) with the lease renewed;
    says when the transfer was cancelled."""

    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, worker_id: str
    ) -> None:
        self.settings, self.sessions, self.worker_id = settings, sessions, worker_id
        self.transfer_id = row.id
        self.meter = Meter()
        self.meter.add(row.bytes_done)
        self.bytes_total: int | None = None
        self.written = 0.0
        self.status: str | None = row.status
        self.lock = threading.Lock()

    def progress(self, done: int) -> None:
        with self.lock:
            self.meter.add(done)
        self.tick(force=False)

    def total(self, total: int) -> None:
        """The bytes to move, known once the child has them (a push's folder)."""
        with self.lock:
            self.bytes_total = total
        self.tick()

    def tick(self, *, force: bool = True) -> bool:
        """Write the progress when due (always with ``force``); True when cancelled."""
        with self.lock:
            if not force and time.monotonic() - self.written < WRITE_EVERY_S:
                return self.status == transfers.CANCELLING
            self.written = time.monotonic()
            done, speed, total = self.meter.done, self.meter.speed(), self.bytes_total
        with self.sessions() as session:
            self.status = transfers.progress(
                session,
                transfer_id=self.transfer_id,
                worker_id=self.worker_id,
                bytes_done=done,
                bytes_per_s=speed,
                lease_seconds=self.settings.lease_seconds,
                bytes_total=total,
            )
        return self.status == transfers.CANCELLING

    def cancelled(self) -> bool:
        return (
            self.tick(force=False)
            if time.monotonic() - self.written >= WRITE_EVERY_S
            else self.status == transfers.CANCELLING
        )
