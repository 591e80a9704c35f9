"""A tracker driven from a thread of its own: the run only queues its metric points, so a tracker
that is slow or down never slows or fails it.

The thread starts the tracker's run, sends the points in the order they were logged, then finishes
the run. A call that fails is tried again after a pause that doubles up to a cap; new points never
cut a pause short, and nothing is given up while the run lasts. Points wait in memory up to a
bound, then in a spool file under the run folder (``engine.tracking.spool``). When the run ends,
``close`` waits a bounded time for the rest; what is still queued then stays in the spool file,
which the next run in the folder (a resume) sends first. Problems reach the run's sink as
``tracker`` events: once when a tracker stops answering, once when it answers again, when points
go to the spool file (told by the thread, at its next try), and when any are left there at the end.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.tracking.spool import Point, Spool, step_ranges
from engine.tracking.uris import redact_urls

Warn = Callable[[str, dict[str, Any]], None]
BATCH_METRICS = 1_000  # values per call at most (MLflow's log_batch takes 1000 metrics)


@dataclass(frozen=True)
class RetryPolicy:
    """How a background tracker tries.

    Attributes:
        first_pause_s: the pause after the first failure of a call; it doubles up to ``max_pause_s``.
        max_pause_s: the longest pause between two tries.
        closing_pause_s: the longest pause once the run has ended (``close`` is waiting).
        queue: points kept in memory at most; the next ones wait in the spool file.
        close_s: how long ``close`` waits for the queued points and the run's finish.
    """

    first_pause_s: float = 1.0
    max_pause_s: float = 30.0
    closing_pause_s: float = 1.0
    queue: int = 10_000
    close_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("first_pause_s", "max_pause_s", "closing_pause_s"):  # no pause: a busy loop
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RetryPolicy.{name} is a number of seconds > 0, not {value!r}")
        if not self.close_s >= 0:
            raise ValueError(f"RetryPolicy.close_s is a number of seconds >= 0, not {self.close_s!r}")
        if self.queue < 1:
            raise ValueError(f"RetryPolicy.queue holds at least 1 point, not {self.queue}")


class Background:
    """Runs one tracker on a daemon thread: ``start``, then ``send`` with the points in order
    (``batch`` at most per call), then the ``finish`` given to ``close``."""

    def __init__(
        self,
        name: str,
        *,
        start: Callable[[], None],
        send: Callable[[list[Point]], None],
        spool: Path,
        warn: Warn,
        policy: RetryPolicy | None = None,
        batch: int = 1,
    ) -> None:
        self.name, self.warn, self.policy = name, warn, policy or RetryPolicy()
        self.start_call, self.send, self.batch = start, send, batch
        self.finish_call: Callable[[], None] | None = None
        self.lock = threading.Condition()  # guards the spool and the flags; notified by log and close
        self.closing = threading.Event()  # the run has ended: pauses shorten
        self.stopped = threading.Event()  # close gave up waiting: the thread delivers nothing more
        self.failing = False
        self.spilling = False  # the memory bound was hit and the spool file holds new points
        self.notes: list[tuple[str, dict[str, Any]]] = []  # warnings from ``log``, for the thread
        self.spool = Spool(spool, limit=self.policy.queue)
        if self.spool.unreadable:
            self._warn(f"skipped {self.spool.unreadable} unreadable line(s) of {self._where()}")
        if self.spool.inherited:
            steps = self.spool.inherited
            self._warn(
                f"sends first the {len(steps)} point(s) (steps {step_ranges(steps)}) an earlier run left "
                f"in {self._where()}",
                replaying=len(steps),
                steps=step_ranges(steps),
            )
        self.thread = threading.Thread(target=self._loop, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def log(self, point: Point) -> None:
        """Queue ``point``; returns at once (past the memory bound: after one line written)."""
        with self.lock:
            try:
                in_memory, failed = self.spool.push(point), None
            except OSError as exc:
                in_memory, failed = False, exc
            self.lock.notify()
            # told by the thread: a warning takes the run's lock, which the run holds here
            if failed is not None:
                said = f"{self._where()} could not be written ({failed})"
                self._note(f"lost the point of step {point.step}: {said}", lost=1)
            elif not in_memory and not self.spilling and not self.stopped.is_set():
                self.spilling = True
                self._note(
                    f"{self.policy.queue} points wait in memory: from step {point.step} on they wait in "
                    f"{self._where()}",
                    queue=self.policy.queue,
                    from_step=point.step,
                )

    def close(self, finish: Callable[[], None] | None = None) -> bool:
        """Let the queued points and then ``finish`` go for at most ``policy.close_s``; True when
        all of them did (else the points left are in the spool file, and an event says which)."""
        with self.lock:
            self.finish_call = finish
            self.closing.set()
            self.lock.notify()
        self.thread.join(self.policy.close_s)
        if not self.thread.is_alive():
            self._tell_notes()
            return True
        failed: OSError | None = None
        with self.lock:
            self.stopped.set()
            self.lock.notify()
            try:
                steps = self.spool.dump()  # with the batch in flight: it may have got through
            except OSError as exc:
                steps, failed = [p.step for p in self.spool.memory], exc
        if failed is not None:
            self._warn(
                f"lost {len(steps)} point(s) (steps {step_ranges(steps)}) when the run ended: "
                f"{self._where()} could not be written ({failed})",
                lost=len(steps),
                steps=step_ranges(steps),
            )
        self._tell_notes()
        if steps:
            self._warn(
                f"{len(steps)} point(s) (steps {step_ranges(steps)}) not delivered by the run's end "
                f"are kept in {self._where()}; a resumed run sends them first",
                spooled=len(steps),
                steps=step_ranges(steps),
                first_step=min(steps),
                last_step=max(steps),
            )
        else:
            self._warn("the run's end came before its finish went through", given_up=1)
        return False

    def _loop(self) -> None:
        if not self._deliver("start", self.start_call):
            return
        while True:
            self._tell_notes()
            with self.lock:
                if self.stopped.is_set():
                    return
                batch = self.spool.head(points=self.batch, metrics=BATCH_METRICS)
                if self.spool.lost:
                    lost, self.spool.lost = self.spool.lost, 0
                    said = self.spool.lost_because
                    self._note(f"lost {lost} point(s) of {self._where()}: {said}", lost=lost)
                if not batch:
                    if self.closing.is_set():
                        break
                    if not self.notes:
                        self.lock.wait()
                    continue
            if not self._deliver("log", functools.partial(self.send, batch)):
                return
            with self.lock:
                if self.stopped.is_set():  # close has put this batch in the spool file already
                    return
                self.spool.done(len(batch))
                if self.spilling and not self.spool.on_disk:
                    self.spilling = False
        finish = self.finish_call
        if finish is not None and not self.stopped.is_set():
            self._deliver("finish", finish)

    def _deliver(self, what: str, call: Callable[[], None]) -> bool:
        """Try ``call`` until it goes through (True) or ``close`` stops waiting (False)."""
        pause = self.policy.first_pause_s
        while not self.stopped.is_set():
            try:
                call()
            except Exception as exc:  # any failure of a tracker is its own, never the run's
                if not self.failing:
                    self.failing = True
                    said = redact_urls(str(exc))  # a URL in it may carry a token (a query, userinfo)
                    self._warn(f"{what} failed ({type(exc).__name__}: {said}); retrying in the background")
                self._tell_notes()
                # the pause waits for the run's end only: a new point must not cut it short
                if self.closing.is_set():
                    self.stopped.wait(min(pause, self.policy.closing_pause_s))
                else:
                    self.closing.wait(pause)
                pause = min(pause * 2, self.policy.max_pause_s)
                continue
            if self.failing:
                self.failing = False
                self._warn(f"reachable again ({what} went through)")
            return True
        return False

    def _note(self, message: str, **data: Any) -> None:
        """A warning for the thread to tell (the caller holds the lock)."""
        self.notes.append((message, data))

    def _tell_notes(self) -> None:
        with self.lock:
            notes, self.notes = self.notes, []
        for message, data in notes:
            self._warn(message, **data)

    def _where(self) -> str:
        return f"{self.spool.path.parent.name}/{self.spool.path.name} in the run folder"

    def _warn(self, message: str, **data: Any) -> None:
        with contextlib.suppress(Exception):  # a sink failing to record it must not stop the tracker
            self.warn(f"{self.name}: {message}", {"tracker": self.name, "level": "warning", **data})
