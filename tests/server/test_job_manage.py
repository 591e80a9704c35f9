"""Managing jobs: resume (from the latest checkpoint, with a real worker), delete with the job's
files, disk use per job and in total, default names. On a real SQLite file (and PostgreSQL)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from server.kinds import JobStatus
from server.services import checkpoints, jobs
from server.settings import Settings
from server.tables import Checkpoint, JobEvent
from tests.server.conftest import WorkerProcess
from tests.server.test_worker import dataset
from tests.utils.jobs import start_job, states, wait_for_job

ROWS = [
    {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
    for i in range(12)
]


def upload(client: TestClient, name: str = "manage-set") -> str:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", content)}, data={"name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def new_job(client: TestClient, dataset_id: str, **extra: Any) -> dict[str, Any]:
    return start_job(client, dataset_id, **extra)


def folder_size(folder: Path) -> int:
    return sum((Path(d) / f).stat().st_size for d, _, files in os.walk(folder) for f in files)


def rows_of(client: TestClient, job_id: str) -> tuple[int, int]:
    """The job's event and checkpoint rows in the database."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        events = session.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id))
        saved = session.scalar(
            select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == job_id)
        )
    return int(events or 0), int(saved or 0)


def force_status(client: TestClient, job_id: str, *path: JobStatus) -> None:
    """Walk a job through ``path`` as a worker would (no worker runs in these tests)."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        job = jobs.get_job(session, job_id=job_id)
        assert job is not None
        for to in path:
            jobs.transition(session, job=job, to=to)


def test_resume_and_delete_refuse_active_or_finished_jobs_naming_the_state(client: TestClient) -> None:
    job = new_job(client, upload(client))
    assert job["status"] == "queued"
    for method, url in (("POST", f"/api/jobs/{job['id']}/resume"), ("DELETE", f"/api/jobs/{job['id']}")):
        r = client.request(method, url)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "illegal_transition" and error["param"] == "status"
        assert "is queued" in error["message"], error
    assert "cancel it first" in client.delete(f"/api/jobs/{job['id']}").json()["error"]["message"]

    force_status(client, job["id"], JobStatus.RUNNING)
    for method, url in (("POST", f"/api/jobs/{job['id']}/resume"), ("DELETE", f"/api/jobs/{job['id']}")):
        r = client.request(method, url)
        assert r.status_code == 409 and "is running" in r.json()["error"]["message"], r.text
    force_status(client, job["id"], JobStatus.SUCCEEDED)
    r = client.post(f"/api/jobs/{job['id']}/resume")
    assert r.status_code == 409 and "is succeeded" in r.json()["error"]["message"], r.text
    assert client.delete(f"/api/jobs/{job['id']}").status_code == 204  # a finished job may go

    for missing in (client.post("/api/jobs/nosuchjob/resume"), client.delete("/api/jobs/nosuchjob")):
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "job_id"


def test_resume_queues_a_cancelled_failed_or_interrupted_job_again(client: TestClient) -> None:
    data = upload(client)
    for path in (
        [JobStatus.CANCELLED],
        [JobStatus.RUNNING, JobStatus.FAILED],
        [JobStatus.RUNNING, JobStatus.INTERRUPTED],
    ):
        job = new_job(client, data)
        force_status(client, job["id"], *path)
        before = client.get(f"/api/jobs/{job['id']}").json()
        assert (before["finished_at"] is not None) is (path[-1] != JobStatus.INTERRUPTED)
        r = client.post(f"/api/jobs/{job['id']}/resume")
        assert r.status_code == 200, r.text
        resumed = r.json()
        assert resumed["status"] == "queued" and resumed["finished_at"] is None and resumed["error"] is None
        assert resumed["started_at"] == before["started_at"]  # the first start stays
        assert states(client, job["id"])[-2:] == [path[-1], "queued"]
        events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
        assert events[-1]["data"]["resumed"] is True and "continues from the start" in events[-1]["message"]
        # queued again: cancel it, and it can be resumed once more
        assert client.post(f"/api/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        assert client.post(f"/api/jobs/{job['id']}/resume").json()["status"] == "queued"


def test_delete_removes_rows_and_files_and_tolerates_missing_files(
    client: TestClient, settings: Settings
) -> None:
    data = upload(client)
    job = new_job(client, data)
    assert client.post(f"/api/jobs/{job['id']}/cancel").status_code == 200
    folder = settings.runs_dir / job["id"]
    assert Path(job["config"]["output_dir"]) == folder
    step = folder / "checkpoints" / "step_000002"
    (step / "state").mkdir(parents=True)
    (step / "adapter_model.safetensors").write_bytes(b"w" * 3000)
    (step / "state" / "trainer.json").write_text("{}")
    (folder / "exports" / "step_000002-merged").mkdir(parents=True)
    (folder / "exports" / "step_000002-merged" / "model.safetensors").write_bytes(b"m" * 5000)
    (folder / "exports" / "x-step000002-adapter.tar").write_bytes(b"t" * 700)
    (folder / "train.log").write_text("line\n" * 10)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=2, path=str(step), kind="adapter", metrics={})
    assert rows_of(client, job["id"])[1] == 1

    # disk use: the folder's bytes, in the job, the list and the total
    size = folder_size(folder)
    assert size == 3000 + 2 + 5000 + 700 + 50
    assert client.get(f"/api/jobs/{job['id']}").json()["disk_bytes"] == size
    listed = {j["id"]: j["disk_bytes"] for j in client.get("/api/jobs").json()["data"]}
    assert listed[job["id"]] == size
    (folder / "train.log").write_text("line\n" * 20)  # the log grows: seen at once
    assert client.get(f"/api/jobs/{job['id']}").json()["disk_bytes"] == size + 50
    (folder / "exports" / "another.tar").write_bytes(b"a" * 100)  # an export added: seen at once
    assert client.get(f"/api/jobs/{job['id']}").json()["disk_bytes"] == size + 150
    other = new_job(client, data)  # no folder yet: 0 bytes
    assert client.get(f"/api/jobs/{other['id']}").json()["disk_bytes"] == 0
    total = client.get("/api/disk").json()
    assert total["jobs"] == 2 and total["jobs_bytes"] == size + 150
    assert total["datasets_bytes"] > 0 and 0 <= total["free_bytes"] <= total["capacity_bytes"]

    r = client.delete(f"/api/jobs/{job['id']}")
    assert r.status_code == 204 and r.content == b""
    assert not folder.exists()
    assert rows_of(client, job["id"]) == (0, 0)
    assert client.get(f"/api/jobs/{job['id']}").status_code == 404
    assert client.get(f"/api/jobs/{job['id']}/events").status_code == 404
    assert client.delete(f"/api/jobs/{job['id']}").status_code == 404
    assert client.get("/api/disk").json()["jobs"] == 1
    assert [j["id"] for j in client.get("/api/jobs").json()["data"]] == [other["id"]]

    # files already gone (never written, or removed by hand): no error
    assert client.post(f"/api/jobs/{other['id']}/cancel").status_code == 200
    assert not (settings.runs_dir / other["id"]).exists()
    assert client.delete(f"/api/jobs/{other['id']}").status_code == 204
    assert rows_of(client, other["id"]) == (0, 0)


def test_a_job_without_a_name_is_named_after_its_model_dataset_and_time(client: TestClient) -> None:
    data = upload(client, name="count-set")
    first = new_job(client, data)
    assert re.fullmatch(r"tiny on count-set \d\d:\d\d(:\d\d)?", first["name"]), first["name"]
    second = new_job(client, data)
    assert second["name"] != first["name"] or second["name"].count(":") == 2
    assert new_job(client, data, name="mine")["name"] == "mine"


def test_resume_of_a_cancelled_job_continues_from_its_checkpoint_to_success(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    if worker_settings.redis_url is not None:
        pytest.skip("resume does not depend on the broker: run once, with the folder transport")
    client = worker_client
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, dataset(client), hyper={"max_steps": 200}, checkpoint={"every_steps": 1000})
    wait_for_job(client, job["id"], lambda j: j["status"] == "running" and j["step"] >= 2, logs=workers)
    assert client.post(f"/api/jobs/{job['id']}/cancel").status_code == 200
    job = wait_for_job(client, job["id"], {"cancelled", "succeeded"}, logs=workers)
    assert job["status"] == "cancelled", "the job finished before the cancel took effect"
    stopped_at = job["step"]
    assert 2 <= stopped_at < 200

    r = client.post(f"/api/jobs/{job['id']}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    assert (job["step"], job["attempts"]) == (200, 2)
    assert job["started_at"] <= job["finished_at"]
    assert states(client, job["id"])[-5:] == ["cancelling", "cancelled", "queued", "running", "succeeded"]
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    (resumed,) = [e for e in events if e["kind"] == "resume"]
    assert resumed["data"]["step"] == stopped_at
    # the stream replays past the old final state, to the new one
    with client.stream("GET", f"/api/jobs/{job['id']}/stream", headers={"Last-Event-ID": "0"}) as s:
        text = "".join(s.iter_text())
    assert [int(x[4:]) for x in text.splitlines() if x.startswith("id: ")] == [e["id"] for e in events]
    assert text.rstrip().endswith('data: {"status": "succeeded"}')

    folder = Path(job["config"]["output_dir"])
    assert job["disk_bytes"] == folder_size(folder) > 0
    assert client.delete(f"/api/jobs/{job['id']}").status_code == 204
    assert not folder.exists() and client.get(f"/api/jobs/{job['id']}").status_code == 404
