"""GRPO jobs in the service: the method listed, prompts datasets only (and only for it), the grader
checked when the job is created (422 naming the field), OpenAI's ``method.type: "reinforcement"``
through ``/v1`` (a 400 naming the grader's field or the file), and the ``samples`` event kind."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from engine.methods.grpo import train as grpo
from server.kinds import EventKind
from tests.server.test_dpo_jobs import post_job, refused
from tests.server.test_job_manage import upload

PROMPTS = [
    {"messages": [{"role": "user", "content": f"What is {n} + {n}?"}], "reference_answer": str(2 * n)}
    for n in range(8)
]
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
    "operation": "eq",
}
GRPO = {"objective": "grpo", "grader": GRADER, "group_size": 4, "max_completion_tokens": 16}


def prompts_dataset(client: TestClient, name: str = "prompts") -> str:
    content = "".join(json.dumps(r) + "\n" for r in PROMPTS).encode()
    r = client.post("/api/datasets", files={"file": ("prompts.jsonl", content)}, data={"name": name})
    assert r.status_code == 201 and r.json()["format"] == "prompts", r.text
    return str(r.json()["id"])


def v1_file(client: TestClient, rows: list[dict[str, Any]], name: str) -> str:
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_grpo_is_listed_with_its_settings_and_metrics(client: TestClient) -> None:
    listed = {m["name"]: m for m in client.get("/api/methods").json()["data"]}
    entry = listed["grpo"]
    assert entry["data_format"] == "prompts" and entry["needs_reference"] is False
    assert {"grader", "group_size", "max_completion_tokens", "temperature", "beta", "loss_type"} <= set(
        entry["config_fields"]
    )
    assert {"reward/mean", "grpo/kl", "completion/length"} <= set(entry["metric_keys"])


def test_a_grpo_job_trains_on_prompts_with_a_valid_grader(client: TestClient) -> None:
    prompts, chat = prompts_dataset(client), upload(client, name="chat-set")
    r = post_job(client, prompts, GRPO, validation_dataset_id=prompts, data={"format": "prompts"})
    assert r.status_code == 201, r.text
    method = r.json()["config"]["method"]
    assert (method["objective"], method["group_size"]) == ("grpo", 4) and "kind" not in method
    assert method["grader"] == GRADER
    listed = client.get("/api/jobs").json()["data"]
    assert [j["config"]["method"]["objective"] for j in listed if j["id"] == r.json()["id"]] == ["grpo"]
    # only prompts: a chat dataset (or data.format) is refused naming the field and the format
    refused(post_job(client, chat, GRPO), "dataset_id", "chat-set", "(chat) is not a prompts dataset")
    refused(post_job(client, prompts, GRPO, validation_dataset_id=chat), "validation_dataset_id", "chat-set")
    refused(post_job(client, prompts, GRPO, data={"format": "chat"}), "data.format", "it takes prompts")
    # and prompts are GRPO's alone
    refused(
        post_job(client, prompts, {"kind": "lora"}),
        "dataset_id",
        "(prompts) is a prompts dataset: it trains with method.kind 'grpo', not 'lora'",
    )
    refused(post_job(client, prompts, {"kind": "dpo"}), "dataset_id", "is not a preference dataset")
    # the grader is checked when the job is created, its field named
    bad = GRPO | {"grader": GRADER | {"operation": "equals"}}
    refused(post_job(client, prompts, bad), "method.grader.operation", "equals")
    refused(post_job(client, prompts, {"objective": "grpo"}), "method.grader", "needs a grader")


def test_v1_reinforcement_is_a_grpo_job_with_its_grader(client: TestClient) -> None:
    prompts = v1_file(client, PROMPTS, "prompts.jsonl")
    body: dict[str, Any] = {
        "model": "tiny",
        "training_file": prompts,
        "method": {
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 4,
                    "eval_interval": 3,
                    "reasoning_effort": "low",
                },
            },
        },
        "roundhouse": {"method": {"group_size": 2, "max_completion_tokens": 8}, "data": {"max_length": 128}},
    }
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"]["type"] == "reinforcement" and job["method"]["reinforcement"]["grader"] == GRADER
    shown = job["method"]["reinforcement"]["hyperparameters"]
    assert (shown["n_epochs"], shown["batch_size"], shown["eval_interval"], shown["group_size"]) == (
        2,
        4,
        3,
        2,
    )
    config = client.get(f"/api/jobs/{job['roundhouse']['job_id']}").json()["config"]
    assert (config["method"]["objective"], config["method"]["max_completion_tokens"]) == ("grpo", 8)
    assert config["eval"]["every_steps"] == 3 and config["hyper"]["epochs"] == 2
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"] == job["method"]

    def refused_v1(changed: dict[str, Any], param: str, *words: str) -> None:
        r = client.post("/v1/fine_tuning/jobs", json=body | changed)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        for word in words:
            assert word in error["message"], error

    # a bad grader: named as the request gave it
    bad = {"type": "reinforcement", "reinforcement": {"grader": GRADER | {"operation": "equals"}}}
    refused_v1({"method": bad}, "method.reinforcement.grader.operation", "equals")
    nested = {"type": "multi", "graders": {"a": GRADER | {"operation": "nope"}}, "calculate_output": "a"}
    refused_v1(
        {"method": {"type": "reinforcement", "reinforcement": {"grader": nested}}},
        "method.reinforcement.grader.graders.a.operation",
    )
    refused_v1({"method": {"type": "reinforcement"}}, "method.reinforcement.grader", "needs a grader")
    # a supervised file: named as the file
    chat = v1_file(client, [{"prompt": "q", "completion": "a"}] * 4, "chat.jsonl")
    refused_v1({"training_file": chat}, "training_file", "is not a prompts dataset")
    # a prompts file is no supervised data either
    supervised = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": prompts})
    assert supervised.status_code == 400 and supervised.json()["error"]["param"] == "training_file"
    # our extension cannot make it another method
    refused_v1({"roundhouse": {"method": {"kind": "dpo"}}}, "roundhouse.method.kind", "contradicts")


def test_the_grpo_events_are_kinds_of_the_service() -> None:
    assert EventKind.SAMPLES == grpo.SAMPLES_EVENT == "samples"
    assert EventKind.ROLLOUTS == grpo.ROLLOUTS_EVENT == "rollouts"
