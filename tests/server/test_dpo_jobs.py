"""DPO jobs through ``POST /api/jobs``: ``method.kind: "dpo"`` with its beta and tuning, only on a
preference dataset, and a supervised job never on one (422 naming the field), on a real SQLite file
(and PostgreSQL); and one DPO job run by a real worker, its rewards logged and kept with its
checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from server.settings import Settings
from server.tables import Dataset
from tests.server.conftest import WorkerProcess
from tests.server.test_job_manage import upload
from tests.utils.jobs import start_job, wait_for_job

PAIRS = [{"prompt": f"Say {i}.", "chosen": str(i), "rejected": f"I will not say {i}."} for i in range(12)]


def preference_dataset(client: TestClient, name: str = "pairs") -> str:
    """A dataset the service records as preference pairs. Uploaded as such where the data reader
    takes them; else a chat file whose row says preference (what this test is about is the row)."""
    content = "".join(json.dumps(r) + "\n" for r in PAIRS).encode()
    r = client.post("/api/datasets", files={"file": ("pairs.jsonl", content)}, data={"name": name})
    if r.status_code == 201 and r.json()["format"] == "preference":
        return str(r.json()["id"])
    ident = upload(client, name=name)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        session.execute(update(Dataset).where(Dataset.id == ident).values(format="preference"))
        session.commit()
    return ident


def post_job(client: TestClient, dataset_id: str, method: dict[str, Any], **extra: Any) -> Any:
    body = {
        "base_model": "tiny",
        "dataset_id": dataset_id,
        "method": method,
        "hyper": {"max_steps": 2, "batch_size": 4},
    }
    return client.post("/api/jobs", json=body | extra)


def refused(r: Any, param: str, *words: str) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_config" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_a_dpo_job_on_preference_pairs_keeps_its_method(client: TestClient) -> None:
    pairs = preference_dataset(client)
    r = post_job(client, pairs, {"kind": "dpo"})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    assert (method["objective"], method["beta"], method["tuning"]) == ("dpo", 0.1, "lora")

    r = post_job(client, pairs, {"kind": "dpo", "dpo_tuning": "full", "beta": 0.5})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    assert (method["objective"], method["beta"], method["tuning"]) == ("dpo", 0.5, "full")
    # a preference validation set, and the format named explicitly, are fine too
    r = post_job(client, pairs, {"kind": "dpo"}, validation_dataset_id=pairs, data={"format": "preference"})
    assert r.status_code == 201, r.text


def test_dpo_needs_preference_data_and_supervised_methods_refuse_it(client: TestClient) -> None:
    pairs, chat = preference_dataset(client), upload(client, name="chat-set")
    refused(post_job(client, chat, {"kind": "dpo"}), "dataset_id", "chat-set", "not a preference dataset")
    for kind in ("lora", "full"):
        refused(post_job(client, pairs, {"kind": kind}), "dataset_id", "pairs", "is a preference dataset")
    refused(
        post_job(client, pairs, {"kind": "dpo"}, validation_dataset_id=chat),
        "validation_dataset_id",
        "chat-set",
    )
    refused(
        post_job(client, pairs, {"kind": "lora"}, validation_dataset_id=chat),
        "dataset_id",
    )
    refused(post_job(client, pairs, {"kind": "dpo"}, data={"format": "chat"}), "data.format", "'dpo'")
    refused(post_job(client, chat, {"kind": "lora"}, data={"format": "preference"}), "data.format")
    # the method's own fields are checked by the engine's TrainConfig, named as they are there
    r = post_job(client, pairs, {"kind": "dpo", "beta": 0})
    assert r.status_code == 422 and r.json()["error"]["param"] == "method.beta", r.text
    r = post_job(client, pairs, {"kind": "dpo", "dpo_tuning": "qlora"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "method.dpo_tuning", r.text
    assert client.get("/api/jobs").json()["data"] == []  # nothing was stored


def test_a_dpo_job_runs_on_a_worker_and_logs_its_rewards(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    if worker_settings.redis_url is None:
        pytest.skip("independent of the broker; run once, with Redis")
    client = worker_client
    pairs = preference_dataset(client)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        kind = session.get(Dataset, pairs).format
    if kind != "preference":
        pytest.skip("the data reader does not take preference rows: nothing a worker could train")
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, pairs, hyper={"max_steps": 4}, method={"kind": "dpo", "lora_r": 4, "beta": 0.2})
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    keys = ["dpo/reward_margin", "dpo/reward_accuracy", "loss/train"]
    series = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": keys}).json()["data"]
    assert [p["step"] for p in series["dpo/reward_margin"]] == [1, 2, 3, 4], series
    assert all(0 <= p["value"] <= 1 for p in series["dpo/reward_accuracy"]), series
    saved = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
    assert [(c["step"], c["kind"]) for c in saved] == [(2, "adapter"), (4, "adapter")]
    assert "dpo/reward_margin" in saved[-1]["metrics"], saved[-1]
