"""KTO through the service: listed by ``GET /api/methods`` with its options' schema and charts, a
job on unpaired rows through ``POST /api/jobs`` (other data refused, naming the dataset), through
``/v1`` as our extension ``method.type: "kto"``, in the API schema, and one KTO job run by a real
worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.server.test_dpo_jobs import post_job, preference_dataset, refused
from tests.utils.jobs import start_job, wait_for_job

ROWS = [
    {"prompt": f"what is {a} plus {b}?", "completion": str(a + b + (a + b) % 2), "label": (a + b) % 2 == 0}
    for a in range(4)
    for b in range(4)
]


def kto_dataset(client: TestClient, name: str = "kto-rows") -> str:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", content)}, data={"name": name})
    assert r.status_code == 201 and r.json()["format"] == "kto", r.text
    return str(r.json()["id"])


def test_kto_is_listed_with_its_options_and_charts(client: TestClient) -> None:
    listed = {m["name"]: m for m in client.get("/api/methods").json()["data"]}
    kto = listed["kto"]
    assert kto["data_format"] == "unpaired" and kto["needs_reference"] is True
    props = kto["options_schema"]["properties"]
    assert props["beta"]["exclusiveMinimum"] == 0 and props["beta"]["default"] == 0.1
    assert {"desirable_weight", "undesirable_weight"} <= set(kto["config_fields"])
    assert "group_size" not in props and "grader" not in props  # GRPO's, not KTO's
    assert {c["id"] for c in kto["charts"]} == {"reward-margin-chart", "kto-kl-chart"}
    assert all(key in kto["metric_keys"] for c in kto["charts"] for _, key in c["lines"])


def test_a_kto_job_takes_unpaired_rows_only(client: TestClient) -> None:
    rows = kto_dataset(client)
    r = post_job(client, rows, {"objective": "kto", "tuning": "full", "desirable_weight": 1.33})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    assert (method["objective"], method["tuning"], method["beta"], method["desirable_weight"]) == (
        "kto",
        "full",
        0.1,
        1.33,
    )
    refused(post_job(client, rows, {"objective": "kto", "beta": 0}), "method.beta", "greater than 0")
    refused(post_job(client, rows, {"objective": "kto", "group_size": 4}), "method.group_size", "Extra")
    pairs = preference_dataset(client)
    refused(post_job(client, pairs, {"objective": "kto"}), "dataset_id", "KTO needs unpaired rows")
    refused(post_job(client, rows, {"objective": "dpo"}), "dataset_id", "DPO needs rows with a preferred")
    refused(post_job(client, rows, {"tuning": "lora"}), "dataset_id", "is a unpaired dataset")


def test_the_api_schema_shows_each_methods_fields(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    method = schema["components"]["schemas"]["JobCreate"]["properties"]["method"]
    choices = {c["properties"]["objective"]["const"]: c["properties"] for c in method["oneOf"]}
    assert set(choices) == {"sft", "dpo", "orpo", "kto", "grpo"}
    assert "desirable_weight" in choices["kto"] and "beta" not in choices["sft"]
    assert choices["grpo"]["temperature"]["exclusiveMinimum"] == 0  # the engine's bound, not a copy
    v1 = schema["components"]["schemas"]["Method"]["properties"]
    assert "kto" in v1 and "kto" in v1["type"]["enum"]


def test_v1_takes_kto_as_our_extension(client: TestClient) -> None:
    rows = kto_dataset(client)
    body = {
        "model": "tiny",
        "training_file": f"file-{rows}",
        "method": {"type": "kto", "kto": {"hyperparameters": {"beta": 0.25}}},
        "roundhouse": {"hyper": {"max_steps": 2}, "method": {"undesirable_weight": 2.0}},
    }
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"]["type"] == "kto" and job["method"]["kto"]["hyperparameters"]["beta"] == 0.25
    ours = client.get(f"/api/jobs/{job['roundhouse']['job_id']}").json()["config"]["method"]
    assert (ours["objective"], ours["beta"], ours["undesirable_weight"]) == ("kto", 0.25, 2.0)
    body["method"] = {"type": "kto", "kto": {"hyperparameters": {"beta": -1}}}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 400 and "beta" in r.json()["error"]["param"], r.text


def test_a_kto_job_runs_on_a_worker_and_logs_its_metrics(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    if worker_settings.redis_url is None:
        pytest.skip("independent of the broker; run once, with Redis")
    client = worker_client
    rows = kto_dataset(client)
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    job = start_job(client, rows, hyper={"max_steps": 3}, method={"kind": "kto", "lora_r": 4, "beta": 0.2})
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", (job["error"], workers[0].tail())
    keys = ["kto/kl", "kto/desirable", "kto/undesirable", "loss/train"]
    series = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": keys}).json()["data"]
    assert [p["step"] for p in series["kto/kl"]] == [1, 2, 3], series
    assert all(p["value"] >= 0 for p in series["kto/kl"]), series
    events = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert [e for e in events if e["kind"] == "reference"]
