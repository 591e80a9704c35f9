"""A tracker driven from a thread of its own: the run only queues calls, so a tracker that is slow
or down never slows or fails it.

Each call is retried with a growing pause, a bounded number of times; the queue is bounded (its
oldest metrics are dropped first); ``close`` waits a bounded time for the rest. Problems reach the
run's sink as ``tracker`` events: once when a tracker stops answering, once when it answers again,
and when calls are given up.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.tracking.uris import redact_urls

Warn = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class RetryPolicy:
    """How hard a background tracker tries.

    Attributes:
        attempts: tries of one call before it is given up (starting the run: the tracker is off).
        first_pause_s: the pause after the first failure; it doubles up to ``max_pause_s``.
        max_pause_s: the longest pause between two tries.
        queue: calls kept waiting at most (the oldest metrics are dropped beyond it).
        close_s: how long ``close`` waits for the queued calls.
    """

    attempts: int = 6
    first_pause_s: float = 1.0
    max_pause_s: float = 30.0
    queue: int = 10_000
    close_s: float = 20.0


class Background:
    """Runs one tracker's calls in order on a daemon thread."""

    def __init__(self, name: str, *, warn: Warn, policy: RetryPolicy | None = None) -> None:
        self.name, self.warn, self.policy = name, warn, policy or RetryPolicy()
        self.calls: collections.deque[tuple[str, Callable[[], None]]] = collections.deque()
        self.wake = threading.Condition()
        self.closing = False
        self.disabled = False
        self.failing = False
        self.dropped = 0
        self.thread = threading.Thread(target=self._loop, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def submit(self, what: str, call: Callable[[], None]) -> None:
        """Queue ``call`` (``what`` names it in warnings); returns at once."""
        with self.wake:
            if self.disabled or self.closing:
                return
            if len(self.calls) >= self.policy.queue:  # the oldest metrics go; a start or finish stays
                oldest = next((i for i, (w, _) in enumerate(self.calls) if w == "log"), None)
                if oldest is not None:
                    del self.calls[oldest]
                    self.dropped += 1
            self.calls.append((what, call))
            self.wake.notify()

    def close(self) -> bool:
        """Let the queued calls run for at most ``policy.close_s``; True when all of them did."""
        with self.wake:
            self.closing = True
            self.wake.notify()
        self.thread.join(self.policy.close_s)
        if self.thread.is_alive():
            with self.wake:
                left = len(self.calls) + 1
                self.calls.clear()
                self.disabled = True
                self.wake.notify()
            self._warn(f"gave up {left} call(s) still waiting when the run ended", given_up=left)
            return False
        return True

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.calls and not self.closing:
                    self.wake.wait()
                if not self.calls:
                    return
                what, call = self.calls.popleft()
            done = self._try(what, call)
            with self.wake:
                if not done and what == "start":  # without a run the rest cannot be delivered
                    self.disabled = True
                    self.calls.clear()
                    return

    def _try(self, what: str, call: Callable[[], None]) -> bool:
        pause = self.policy.first_pause_s
        for attempt in range(1, self.policy.attempts + 1):
            try:
                call()
            except Exception as exc:  # any failure of a tracker is its own, never the run's
                if not self.failing:
                    self.failing = True
                    said = redact_urls(str(exc))  # a URL in it may carry a token (a query, userinfo)
                    self._warn(f"{what} failed ({type(exc).__name__}: {said}); retrying in the background")
                if attempt == self.policy.attempts or self.disabled:
                    break
                with self.wake:  # a close cuts the pause short but not the tries
                    self.wake.wait(pause if not self.closing else min(pause, 0.2))
                pause = min(pause * 2, self.policy.max_pause_s)
                continue
            if self.failing:
                self.failing = False
                self._warn(f"reachable again ({what} went through)")
            if self.dropped:
                self._warn(f"dropped {self.dropped} call(s): its queue was full", dropped=self.dropped)
                self.dropped = 0
            return True
        tail = "; the tracker is off for this run" if what == "start" else ""
        self._warn(f"gave up {what} after {self.policy.attempts} tries{tail}", given_up=1)
        return False

    def _warn(self, message: str, **data: Any) -> None:
        with contextlib.suppress(Exception):  # a sink failing to record it must not stop the tracker
            self.warn(f"{self.name}: {message}", {"tracker": self.name, "level": "warning", **data})
