"""Running a coroutine to the end from a test, whatever else runs in the test's thread.

A test process of the parallel suite may have run a browser test before: Playwright's sync API
keeps an event loop running in the main thread, where ``asyncio.run`` then refuses to start. A
coroutine run in a thread of its own has a loop of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` in a new thread; its result, or its exception raised here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
