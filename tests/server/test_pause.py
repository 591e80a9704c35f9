"""Pause and resume: the transitions and their refusals (409 naming the status), the worker's side
(lease, sweep, claim, outcome) without a worker, and a real worker pausing a running job at a step
boundary with a checkpoint, resumed to the same final weights as a run never paused."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from server.kinds import JobStatus
from server.services import jobs
from server.settings import Settings
from server.tables import now
from tests.server.conftest import WorkerProcess
from tests.server.test_job_manage import force_status, new_job, upload
from tests.server.test_worker import dataset
from tests.utils.jobs import start_job, states, wait_for_job


def refused(client: TestClient, url: str, status: str) -> None:
    r = client.post(url)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "illegal_transition" and error["param"] == "status", error
    assert f"is {status}" in error["message"], error


def test_pause_a_queued_job_then_resume_or_cancel_it(client: TestClient) -> None:
    data = upload(client)
    job = new_job(client, data)
    r = client.post(f"/api/jobs/{job['id']}/pause")
    assert r.status_code == 200, r.text
    paused = r.json()
    assert paused["status"] == "paused" and paused["finished_at"] is not None
    assert states(client, job["id"])[-2:] == ["queued", "paused"]
    refused(client, f"/api/jobs/{job['id']}/pause", "paused")  # once is enough
    # resumed: queued again from its latest checkpoint (none yet), the stop time cleared
    r = client.post(f"/api/jobs/{job['id']}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["finished_at"] is None
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert events[-1]["data"] == {"from": "paused", "to": "queued", "resumed": True}
    # paused again, then cancelled: a paused job is cancelled at once
    assert client.post(f"/api/jobs/{job['id']}/pause").json()["status"] == "paused"
    assert client.post(f"/api/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert states(client, job["id"])[-3:] == ["queued", "paused", "cancelled"]

    # an interrupted job (its worker vanished; it waits for a new one) is paused at once too
    other = new_job(client, data)
    force_status(client, other["id"], JobStatus.RUNNING, JobStatus.INTERRUPTED)
    assert client.post(f"/api/jobs/{other['id']}/pause").json()["status"] == "paused"
    # a paused job may be deleted
    assert client.delete(f"/api/jobs/{other['id']}").status_code == 204
    assert client.post("/api/jobs/nosuchjob/pause").status_code == 404


def test_pause_refuses_finished_or_stopping_jobs_naming_the_status(client: TestClient) -> None:
    data = upload(client)
    for path in (
        [JobStatus.RUNNING, JobStatus.SUCCEEDED],
        [JobStatus.RUNNING, JobStatus.FAILED],
        [JobStatus.CANCELLED],
        [JobStatus.RUNNING, JobStatus.CANCELLING],
        [JobStatus.RUNNING, JobStatus.PAUSING],
    ):
        job = new_job(client, data)
        force_status(client, job["id"], *path)
        refused(client, f"/api/jobs/{job['id']}/pause", path[-1])
        assert client.get(f"/api/jobs/{job['id']}").json()["status"] == path[-1]  # unchanged
    # a pausing job is neither resumable nor deletable yet
    refused(client, f"/api/jobs/{job['id']}/resume", "pausing")
    r = client.delete(f"/api/jobs/{job['id']}")
    assert r.status_code == 409 and "wait until it is paused" in r.json()["error"]["message"], r.text


def test_the_worker_side_of_a_pause(client: TestClient) -> None:
    """Lease, outcome and sweep as the worker sees a pause; no worker process here."""
    data = upload(client)
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    held, finished, lost = (new_job(client, data)["id"] for _ in range(3))
    with sessions() as session:
        for job_id in (held, finished, lost):
            assert jobs.claim(session, job_id=job_id, worker_id="w1", lease_seconds=60)
            jobs.request_pause(session, job=jobs.get_job(session, job_id=job_id))
            assert jobs.status_of(session, job_id=job_id) == "pausing"
        # the worker holds a pausing job: it renews its lease, and no other worker takes it
        assert jobs.renew(session, job_id=held, worker_id="w1", lease_seconds=60) == "pausing"
        assert not jobs.claim(session, job_id=held, worker_id="w2", lease_seconds=60)
        # the run stopped on request (the engine's cancel): recorded as paused
        assert jobs.finish(
            session, job_id=held, worker_id="w1", to=JobStatus.CANCELLED, message="stopped at a step"
        )
        assert jobs.status_of(session, job_id=held) == "paused"
        # a run that finished before the pause took effect keeps its finish
        assert jobs.finish(session, job_id=finished, worker_id="w1", to=JobStatus.SUCCEEDED, message="done")
        assert jobs.status_of(session, job_id=finished) == "succeeded"
        # a pause that read the job running loses the race to the finish: nothing written
        job = jobs.get_job(session, job_id=finished)
        assert job is not None
        assert not jobs.move(session, job=job, frm="running", to=JobStatus.PAUSING, message="late")
        assert jobs.status_of(session, job_id=finished) == "succeeded"
        with pytest.raises(jobs.IllegalTransition, match="is succeeded"):
            jobs.request_pause(session, job=job)
        # a worker that vanished while pausing: paused at its last checkpoint, never requeued
        assert jobs.renew(session, job_id=lost, worker_id="w1", lease_seconds=-1) == "pausing"
        assert jobs.sweep(session) == []
        assert jobs.status_of(session, job_id=lost) == "paused"
        # nothing sends or claims a paused job
        due = jobs.due_sends(session, stale_before=now() + timedelta(days=1))
        assert not {held, lost} & {job_id for job_id, _, _ in due}
        assert not jobs.claim(session, job_id=lost, worker_id="w2", lease_seconds=60)
    assert states(client, finished)[-3:] == ["running", "pausing", "succeeded"]
    last = client.get(f"/api/jobs/{finished}/events").json()["data"][-1]
    assert "finished before the pause took effect" in last["message"]
    assert states(client, held)[-3:] == ["running", "pausing", "paused"]
    assert states(client, lost)[-2:] == ["pausing", "paused"]


@pytest.mark.slow
def test_pause_a_running_job_and_resume_it_to_the_same_weights(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from engine.config import TrainConfig
    from engine.training.run import train

    if worker_settings.redis_url is None:
        pytest.skip("pause does not depend on the broker: run once, with Redis")
    client = worker_client
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    steps = 200
    data = dataset(client)
    # paused as soon as a worker claims it (its training process may not handle the signal yet):
    # paused all the same, never failed
    early = start_job(client, data, hyper={"max_steps": steps}, checkpoint={"every_steps": 100})
    wait_for_job(client, early["id"], lambda j: j["status"] == "running", logs=workers)
    assert client.post(f"/api/jobs/{early['id']}/pause").status_code == 200
    early = wait_for_job(client, early["id"], {"paused", "succeeded"}, logs=workers)
    assert early["status"] == "paused", early
    assert client.delete(f"/api/jobs/{early['id']}").status_code == 204

    job = start_job(client, data, hyper={"max_steps": steps}, checkpoint={"every_steps": 100})
    wait_for_job(client, job["id"], lambda j: j["status"] == "running" and j["step"] >= 2, logs=workers)
    r = client.post(f"/api/jobs/{job['id']}/pause")
    assert r.status_code == 200 and r.json()["status"] == "pausing", r.text
    job = wait_for_job(client, job["id"], {"paused", "succeeded"}, logs=workers)
    assert job["status"] == "paused", "the job finished before the pause took effect"
    paused_at = job["step"]
    assert 2 <= paused_at < steps and job["finished_at"] is not None
    assert states(client, job["id"])[-3:] == ["running", "pausing", "paused"]
    # a checkpoint at the step it reached (checkpoints every 100 steps: none before)
    (saved,) = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
    assert saved["step"] == paused_at
    folder = Path(job["config"]["output_dir"])
    assert (folder / "checkpoints" / f"step_{paused_at:06d}" / "state").is_dir()
    refused(client, f"/api/jobs/{job['id']}/pause", "paused")

    r = client.post(f"/api/jobs/{job['id']}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    assert (job["step"], job["attempts"]) == (steps, 2)
    assert states(client, job["id"])[-5:] == ["pausing", "paused", "queued", "running", "succeeded"]
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    (resumed,) = [e for e in events if e["kind"] == "resume"]
    assert resumed["data"]["step"] == paused_at
    assert any("pause relayed" in e["message"] for e in events if e["kind"] == "log")
    refused(client, f"/api/jobs/{job['id']}/pause", "succeeded")

    # the same config trained without a pause ends with bitwise the same adapter
    reference = TrainConfig.model_validate(job["config"] | {"output_dir": str(tmp_path / "reference")})
    train(reference, models_dir=worker_settings.models_dir)
    name = f"step_{steps:06d}/adapter_model.safetensors"
    ours = load_file(folder / "checkpoints" / name)
    theirs = load_file(tmp_path / "reference" / "checkpoints" / name)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
