"""An iterator read ahead by a background thread: the GGUF export reads and lays out the next
tensor while the encoders work on this one (reading is mostly waiting on the file and torch's
conversions, both outside the GIL)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class Ahead(Generic[T]):
    """``items`` as they come, produced by a background thread that keeps up to ``depth`` of
    them ready while the consumer works on the last one; it starts at once. The producer's
    exception is raised to the consumer; ``close()`` (or leaving the ``with`` block) stops the
    thread and closes ``items``, also when the consumer stopped early or failed."""

    def __init__(self, items: Iterator[T], *, depth: int = 1) -> None:
        self._items = items
        self._ready: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name="read-ahead", daemon=True)
        self._thread.start()

    def _put(self, entry: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._items:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as error:  # handed to the consumer, raised there
            self._put(("error", error))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Ahead[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        kind, value = self._ready.get()
        if kind == "item":
            return cast(T, value)
        self._done = True
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Ahead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
