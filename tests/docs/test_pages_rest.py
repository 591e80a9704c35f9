"""The manual's examples: the pages no other group names, each page one test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import group, page_id, run_page


@pytest.mark.slow
@pytest.mark.parametrize("page", group("rest"), ids=page_id)
def test_page(
    page: Path, request: pytest.FixtureRequest, tmp_path: Path, demo_models: Path, kernel_cache: Path
) -> None:
    run_page(page, request, tmp_path, demo_models, kernel_cache)
