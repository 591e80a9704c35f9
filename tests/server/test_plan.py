"""``POST /api/plan``: the longest sequence that fits, the memory of each stage by term, DPO
jobs (2 sequences a pair, the reference pass in the ETA), and the ETA of the run end to end:
assumed, or from a job that ran on this box."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from engine.planner import batch_length
from engine.planner.overheads import FORWARD_SHARE, LOAD_GB_S, ROWS_PER_S, SAVE_FIXED_S, START_S, WARMUP_STEPS
from server.services import plans
from server.settings import Settings
from server.tables import Dataset
from tests.engine.test_planner import LLAMA_3_8B, QWEN3_30B_A3B
from tests.utils.jobs import job_body


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
    assert (plan["max_seq_len"], plan["max_seq_len_limit"]) == (69632, "gpu_memory") and plan["fits"]
    longer = client.post("/api/plan", json=body | {"data": {"max_length": 69696}}).json()
    assert not longer["fits"] and "seq_len 69632 or shorter" in longer["suggestions"][0]
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


PAIRS = [
    {"prompt": f"Say {i}.", "chosen": str(i), "rejected": f"I will not say {i}, not today." * (1 + i % 3)}
    for i in range(12)
]


def _pairs(client: TestClient, name: str, rows: list[dict]) -> dict:
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/api/datasets", files={"file": (f"{name}.jsonl", content)}, data={"name": name})
    assert r.status_code == 201 and r.json()["format"] == "preference", r.text
    return dict(r.json())


def test_plan_of_a_dpo_job(client: TestClient, settings: Settings) -> None:
    train, held = _pairs(client, "pairs", PAIRS), _pairs(client, "held-out pairs", PAIRS[:4])
    method = {"kind": "dpo", "dpo_tuning": "lora", "beta": 0.2, "lora_r": 8}
    body = {
        "base_model": "tiny",
        "dataset_id": train["id"],
        "data": {"max_length": 256},
        "method": method,
        "hyper": {"batch_size": 4, "max_steps": 6},
        "engine": {"num_microbatches": 2, "compute_dtype": "bfloat16"},
        "hardware": {"num_gpus": 1, "gpu_memory_gb": 24},
    }
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    a = plan["assumptions"]
    assert plan["fits"] and (a["method"], a["tuning"], a["sequences_per_step"]) == ("dpo", "lora", 8)
    # the reference pass: a forward over each of the 12 pairs, once, counted in the ETA
    assert a["reference_pairs"] == 12 and plan["reference_s"] > 0
    assert plan["eta_s"] == pytest.approx(6 * plan["iteration_s"] + plan["reference_s"])
    # both sequences of each pair counted, batched as pairs, padded to the longest of the batch's rows
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        dataset = session.get(Dataset, train["id"])
        lengths = plans.token_lengths(dataset, tokenizer_folder=settings.models_dir / "tiny")
    assert len(lengths) == 2 * len(PAIRS) and lengths[1] > lengths[0]
    expected = batch_length(lengths, batch_size=4, max_length=256, packing=False, per_example=2)
    assert a["tokens_from_data"] and a["tokens_per_sequence"] == pytest.approx(expected)
    # a validation dataset's pairs take the reference pass too
    with_held = client.post("/api/plan", json=body | {"validation_dataset_id": held["id"]}).json()
    assert with_held["assumptions"]["reference_pairs"] == 16
    assert with_held["reference_s"] == pytest.approx(plan["reference_s"] * 16 / 12, rel=1e-6)
    missing = client.post("/api/plan", json=body | {"validation_dataset_id": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "validation_dataset_id"
    # a supervised plan on the pairs (a job POST /api/jobs refuses): no token counts, no reference
    lora = client.post("/api/plan", json=body | {"method": {"kind": "lora", "lora_r": 8}}).json()
    assert not lora["assumptions"]["tokens_from_data"] and lora["reference_s"] is None
    # pairs are never packed, as the run refuses it
    packed = client.post("/api/plan", json=body | {"data": {"max_length": 256, "packing": True}})
    assert packed.status_code == 422 and packed.json()["error"]["param"] == "data.packing"
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PlanPublic"]["properties"]
    assert "reference_s" in schema


def test_a_dpo_plan_steps_like_the_lora_plan_of_twice_the_batch(client: TestClient) -> None:
    common = {
        "config": LLAMA_3_8B,
        "data": {"max_length": 2048},
        "engine": {"num_microbatches": 2, "compute_dtype": "bfloat16"},
        "hardware": {"num_gpus": 2, "gpu_memory_gb": 24},
    }
    dpo = common | {"method": {"kind": "dpo", "lora_r": 16}, "hyper": {"batch_size": 2, "max_steps": 10}}
    lora = common | {"method": {"kind": "lora", "lora_r": 16}, "hyper": {"batch_size": 4, "max_steps": 10}}
    d, s = client.post("/api/plan", json=dpo), client.post("/api/plan", json=lora)
    assert d.status_code == 200, d.text
    d_plan, s_plan = d.json(), s.json()
    for key in ("iteration_s", "tokens_per_s", "stages", "max_seq_len", "host_ram", "trainable"):
        assert d_plan[key] == s_plan[key], key
    # no dataset: the pair count, hence the reference pass, is unknown
    assert d_plan["reference_s"] is None and d_plan["eta_s"] == pytest.approx(10 * d_plan["iteration_s"])


def test_a_lora_plan_shows_both_bases(client: TestClient) -> None:
    from tests.engine.test_planner_quantized import QWEN3_32B

    body = {
        "config": QWEN3_32B,
        "data": {"max_length": 2048},
        "method": {"kind": "lora"},
        "hyper": {"batch_size": 16, "max_steps": 10},
        "engine": {"num_microbatches": 16},
        "hardware": {"num_gpus": 8, "gpu_memory_gb": 24, "host_ram_gb": 64},
    }
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    sixteen, four = plan["base_variants"]
    # 66 GB of bf16 weights: not in 64 GB of RAM; about 20 GB with the blocks in 4 bits
    assert not plan["fits"] and plan["base_bits"] == 16
    assert (sixteen["base_bits"], sixteen["fits"], sixteen["limit"]) == (16, False, "host_ram")
    assert (four["base_bits"], four["fits"], four["limit"]) == (4, True, None)
    assert four["host_ram_gb"] < 0.5 * sixteen["host_ram_gb"] and four["max_seq_len"] > 0
    assert four["pcie_gb_per_iteration"] < sixteen["pcie_gb_per_iteration"]
    assert sixteen["host_ram_gb"] == plan["host_ram"]["total_gb"]
    assert sixteen["pcie_gb_per_iteration"] == plan["pcie"]["total_gb"]
    # the job with a 4-bit base: it fits, with the same two variants
    quantized = client.post("/api/plan", json=body | {"method": {"kind": "lora", "base_bits": 4}}).json()
    assert quantized["fits"] and quantized["base_bits"] == 4
    assert quantized["base_variants"] == plan["base_variants"]
    assert quantized["max_seq_len"] == four["max_seq_len"]
    assert any(s["memory_gb"]["dequantized"] > 0 for s in quantized["stages"])
    # a full fine-tune: no variants, and no 4-bit base
    full = client.post("/api/plan", json=body | {"method": {"kind": "full"}}).json()
    assert full["base_variants"] == []
    refused = client.post("/api/plan", json=body | {"method": {"kind": "full", "base_bits": 4}})
    assert refused.status_code in (400, 422) and "base_bits" in refused.json()["error"]["param"]
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PlanPublic"]["properties"]
    assert {"base_bits", "pcie", "base_variants"} <= set(schema)


def test_a_grpo_plan_adds_its_rollouts_to_the_step_of_the_sft_plan_of_its_completions(
    client: TestClient, settings: Settings
) -> None:
    from engine.planner.rollouts import host_gflops
    from engine.planner.workload import GPU_MEMORY_GB_S, HOST_CORES_ASSUMED, HOST_MEMORY_GB_S, Hardware
    from tests.server.test_grpo_jobs import GRADER, prompts_dataset

    common = {
        "config": LLAMA_3_8B,
        "data": {"max_length": 1024},
        "engine": {"num_microbatches": 4, "compute_dtype": "bfloat16"},
        "hardware": {"num_gpus": 2, "gpu_memory_gb": 24},
    }
    grpo = {"objective": "grpo", "grader": GRADER, "group_size": 8, "max_completion_tokens": 256, "beta": 0}
    g = client.post("/api/plan", json=common | {"method": grpo, "hyper": {"batch_size": 4, "max_steps": 10}})
    assert g.status_code == 200, g.text
    # the same 32 sequences a step, trained as a supervised job would train them
    sft = {"method": {"kind": "lora"}, "hyper": {"batch_size": 32, "max_steps": 10}}
    s = client.post("/api/plan", json=common | sft).json()
    g_plan = g.json()
    for key in ("iteration_s", "tokens_per_s", "stages", "max_seq_len", "host_ram"):
        assert g_plan[key] == s[key], key
    assert g_plan["assumptions"]["sequences_per_step"] == 32 and s["rollout_s"] is None
    # a step: the SFT step plus the rollouts' estimate, which the ETA counts
    rollout = g_plan["rollout"]
    assert g_plan["rollout_s"] > 0 and rollout["reference_s"] == 0.0  # beta 0: no KL term
    assert (
        g_plan["step_s"] == pytest.approx(s["step_s"] + g_plan["rollout_s"])
        and s["step_s"] == s["iteration_s"]
    )
    assert g_plan["step_s"] > s["step_s"] and g_plan["eta_s"] == pytest.approx(10 * g_plan["step_s"])
    assert g_plan["rollout_share"] == pytest.approx(g_plan["rollout_s"] / g_plan["step_s"])
    # the estimate: 32 completions of 256 tokens after a prefill of the prompts (no dataset:
    # max_length - 256 tokens each); the 16 GB of bf16 weights fit a 24 GB GPU, which samples
    embedding = LLAMA_3_8B["vocab_size"] * LLAMA_3_8B["hidden_size"]
    active = g_plan["parameters"] - embedding - LLAMA_3_8B["hidden_size"]  # blocks and head, a token's
    weights = 2 * (g_plan["parameters"] + g_plan["trainable"])  # what is read, and copied to the GPU

    def expected(rollout: dict, flops: float, read_gb_s: float) -> None:
        assert (rollout["rows"], rollout["completion_tokens"], rollout["memory_gb_s"]) == (32, 256, read_gb_s)
        assert rollout["gflops"] == pytest.approx(flops / 1e9)
        decode = max(2 * active * 32 / flops, weights / (read_gb_s * 1e9))
        prefill = 2 * active * 32 * (1024 - 256) / flops
        assert rollout["generation_s"] == pytest.approx(prefill + 256 * decode, rel=1e-6)
        assert rollout["tokens_per_s"] == pytest.approx(32 / decode, rel=1e-6)

    assert rollout["device"] == "gpu" and "the first GPU" in rollout["reason"]
    expected(rollout, 165e12 * 0.4, GPU_MEMORY_GB_S)
    assert rollout["upload_s"] == pytest.approx(weights / 25e9, rel=1e-6)  # once a step, over PCIe
    # GPUs of 16 GB: the host's CPU samples (no worker: its assumed cores), nothing is copied
    small = common | {"hardware": {"num_gpus": 2, "gpu_memory_gb": 16}}
    on_cpu = client.post("/api/plan", json=small | {"method": grpo, "hyper": {"batch_size": 4}}).json()
    assert on_cpu["rollout"]["device"] == "cpu" and "do not fit" in on_cpu["rollout"]["reason"]
    assert on_cpu["rollout"]["upload_s"] == 0.0 and host_gflops(Hardware()) == HOST_CORES_ASSUMED * 50.0
    expected(on_cpu["rollout"], HOST_CORES_ASSUMED * 50e9, HOST_MEMORY_GB_S)
    assert on_cpu["rollout_s"] > 10 * g_plan["rollout_s"]
    # beta > 0: each step also takes the base model's log-probabilities of its completions
    with_kl = client.post(
        "/api/plan",
        json=common | {"method": grpo | {"beta": 0.04}, "hyper": {"batch_size": 4, "max_steps": 10}},
    ).json()
    assert 0 < with_kl["rollout"]["reference_s"] < with_kl["iteration_s"]
    assert with_kl["rollout_s"] == pytest.approx(g_plan["rollout_s"] + with_kl["rollout"]["reference_s"])
    # a completion longer than the sequence leaves no room for the prompt
    long = client.post(
        "/api/plan",
        json=common | {"method": grpo | {"max_completion_tokens": 1024}, "hyper": {"batch_size": 4}},
    )
    assert long.status_code == 422 and long.json()["error"]["param"] == "method.max_completion_tokens"
    # with a prompts dataset: its prompts' lengths, each with the completion after it
    prompts = prompts_dataset(client)
    body = {
        "base_model": "tiny",
        "dataset_id": prompts,
        "data": {"max_length": 128},
        "method": grpo | {"max_completion_tokens": 16, "group_size": 2},
        "hyper": {"batch_size": 4, "epochs": 1},
        "engine": {"num_microbatches": 2},
        "hardware": {"num_gpus": 1, "gpu_memory_gb": 24},
    }
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        lengths = plans.token_lengths(
            session.get(Dataset, prompts), tokenizer_folder=settings.models_dir / "tiny"
        )
    assert len(lengths) == 8 and plan["assumptions"]["tokens_from_data"]
    expected = batch_length([n + 16 for n in lengths], batch_size=4, max_length=128, packing=False)
    assert plan["assumptions"]["tokens_per_sequence"] == pytest.approx(expected)
    assert plan["eta_s"] == pytest.approx(2 * plan["step_s"])  # 8 prompts, 4 a step
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PlanPublic"]["properties"]
    assert {"step_s", "rollout_s", "rollout_share", "rollout"} <= set(schema)


CHAT = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 5}."},
            {"role": "assistant", "content": str(i % 5)},
        ]
    }
    for i in range(24)
]


def _chat(client: TestClient) -> str:
    content = "".join(json.dumps(r) + "\n" for r in CHAT).encode()
    r = client.post("/api/datasets", files={"file": ("chat.jsonl", content)})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_the_eta_counts_the_run_end_to_end(client: TestClient) -> None:
    body = job_body(_chat(client), eval={"every_steps": 1}, data={"validation_fraction": 0.25})
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    terms = plan["overheads"]
    # the trainer's start, the model's load, 24 rows prepared, the first step's warm-up, ...
    assert terms["start_s"] == START_S and terms["data_s"] == pytest.approx(24 / ROWS_PER_S)
    assert terms["load_s"] == pytest.approx(plan["host_ram"]["weights_gb"] / LOAD_GB_S)
    assert terms["warmup_s"] == pytest.approx(WARMUP_STEPS * plan["step_s"])
    # ... 2 validation passes (after step 1, at the end) over the 6 held-out rows, 1 checkpoint
    assert terms["validation_s"] == pytest.approx(2 * 6 * plan["step_s"] / 4 * FORWARD_SHARE)
    assert terms["save_s"] > SAVE_FIXED_S
    parts = sum(v for k, v in terms.items() if k != "total_s")
    assert terms["total_s"] == pytest.approx(parts) and terms["total_s"] > 10 * plan["eta_s"]
    assert plan["total_s"] == pytest.approx(plan["eta_s"] + terms["total_s"])
    assert (plan["estimate"], plan["calibrated_from"]) == ("planner", None)
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PlanPublic"]["properties"]
    assert {"overheads", "total_s", "estimate"} <= set(schema)


def cpu_worker_online(client: TestClient, host: str = "box") -> str:
    """A CPU worker of ``host`` reporting now (as its telemetry does); its worker id."""
    from server.services import gpus

    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        gpus.record(
            session,
            worker_id=f"w@{host}",
            hostname=host,
            devices=[],
            cpu={"utilization": 1.0, "memory_total": 16e9, "cores": 2.0},
            message="no GPU on this host",
        )
    return f"w@{host}"


def run_measured_job(
    client: TestClient,
    body: dict,
    *,
    worker_id: str,
    tokens_per_step: float,
    step_s: list[float],
    wall_s: float,
) -> str:
    """Create the job of ``body`` and run it as ``worker_id`` does, through the worker's own sink:
    claimed, each step's progress, tokens/s and seconds logged, succeeded; ``wall_s`` from its
    claim to its end. Its id."""
    from datetime import timedelta

    from server.kinds import JobStatus
    from server.services import jobs
    from server.tables import Job
    from server.worker.trainer import DatabaseSink

    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    r = client.post("/api/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    with sessions() as session:
        assert jobs.claim(session, job_id=job_id, worker_id=worker_id, lease_seconds=60)
    sink = DatabaseSink(sessions, job_id)
    total = float(len(step_s))
    for step, seconds in enumerate(step_s, start=1):
        sink.log({"progress/step": float(step), "progress/total_steps": total}, step)
        sink.log({"throughput/tokens_per_s": tokens_per_step / seconds, "time/step_s": seconds}, step)
    sink.close()
    with sessions() as session:
        done = jobs.finish(
            session, job_id=job_id, worker_id=worker_id, to=JobStatus.SUCCEEDED, message="done"
        )
        assert done
        row = session.get(Job, job_id)
        row.started_at = row.finished_at - timedelta(seconds=wall_s)
        session.commit()
    return job_id


def padded_tokens(
    client: TestClient, settings: Settings, dataset_id: str, *, batch_size: int, max_length: int
) -> float:
    """The padded tokens of a step of the tiny model's batches of the dataset, as the engine counts them."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        dataset = session.get(Dataset, dataset_id)
        lengths = plans.token_lengths(dataset, tokenizer_folder=settings.models_dir / "tiny")
    return batch_size * batch_length(lengths, batch_size=batch_size, max_length=max_length, packing=False)


