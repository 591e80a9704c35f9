"""What the whole suite shares: its slowest files start first.

The suite runs its files in parallel, each file whole on one worker (pyproject.toml: ``-n auto
--dist loadfile``), taken from the queue in collection order. A slow file near the end of the
queue keeps one worker busy while the others sit idle, so the files with a test marked ``slow``
are moved to the front of the queue; every file keeps its tests in their own order.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # a stable sort: the order otherwise kept
