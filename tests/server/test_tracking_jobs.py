"""A job's ``tracking`` section: stored as given, refused naming the field, mapped from /v1's W&B
integrations, and a real worker's run writing TensorBoard and W&B offline files with the job's
and dataset's names, the credentials staying in the settings."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from server.settings import Settings
from tests.engine.test_tracking import wandb_records
from tests.server.conftest import WorkerProcess
from tests.utils.jobs import start_job, wait_for_job

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 5}."},
            {"role": "assistant", "content": str(i % 5)},
        ]
    }
    for i in range(24)
]


def dataset(client: TestClient) -> dict:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", content)})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_tracking_is_stored_and_bad_sections_are_refused_by_field(client: TestClient) -> None:
    ds = dataset(client)
    tracking = {"tensorboard": True, "mlflow": {"tracking_uri": "http://127.0.0.1:5000", "experiment": "e"}}
    job = start_job(client, ds["id"], tracking=tracking)
    assert job["config"]["tracking"]["tensorboard"] is True
    assert job["config"]["tracking"]["mlflow"]["experiment"] == "e"
    client.post(f"/api/jobs/{job['id']}/cancel")

    for bad, field in [
        ({"mlflow": {"tracking_uri": "http://u:p@host:5000"}}, "tracking.mlflow.tracking_uri"),
        ({"wandb": {"project": "p", "mode": "sometimes"}}, "tracking.wandb.mode"),
        ({"wandb": {"project": "p", "api_key": "x"}}, "tracking.wandb.api_key"),
        ({"comet": {}}, "tracking.comet"),
    ]:
        r = client.post("/api/jobs", json={"base_model": "tiny", "dataset_id": ds["id"], "tracking": bad})
        assert r.status_code in (400, 422), r.text
        assert r.json()["error"]["param"] == field, r.text


def test_v1_maps_wandb_integrations_and_refuses_others(client: TestClient) -> None:
    ds = dataset(client)
    body = {
        "model": "tiny",
        "training_file": f"file-{ds['id']}",
        "integrations": [{"type": "wandb", "wandb": {"project": "rh", "name": "run-1", "tags": ["a"]}}],
        "roundhouse": {"engine": {"devices": ["cpu"], "num_microbatches": 1}},
    }
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    shown = r.json()
    assert shown["integrations"] == [
        {"type": "wandb", "wandb": {"project": "rh", "name": "run-1", "entity": None, "tags": ["a"]}}
    ]
    job = client.get(f"/api/jobs/{shown['roundhouse']['job_id']}").json()
    assert job["config"]["tracking"]["wandb"] == {
        "project": "rh",
        "name": "run-1",
        "tags": ["a"],
        "mode": "online",
    } | {"entity": None}
    client.post(f"/api/jobs/{job['id']}/cancel")
    for integrations, param in [
        ([{"type": "comet", "comet": {}}], "integrations[0]"),
        ([{"type": "wandb", "wandb": {"name": "x"}}], "integrations[0].wandb.project"),
        ([{"type": "wandb", "wandb": {"project": "p", "api_key": "k"}}], "integrations[0].wandb.api_key"),
    ]:
        r = client.post("/v1/fine_tuning/jobs", json=body | {"integrations": integrations})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
@pytest.mark.parametrize("worker_settings", ["filesystem"], indirect=True)
def test_a_worker_run_writes_tensorboard_and_wandb_files_without_the_key(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = worker_settings.model_copy(update={"wandb_api_key": SecretStr("wk-secret-123")})
    client = worker_client
    workers.append(WorkerProcess(settings, tmp_path / "worker.log").start())
    ds = dataset(client)
    tracking = {"tensorboard": True, "wandb": {"project": "rh", "mode": "offline"}}
    job = start_job(client, ds["id"], name="tracked job", tracking=tracking, hyper={"max_steps": 3})
    job = wait_for_job(client, job["id"], {"succeeded"}, logs=workers)
    folder = worker_settings.home / job_folder(job)
    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2, 3]
    (run_file,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(Path(run_file))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.display_name == "tracked job" and config["dataset"] == ds["name"]
    assert config["dataset_sha256"] == ds["sha256"]
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).text
    assert "wk-secret-123" not in events and "wk-secret-123" not in json.dumps(job)
    assert "wk-secret-123" not in Path(run_file).read_bytes().decode("latin-1")


def job_folder(job: dict) -> str:
    return f"runs/{job['id']}"


def test_tensorboard_files_go_to_a_store_on_another_host(tmp_path: Path) -> None:
    from engine.config import TrainConfig
    from server.storage import LocalStorage
    from server.worker.tracking import keep_tensorboard

    store = LocalStorage(tmp_path / "store")
    folder = tmp_path / "cache" / "runs" / "j1"
    (folder / "tensorboard").mkdir(parents=True)
    (folder / "tensorboard" / "events.out.tfevents.1").write_bytes(b"event")
    config = TrainConfig.parse({"data": {"train": "x.jsonl"}, "tracking": {"tensorboard": True}})
    keep_tensorboard(store, config, output_dir="runs/j1", folder=folder)
    assert (
        tmp_path / "store" / "runs" / "j1" / "tensorboard" / "events.out.tfevents.1"
    ).read_bytes() == b"event"
    off = TrainConfig.parse({"data": {"train": "x.jsonl"}})
    keep_tensorboard(store, off, output_dir="runs/j2", folder=folder)
    assert not (tmp_path / "store" / "runs" / "j2").exists()
