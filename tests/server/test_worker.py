"""A real Celery worker process running jobs end to end: success with downloads, cancel, and a
worker killed mid-job whose job resumes from its checkpoint with the same final weights."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.utils.jobs import start_job, states, wait_for_job

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 7}."},
            {"role": "assistant", "content": str(i % 7)},
        ]
    }
    for i in range(48)
]
TIMEOUT_S = 180
# a job killed once it reached step 5 runs this long: long enough that it cannot end first
KILL_STEPS = 120


def dataset(client: TestClient) -> str:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", content)})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def unpack(archive: bytes, into: Path) -> dict[str, str]:
    """Extract a download's one top folder as ``into``; returns its manifest after checking
    every listed sum."""
    staging = into.with_name(f"{into.name}.unpacked")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        every = tar.getnames()
        tar.extractall(staging, filter="data")
    (top,) = {n.split("/", 1)[0] for n in every}
    names = [n.split("/", 1)[1] for n in every if "/" in n and (staging / n).is_file()]
    (staging / top).rename(into)
    assert "MANIFEST.sha256" in names
    manifest = {}
    for line in (into / "MANIFEST.sha256").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((into / name).read_bytes()).hexdigest() == digest, name
        manifest[name] = digest
    assert sorted(manifest) == sorted(n for n in names if n != "MANIFEST.sha256")
    return manifest


def test_upload_train_download_and_replay(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client = worker_client
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, dataset(client), hyper={"max_steps": 4})
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=TIMEOUT_S, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    assert (job["step"], job["total_steps"], job["attempts"]) == (4, 4, 1)
    assert states(client, job["id"]) == ["validating", "queued", "running", "succeeded"]

    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # a training step's metrics carry the step; the host's device samples are telemetry events
    assert all(e["step"] is not None for e in events if e["kind"] == "metrics")
    assert all(e["step"] is None for e in events if e["kind"] == "telemetry")
    with client.stream("GET", f"/api/jobs/{job['id']}/stream", headers={"Last-Event-ID": "0"}) as r:
        text = "".join(r.iter_text())
    assert [int(x[4:]) for x in text.splitlines() if x.startswith("id: ")] == ids  # replay in order
    loss = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": ["loss/train"]}).json()["data"]
    assert [p["step"] for p in loss["loss/train"]] == [1, 2, 3, 4]

    listed = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
    assert [(c["step"], c["kind"]) for c in listed] == [(2, "adapter"), (4, "adapter")]
    assert "loss/train" in listed[-1]["metrics"]
    r = client.get(f"/api/jobs/{job['id']}/checkpoints/4/download")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    manifest = unpack(r.content, tmp_path / "adapter")
    assert "adapter_config.json" in manifest and not any(n.startswith("state/") for n in manifest)
    base_folder = worker_settings.models_dir / "tiny"
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    tuned = PeftModel.from_pretrained(base, tmp_path / "adapter")
    r = client.get(f"/api/jobs/{job['id']}/checkpoints/4/download", params={"merged": True})
    assert r.status_code == 200
    unpack(r.content, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids_in = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids_in).logits, tuned(ids_in).logits, atol=1e-5, rtol=1e-5)
    assert client.get(f"/api/jobs/{job['id']}/checkpoints/3/download").status_code == 404

    (host,) = client.get("/api/gpus").json()["data"]
    assert host["online"] and host["cpu"]["cores"] >= 1
    if not host["gpu"]:
        assert host["message"].startswith("no GPU on this host")


def test_cancel_a_running_job_leaves_a_resumable_checkpoint(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from engine.config import TrainConfig
    from engine.metrics import ListSink
    from engine.training.checkpoint_layout import latest
    from engine.training.run import train

    if worker_settings.redis_url is None:
        pytest.skip("covered with the folder transport by the first test; cancel needs no broker")
    client = worker_client
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, dataset(client), hyper={"max_steps": 400}, checkpoint={"every_steps": 1000})
    wait_for_job(
        client,
        job["id"],
        lambda j: j["status"] == "running" and j["step"] >= 2,
        timeout=TIMEOUT_S,
        logs=workers,
    )
    assert client.post(f"/api/jobs/{job['id']}/cancel").json()["status"] == "cancelling"
    job = wait_for_job(client, job["id"], {"cancelled", "succeeded"}, timeout=TIMEOUT_S, logs=workers)
    assert job["status"] == "cancelled" and 2 <= job["step"] < 400
    assert states(client, job["id"])[-2:] == ["cancelling", "cancelled"]
    (saved,) = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
    assert saved["step"] == job["step"]
    found = latest(Path(job["config"]["output_dir"]) / "checkpoints")
    assert found is not None and found[0] == job["step"] and (found[1] / "state" / "trainer.json").is_file()
    # resumable: the run continues from that checkpoint
    config = TrainConfig.model_validate(
        job["config"] | {"hyper": job["config"]["hyper"] | {"max_steps": job["step"] + 1}}
    )
    sink = ListSink()
    result = train(config, sink, models_dir=worker_settings.models_dir)
    assert result.status == "succeeded" and result.step == job["step"] + 1
    assert any(kind == "resume" for kind, _, _ in sink.events)


def test_a_killed_worker_s_job_is_requeued_and_resumes_to_the_same_weights(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from engine.config import TrainConfig
    from engine.training.run import train

    if worker_settings.redis_url is None:
        pytest.skip("the sweep and the claim do not depend on the broker; run once, with Redis")
    client = worker_client
    first = WorkerProcess(worker_settings, tmp_path / "worker-1.log").start()
    workers.append(first)
    job = start_job(client, dataset(client), hyper={"max_steps": KILL_STEPS}, checkpoint={"every_steps": 4})
    wait_for_job(client, job["id"], lambda j: j["step"] >= 6, timeout=TIMEOUT_S, logs=workers)
    first.kill()  # SIGKILL: no warm shutdown, no outcome recorded
    killed_at = client.get(f"/api/jobs/{job['id']}").json()["step"]
    assert killed_at < KILL_STEPS, "the job finished before the worker was killed"
    second = WorkerProcess(worker_settings, tmp_path / "worker-2.log").start()
    workers.append(second)
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=TIMEOUT_S, logs=workers)
    assert job["status"] == "succeeded", (job["error"], second.tail())
    assert job["attempts"] == 2
    assert states(client, job["id"]) == [
        "validating",
        "queued",
        "running",
        "interrupted",
        "running",
        "succeeded",
    ]
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    resumed = [e for e in events if e["kind"] == "resume"]
    assert len(resumed) == 1 and 4 <= resumed[0]["data"]["step"] <= killed_at

    # the same config trained without interruption ends with bitwise the same adapter
    reference = TrainConfig.model_validate(job["config"] | {"output_dir": str(tmp_path / "reference")})
    train(reference, models_dir=worker_settings.models_dir)
    name = f"step_{KILL_STEPS:06d}/adapter_model.safetensors"
    ours = load_file(Path(job["config"]["output_dir"]) / "checkpoints" / name)
    theirs = load_file(tmp_path / "reference" / "checkpoints" / name)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
def test_a_crashed_training_process_fails_its_job_and_the_worker_runs_the_next(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    import psutil

    if worker_settings.redis_url is None:
        pytest.skip("independent of the broker; run once, with Redis")
    client = worker_client
    # no restarts (tests/server/test_durability.py covers those)
    no_retries = worker_settings.model_copy(update={"max_retries": 0})
    worker = WorkerProcess(no_retries, tmp_path / "worker.log").start()
    workers.append(worker)
    ds = dataset(client)
    # a training process killed from outside (as the kernel's out-of-memory killer does)
    doomed = start_job(client, ds, hyper={"max_steps": 400}, checkpoint={"every_steps": 1000})
    wait_for_job(
        client,
        doomed["id"],
        lambda j: j["status"] == "running" and j["step"] >= 1,
        timeout=TIMEOUT_S,
        logs=workers,
    )
    assert worker.proc is not None
    (trainer,) = [
        p
        for p in psutil.Process(worker.proc.pid).children(recursive=True)
        if "server.worker.trainer" in p.cmdline()
    ]
    trainer.kill()
    doomed = wait_for_job(client, doomed["id"], {"failed", "succeeded"}, timeout=TIMEOUT_S, logs=workers)
    assert doomed["status"] == "failed" and "SIGKILL" in doomed["error"], doomed["error"]
    # an error inside the run is reported with its message
    broken = start_job(client, ds, data={"format": "text"})
    broken = wait_for_job(client, broken["id"], {"failed", "succeeded"}, timeout=TIMEOUT_S, logs=workers)
    assert broken["status"] == "failed" and "text" in broken["error"], broken["error"]
    # the worker survived both and runs the next job
    assert worker.proc.poll() is None
    fine = start_job(client, ds)
    fine = wait_for_job(client, fine["id"], {"failed", "succeeded"}, timeout=TIMEOUT_S, logs=workers)
    assert fine["status"] == "succeeded", fine["error"]
