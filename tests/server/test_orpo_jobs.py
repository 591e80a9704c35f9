"""ORPO jobs and the method listing: ``GET /api/methods`` from the engine's registry; ORPO through
``POST /api/jobs`` in either form of ``method`` (only on preference data), through ``/v1`` as our
extension ``method.type: "orpo"``, and one ORPO job run by a real worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.methods import METHODS
from server.settings import Settings
from server.tables import Dataset
from tests.server.conftest import WorkerProcess
from tests.server.test_dpo_jobs import post_job, preference_dataset, refused
from tests.server.test_job_manage import upload
from tests.utils.jobs import start_job, wait_for_job


def test_the_method_listing_is_the_engines_registry(client: TestClient) -> None:
    r = client.get("/api/methods")
    assert r.status_code == 200, r.text
    listed = {m["name"]: m for m in r.json()["data"]}
    assert list(listed) == list(METHODS) == ["sft", "dpo", "orpo", "kto", "grpo"]
    assert listed["orpo"]["data_format"] == "preference" and listed["orpo"]["needs_reference"] is False
    assert listed["dpo"]["needs_reference"] is True and listed["sft"]["data_format"] == "supervised"
    assert listed["orpo"]["sequences_per_example"] == 2 and "beta" in listed["orpo"]["config_fields"]
    assert "orpo/log_odds_ratio" in listed["orpo"]["metric_keys"]
    assert client.get("/api/methods", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_an_orpo_job_takes_its_method_in_both_forms(client: TestClient) -> None:
    pairs = preference_dataset(client)
    r = post_job(client, pairs, {"objective": "orpo", "tuning": "full", "beta": 0.3})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    # stored as its method's options (engine.methods.orpo): the earlier one-word form is read only
    assert (method["objective"], method["tuning"], method["beta"]) == ("orpo", "full", 0.3)
    assert {"kind", "dpo_tuning", "group_size", "grader"}.isdisjoint(method)
    r = post_job(client, pairs, {"kind": "orpo"})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    assert (method["objective"], method["tuning"], method["beta"]) == ("orpo", "lora", 0.1)
    # the two forms must agree
    refused(post_job(client, pairs, {"kind": "dpo", "objective": "orpo"}), "method.kind", "contradicts")


def test_orpo_needs_preference_data(client: TestClient) -> None:
    chat = upload(client, name="chat-set")
    refused(
        post_job(client, chat, {"objective": "orpo"}),
        "dataset_id",
        "chat-set",
        "ORPO needs rows with a preferred",
    )


def test_v1_takes_orpo_as_our_extension(client: TestClient) -> None:
    pairs = preference_dataset(client)
    body = {
        "model": "tiny",
        "training_file": f"file-{pairs}",
        "method": {"type": "orpo", "orpo": {"hyperparameters": {"beta": 0.25, "n_epochs": 1}}},
        "roundhouse": {"hyper": {"max_steps": 2}},
    }
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"]["type"] == "orpo", job["method"]
    assert job["method"]["orpo"]["hyperparameters"]["beta"] == 0.25
    ours = client.get(f"/api/jobs/{job['roundhouse']['job_id']}").json()["config"]["method"]
    assert (ours["objective"], ours["beta"]) == ("orpo", 0.25)
    body["roundhouse"] = {"method": {"kind": "dpo"}}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "roundhouse.method.kind", r.json()


def test_an_orpo_job_runs_on_a_worker_and_logs_its_metrics(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    if worker_settings.redis_url is None:
        pytest.skip("independent of the broker; run once, with Redis")
    client = worker_client
    pairs = preference_dataset(client)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        assert session.get(Dataset, pairs).format == "preference"
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, pairs, hyper={"max_steps": 4}, method={"kind": "orpo", "lora_r": 4, "beta": 0.2})
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    keys = ["orpo/log_odds_ratio", "orpo/reward_accuracy", "orpo/nll", "loss/train"]
    series = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": keys}).json()["data"]
    assert [p["step"] for p in series["orpo/log_odds_ratio"]] == [1, 2, 3, 4], series
    assert all(0 <= p["value"] <= 1 for p in series["orpo/reward_accuracy"]), series
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert not [e for e in events if e["kind"] == "reference"]  # reference-free
