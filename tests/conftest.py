"""What the whole suite shares: one compute thread per test process when several run, and the
slowest files first.

The suite runs its files in parallel, each file whole on one worker (pyproject.toml: ``-n auto
--dist loadfile``), taken from the queue in collection order. With one test process per core,
torch's own threads (one per core in each process, and in each training or worker process a test
starts) only contend: each test process and its children compute on one thread
(``OMP_NUM_THREADS``, read when torch is first imported). A slow file near the end of the queue
keeps one worker busy while the others sit idle, so the files with a test marked ``slow`` are moved
to the front of the queue; every file keeps its tests in their own order.
"""

from __future__ import annotations

import os
import sys

import pytest

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    if "torch" in sys.modules:  # imported before this file (a plugin): set it there too
        sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # a stable sort: the order otherwise kept
