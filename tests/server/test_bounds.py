"""Hostile input at the API's edges, on SQLite and PostgreSQL: numbers beyond a column's range,
control characters (NUL above all) in ids, names and parameters, hardware numbers that would make
the planner divide by zero. Each gets a 4xx in the one error shape naming the field; nothing is
stored."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.server.test_api import CHAT, jsonl, upload
from tests.utils.jobs import job_body, start_job

BIG = [2**31, 2**63, 2**64]


def refused(r: Any, param: str, status: int = 422) -> dict[str, Any]:
    assert r.status_code == status, (param, r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    return dict(error)


def job_count(client: TestClient) -> int:
    return len(client.get("/api/jobs", params={"limit": 200}).json()["data"])


@pytest.fixture
def ids(client: TestClient) -> dict[str, str]:
    dataset = upload(client, jsonl(CHAT)).json()["id"]
    job = start_job(client, dataset)["id"]
    assert client.post(f"/api/jobs/{job}/cancel").status_code == 200  # final: its stream ends
    return {"dataset": dataset, "job": job}


def test_numbers_beyond_a_columns_range_are_refused(client: TestClient, ids: dict[str, str]) -> None:
    job = ids["job"]
    for n in BIG:
        refused(client.get(f"/api/jobs/{job}/events", params={"after": n}), "after")
        refused(client.get(f"/api/jobs/{job}/stream", params={"after": n}), "after")
        refused(client.get(f"/api/jobs/{job}/checkpoints/{n}/download"), "step")
    refused(client.get(f"/api/jobs/{job}/checkpoints/-1/download"), "step")
    # the largest event id and step an INTEGER column holds are fine: nothing there
    assert client.get(f"/api/jobs/{job}/events", params={"after": 2**31 - 1}).json()["data"] == []
    assert client.get(f"/api/jobs/{job}/checkpoints/{2**31 - 1}/download").status_code == 404
    # a Last-Event-ID no event could have had is ignored: the stream replays from ``after``
    whole = client.get(f"/api/jobs/{job}/stream").text
    for garbled in (str(2**64), "9" * 5000, "-1", "1.5", "\xb2".encode("latin-1")):
        r = client.get(f"/api/jobs/{job}/stream", headers={"Last-Event-ID": garbled})  # type: ignore[dict-item]
        assert r.status_code == 200 and r.text == whole, garbled
    # TrainConfig bounds: steps and seeds the worker and the database can hold
    before = job_count(client)
    section: dict[str, dict[str, Any]] = {
        "hyper.max_steps": {"hyper": {"max_steps": 2**31, "batch_size": 4}},
        "hyper.warmup_steps": {"hyper": {"max_steps": 2, "batch_size": 4, "warmup_steps": 2**31}},
        "hyper.seed": {"hyper": {"max_steps": 2, "batch_size": 4, "seed": 2**64}},
        "checkpoint.every_steps": {"checkpoint": {"every_steps": 2**31}},
        "checkpoint.keep_last": {"checkpoint": {"keep_last": 2**63}},
        "eval.every_steps": {"eval": {"every_steps": 2**63}},
        "engine.num_microbatches": {"engine": {"num_microbatches": 2**63}},
        "data.max_length": {"data": {"max_length": 2**63}},
    }
    for param, extra in section.items():
        body = {"base_model": "tiny", "dataset_id": ids["dataset"], **extra}
        refused(client.post("/api/jobs", json=body), param)
        refused(client.post("/api/plan", json=body), param)
    assert job_count(client) == before
    body = {
        "base_model": "tiny",
        "dataset_id": ids["dataset"],
        "hyper": {"max_steps": 2**31 - 1, "seed": 2**32 - 1},
    }
    assert client.post("/api/jobs", json=body).status_code == 201


def test_control_characters_in_ids_names_and_parameters_are_refused(
    client: TestClient, ids: dict[str, str]
) -> None:
    job, dataset = ids["job"], ids["dataset"]
    before = job_count(client)
    for bad in ("a\x00b", "\x00", "tab\there", "line\nbreak", "\x7f"):
        quoted = bad.replace("\x00", "%00").replace("\t", "%09").replace("\n", "%0A").replace("\x7f", "%7F")
        # path parameters, every route that has one
        for path in (
            f"/api/jobs/{quoted}",
            f"/api/jobs/{quoted}/events",
            f"/api/jobs/{quoted}/stream",
            f"/api/jobs/{quoted}/metrics",
            f"/api/jobs/{quoted}/checkpoints",
            f"/api/jobs/{quoted}/checkpoints/1/download",
            f"/api/datasets/{quoted}",
            f"/api/datasets/{quoted}/preview",
        ):
            refused(client.get(path), "job_id" if "/jobs/" in path else "dataset_id")
        refused(client.post(f"/api/jobs/{quoted}/cancel"), "job_id")
        refused(client.delete(f"/api/datasets/{quoted}"), "dataset_id")
        # query parameters, declared or not (the key of an EventSource comes as ?token=)
        refused(client.get(f"/api/datasets/{dataset}/preview", params={"model": bad}), "model")
        refused(client.get(f"/api/datasets/{dataset}/stats", params={"model": bad}), "model")
        refused(client.get(f"/api/jobs/{job}/metrics", params={"keys": ["loss/train", bad]}), "keys")
        refused(client.get("/api/jobs", params={"status": bad}), "status")
        refused(client.get("/api/gpus/stream", params={"token": bad}), "token")
        refused(client.get("/api/health", params={"anything": bad}), "anything")
        # request bodies: names and ids
        for field in ("name", "base_model", "dataset_id", "validation_dataset_id"):
            error = refused(client.post("/api/jobs", json=job_body(dataset) | {field: bad}), field)
            assert "control character" in error["message"]
        for field in ("base_model", "dataset_id", "calibrate_job_id", "name"):
            refused(client.post("/api/plan", json={field: bad}), field)
    # a cursor whose id decodes to a NUL, or whose time overflows when made UTC
    for raw in (b"2024-01-01T00:00:00+00:00|a\x00b", b"9999-12-31T23:59:59-23:00|ab"):
        cursor = base64.urlsafe_b64encode(raw).decode()
        refused(client.get("/api/jobs", params={"cursor": cursor}), "cursor")
    assert job_count(client) == before
    assert client.get("/api/jobs", params={"status": "queued"}).status_code == 200


def test_non_finite_numbers_in_a_section_are_refused(client: TestClient, ids: dict[str, str]) -> None:
    # Python's JSON parser takes Infinity and NaN; no database JSON column does
    before = job_count(client)
    for token in (b"Infinity", b"-Infinity", b"NaN"):
        for section in (b'"engine": {"partition": {"x": %s}}', b'"hyper": {"learning_rate": %s}'):
            content = b'{"base_model": "tiny", "dataset_id": "%s", %s}' % (
                ids["dataset"].encode(),
                section % token,
            )
            r = client.post("/api/jobs", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 422 and "finite" in r.json()["error"]["message"], r.text
    assert job_count(client) == before


def test_plan_refuses_hardware_outside_realistic_ranges(client: TestClient) -> None:
    for field, value in (
        ("gpu_memory_gb", 1e-300),
        ("gpu_memory_gb", 5e-324),
        ("gpu_memory_gb", 0.5),
        ("gpu_memory_gb", 1e300),
        ("gpu_tflops", 5e-324),
        ("gpu_tflops", 1e300),
        ("efficiency", 5e-324),
        ("efficiency", 1e-9),
        ("link_gb_s", 1e-300),
        ("link_gb_s", 1e300),
        ("host_ram_gb", 1e-300),
        ("num_gpus", 0),
        ("num_gpus", 2**63),
    ):
        refused(client.post("/api/plan", json={"hardware": {field: value}}), f"hardware.{field}")
    # together, the tiny ones once divided by zero
    tiny = {"gpu_memory_gb": 5e-324, "gpu_tflops": 5e-324, "efficiency": 5e-324}
    assert client.post("/api/plan", json={"hardware": tiny}).status_code == 422


def test_plan_answers_at_the_ends_of_each_hardware_range(client: TestClient) -> None:
    from engine.planner import HARDWARE_RANGES

    for end in (0, 1):
        hardware = {name: bounds[end] for name, bounds in HARDWARE_RANGES.items()}
        r = client.post("/api/plan", json={"hardware": hardware})
        assert r.status_code == 200, r.text
        plan = r.json()
        assert plan["tokens_per_s"] >= 0 and plan["iteration_s"] >= 0
    # the ranges are in the schema, where a client reads them
    schema = client.get("/openapi.json").json()["components"]["schemas"]["HardwareSpec"]["properties"]
    memory = schema["gpu_memory_gb"]["anyOf"][0]
    assert (memory["minimum"], memory["maximum"]) == HARDWARE_RANGES["gpu_memory_gb"]


def test_plan_refuses_a_config_json_it_cannot_plan(client: TestClient) -> None:
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    base |= {"vocab_size": 256}
    for config, param in (
        (base | {"hidden_size": 10**400}, "config.hidden_size"),
        (base | {"num_hidden_layers": 100_000}, "config.num_hidden_layers"),
        (base | {"head_dim": "x"}, "config.head_dim"),
        (base | {"num_key_value_heads": 0}, "config.num_key_value_heads"),
        (base | {"num_attention_heads": 65}, "config.num_attention_heads"),  # head_dim 64 // 65 = 0
        ({"text_config": "x"}, "config.text_config"),
    ):
        refused(client.post("/api/plan", json={"config": config}), param)
    assert client.post("/api/plan", json={"config": base}).status_code == 200
