"""A model pulled from the Hub on a service whose store is S3 lands in the shared models store too,
where workers on other hosts fetch it (a real S3 API: moto's server; the local Hub server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import WorkerProcess
from tests.server.test_hub_models import api, hub, progress_events, settings_for
from tests.utils.fake_hub import FakeHub
from tests.utils.s3 import S3Server, s3_server, s3_settings

__all__ = ["hub", "s3_server", "s3_settings"]  # fixtures used here


@pytest.mark.slow
def test_a_pull_on_an_s3_store_lands_in_the_shared_models_store(
    tmp_path: Path, hub: FakeHub, s3_server: S3Server, s3_settings: dict[str, Any]
) -> None:
    settings = settings_for(tmp_path, hub, **s3_settings)
    with api(settings) as client:
        worker = WorkerProcess(settings, tmp_path / "worker.log").start()
        try:
            pull = client.post("/api/models/pulls", json={"repo_id": "org/tiny"}).json()
            events = progress_events(client, pull["id"])
            assert events[-1]["status"] == "succeeded", (events[-1], worker.tail())
        finally:
            worker.end()
    bucket = settings.storage_url.removeprefix("s3://").split("/")[0]
    prefix = settings.storage_url.removeprefix(f"s3://{bucket}").strip("/")
    models = f"{prefix}/models/org/tiny/".lstrip("/")
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=models)
    stored = {obj["Key"].rsplit("/", 1)[-1]: obj["Size"] for obj in listed.get("Contents", [])}
    # every file the pull fetched, at its size, in the store (and the pull's source record)
    assert {f["path"]: f["size"] for f in pull["files"]}.items() <= stored.items(), stored
    assert ".hub-source.json" in stored
