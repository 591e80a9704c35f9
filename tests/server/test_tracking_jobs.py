"""A job's ``tracking`` section: stored as given, refused naming the field (an MLflow URI with
credentials, a query or no host, or a ``file:`` one outside the service's home, never repeating a
secret), mapped from /v1's W&B integrations, and a real worker's run writing TensorBoard and W&B
offline files with the job's and dataset's names, the credentials staying in the settings."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from engine.errors import ConfigError
from server.services.tracking import local_uri
from server.settings import Settings
from tests.engine.test_tracking import wandb_records
from tests.server.conftest import WorkerProcess
from tests.utils.jobs import job_body, start_job, wait_for_job

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


URI_FIELD = "tracking.mlflow.tracking_uri"


def refused(client: TestClient, path: str, dataset_id: str, uri: str) -> tuple[dict, str]:
    """POST a job body with this MLflow URI to ``path`` (checked: 422); its error and whole text."""
    r = client.post(path, json=job_body(dataset_id, tracking={"mlflow": {"tracking_uri": uri}}))
    assert r.status_code == 422, (uri, r.text)
    return dict(r.json()["error"]), r.text


def job_ids(client: TestClient) -> list[str]:
    return [j["id"] for j in client.get("/api/jobs", params={"limit": 200}).json()["data"]]


def test_a_file_tracking_uri_must_resolve_inside_the_services_home(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    ds = dataset(client)
    home = settings.home.resolve()
    (tmp_path / "outside").mkdir()
    (home / "link").symlink_to(tmp_path / "outside")
    for uri in ["file:/etc", "file:///etc", "file:../", "file:mlruns/../../x", "file:link/mlruns"]:
        error, _ = refused(client, "/api/jobs", ds["id"], uri)
        assert error["param"] == URI_FIELD and "inside the service's home" in error["message"], error
    assert job_ids(client) == []

    for uri in [f"file:{home / 'mlruns'}", (home / "mlruns").as_uri(), "file:mlruns"]:
        job = start_job(client, ds["id"], tracking={"mlflow": {"tracking_uri": uri}})
        assert job["config"]["tracking"]["mlflow"]["tracking_uri"] == uri
        client.post(f"/api/jobs/{job['id']}/cancel")

    # a sweep is refused before it is stored
    sweep = {
        "job": job_body(ds["id"], tracking={"mlflow": {"tracking_uri": "file:/etc"}}),
        "parameters": {"learning_rate": [0.01, 0.1]},
    }
    r = client.post("/api/sweeps", json=sweep)
    assert r.status_code == 422 and r.json()["error"]["param"] == f"job.{URI_FIELD}", r.text
    assert client.get("/api/sweeps").json()["data"] == []


def test_tracking_uris_with_secrets_hostless_or_of_other_schemes_are_refused_unrepeated(
    client: TestClient,
) -> None:
    ds = dataset(client)
    for uri, secret in [
        ("http://mlflow.local:5000/?token=tok-s3cr3t", "tok-s3cr3t"),
        ("https://mlflow.local/#tok-s3cr3t", "tok-s3cr3t"),
        ("http://user:pw-s3cr3t@mlflow.local:5000", "pw-s3cr3t"),
        ("ftp://mlflow.local", None),
        ("https://", None),
        ("https:///path", None),
        ("file://other-host/srv", None),
    ]:
        error, text = refused(client, "/api/jobs", ds["id"], uri)
        assert error["param"] == URI_FIELD, text
        if secret is not None:
            assert secret not in text, text
            error, text = refused(client, "/api/plan", ds["id"], uri)
            assert error["param"] == URI_FIELD and secret not in text, text
    assert job_ids(client) == []


def test_a_worker_logs_to_a_relative_file_uri_in_its_home_and_refuses_one_outside(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert local_uri("file:mlruns", home=home) == (home / "mlruns").resolve().as_uri()
    assert local_uri("http://mlflow.local:5000", home=home) == "http://mlflow.local:5000"
    with pytest.raises(ConfigError) as err:  # a job stored before the rule
        local_uri("file:/etc", home=home)
    assert err.value.field == URI_FIELD


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
