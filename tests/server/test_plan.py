"""``POST /api/plan``: the longest sequence that fits, and the memory of each stage by term."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.engine.test_planner import LLAMA_3_8B, QWEN3_30B_A3B


def test_plan_reports_the_longest_sequence_that_fits(client: TestClient) -> None:
    body = {
        "config": LLAMA_3_8B,
        "data": {"max_length": 2048},
        "method": {"kind": "lora", "lora_r": 16},
        "hyper": {"batch_size": 1, "max_steps": 10},
        "engine": {"num_microbatches": 1, "compute_dtype": "bfloat16"},
        "hardware": {"num_gpus": 1, "gpu_memory_gb": 24},
    }
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    # the figure tests/engine/test_planner.py pins for this job
    assert (plan["max_seq_len"], plan["max_seq_len_limit"]) == (86848, "gpu_memory") and plan["fits"]
    longer = client.post("/api/plan", json=body | {"data": {"max_length": 86912}}).json()
    assert not longer["fits"] and "seq_len 86848 or shorter" in longer["suggestions"][0]
    # each stage's terms add up to its total; the fused stage holds one chunk of logits
    for stage in plan["stages"]:
        terms = stage["memory_gb"]
        assert abs(sum(v for k, v in terms.items() if k != "total") - terms["total"]) < 1e-9
    assert any(s["memory_gb"]["logits"] > 0 for s in plan["stages"] if s["kind"] == "fused")
    # two workers on one GPU share it: a shorter longest sequence
    two = {"num_microbatches": 1, "compute_dtype": "bfloat16", "devices": ["cuda:0", "cuda:0"]}
    shared = body | {"engine": two}
    halved = client.post("/api/plan", json=shared).json()
    assert halved["workers_per_gpu"] == 2 and 0 < halved["max_seq_len"] < plan["max_seq_len"]
    # the schema documents the new fields
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PlanPublic"]["properties"]
    assert {"max_seq_len", "max_seq_len_limit", "workers_per_gpu"} <= set(schema)


def test_plan_of_a_mixture_of_experts_model(client: TestClient) -> None:
    body = {
        "config": QWEN3_30B_A3B,
        "method": {"kind": "lora", "lora_r": 8, "target_parameters": ["experts"]},
        "hyper": {"batch_size": 4, "max_steps": 10},
        "engine": {"num_microbatches": 4},
        "hardware": {"num_gpus": 4, "gpu_memory_gb": 24},
    }
    with_experts = client.post("/api/plan", json=body)
    assert with_experts.status_code == 200, with_experts.text
    attention_only = client.post("/api/plan", json=body | {"method": {"kind": "lora", "lora_r": 8}}).json()
    plan = with_experts.json()
    assert plan["parameters"] == attention_only["parameters"] > 30e9  # every expert's weights
    # LoRA on 128 experts of 48 blocks: 8 * 128 * ((2048 + 1536) + (768 + 2048)) per block on top
    assert plan["trainable"] - attention_only["trainable"] == 48 * 8 * 128 * (2048 + 1536 + 768 + 2048)
    assert plan["max_seq_len"] > 0 and plan["max_seq_len_limit"] in ("gpu_memory", "context")