def test_a_job_that_ran_on_this_box_prices_the_plan_from_its_measured_times(
    client: TestClient, settings: Settings
) -> None:
    ds = _chat(client)
    body = job_body(ds)  # tiny, LoRA, 2 steps of 4 rows
    worker = cpu_worker_online(client)
    before = client.post("/api/plan", json=body).json()
    assert (before["estimate"], before["calibrated_from"]) == ("planner", None)

    # the job runs on that worker: a slow first step, then a 1.0 s one; 20 s from claim to end
    tokens = padded_tokens(client, settings, ds, batch_size=4, max_length=64)
    job = run_measured_job(
        client, body, worker_id=worker, tokens_per_step=tokens, step_s=[6.0, 1.0], wall_s=20
    )

    plan = client.post("/api/plan", json=body).json()
    assert (plan["estimate"], plan["calibrated_from"]) == ("measured", job)
    # its overhead: 20 s less 2 steady steps of 1.0 s (the first step's 5 s more is warm-up)
    assert plan["overheads"] == {"measured_s": 18.0, "total_s": 18.0}
    # its rate: the same job's steps take what they measured, not the planner's assumed rate
    assert plan["eta_s"] == pytest.approx(2 * 1.0, rel=0.1) and before["eta_s"] < 0.5
    assert plan["total_s"] == pytest.approx(plan["eta_s"] + 18.0)
    # two more runs, one slow and one fast (a busy box, then a quiet one): the medians price it
    run_measured_job(client, body, worker_id=worker, tokens_per_step=tokens, step_s=[9.0, 3.0], wall_s=40)
    latest = run_measured_job(
        client, body, worker_id=worker, tokens_per_step=tokens, step_s=[2.0, 0.5], wall_s=9
    )
    again = client.post("/api/plan", json=body).json()
    assert (again["estimate"], again["calibrated_from"]) == ("measured", latest)
    assert again["overheads"]["measured_s"] == 18.0  # of 34, 18 and 8 s
    assert again["eta_s"] == pytest.approx(plan["eta_s"], rel=1e-6)  # the middle rate, the first job's
    # hardware the caller names is not this box: the planner's own figures
    named = client.post("/api/plan", json=body | {"hardware": {"num_gpus": 1, "gpu_memory_gb": 24}}).json()
    assert (named["estimate"], named["calibrated_from"]) == ("planner", None)
    # a job of another tuning measured nothing about this one
    full = client.post("/api/plan", json=body | {"method": {"kind": "full"}}).json()
    assert full["estimate"] == "planner"
