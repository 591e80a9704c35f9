"""Training has priority over inference, with a real worker and its inference service.

The placement rule (``server/worker/inference_models.py``); on this CPU-only host, with
``ROUNDHOUSE_INFERENCE_CPU_MAX_PARAMS`` between the sizes of two models: while a job trains, the
small one is still answered on the CPU, the big one gets a 503 ``gpus_training`` with
``Retry-After``, and an answer of the big one in flight is cut off within
``ROUNDHOUSE_INFERENCE_RELEASE_SECONDS``; after the job both answer again. And a job trained
while requests keep coming gives bitwise the same adapter as the same job trained alone."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from server.worker.inference_models import Busy, placement
from tests.engine.tiny import tiny_model, tiny_tokenizer
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import HELLO, wait_ready
from tests.server.test_openai_api import LiveServer, _settings
from tests.utils.jobs import start_job, wait_for, wait_for_job

CPU_MAX = 20_000  # between the micro model (~7k parameters) and the tiny one (~40k)
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"add {i} and 1"},
            {"role": "assistant", "content": str(i + 1)},
        ]
    }
    for i in range(24)
]


def test_the_placement_rule() -> None:
    assert placement(10**12, gpus=2, training=False, cpu_max_params=100) == "gpu"
    assert placement(50, gpus=2, training=True, cpu_max_params=100) == "cpu"
    assert placement(10**12, gpus=0, training=False, cpu_max_params=100) == "cpu"  # the CPU is all there is
    assert placement(50, gpus=0, training=True, cpu_max_params=100) == "cpu"
    for gpus, where in ((2, "GPUs"), (0, "CPU")):
        with pytest.raises(Busy) as busy:
            placement(101, gpus=gpus, training=True, cpu_max_params=100)
        assert where in str(busy.value) and "101" in str(busy.value) and busy.value.retry_after > 0


def micro_model_folder(folder: Path) -> Path:
    tokenizer = tiny_tokenizer()
    model = tiny_model(
        "llama",
        blocks=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=max(96, len(tokenizer)),
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def long_model_folder(folder: Path) -> Path:
    """Above ``CPU_MAX``, with room for an answer of thousands of tokens, which greedy decoding never
    ends: the special tokens' rows of the LM head are zero (a logit of 0, below the likeliest)."""
    import torch

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=max(96, len(tokenizer)), max_position_embeddings=8192)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.all_special_ids] = 0.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, WorkerProcess]]:
    root = tmp_path_factory.mktemp("priority")
    settings = _settings(root)
    micro_model_folder(settings.models_dir / "micro")
    long_model_folder(settings.models_dir / "long")
    with LiveServer(settings) as server:
        worker = WorkerProcess(settings, root / "worker.log")
        worker.env["ROUNDHOUSE_INFERENCE_CPU_MAX_PARAMS"] = str(CPU_MAX)
        worker.env["ROUNDHOUSE_INFERENCE_RELEASE_SECONDS"] = "1"
        worker.start()
        try:
            wait_ready(server.client(), worker)
            yield server, worker
        finally:
            worker.end()


def adapter_bits(job: dict[str, Any], step: int) -> bytes:
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / f"step_{step:06d}"
    return (folder / "adapter_model.safetensors").read_bytes()


def ask(client: openai.OpenAI, model: str, **extra: Any) -> str:
    answer = client.chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=4, **extra)
    return answer.choices[0].message.content or ""


@pytest.mark.slow
def test_a_job_takes_the_devices_and_trains_the_same_bits_under_traffic(
    host: tuple[LiveServer, WorkerProcess],
) -> None:
    server, worker = host
    client, http = server.client(), server.http()
    dataset = http.post(
        "/api/datasets", files={"file": ("rows.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))}
    ).json()["id"]
    job_options: dict[str, Any] = {"hyper": {"max_steps": 6}, "checkpoint": {"every_steps": 6}}
    ask(client, "micro"), ask(client, "tiny")  # both answer while no job trains

    # an answer of the big model in flight when a job starts: cut off within the release time
    cut: list[BaseException] = []

    def long_answer() -> None:
        try:
            stream = client.chat.completions.create(
                model="long", messages=HELLO, temperature=0, max_tokens=4000, stream=True
            )
            for _ in stream:
                pass
        except openai.APIError as exc:
            cut.append(exc)

    in_flight = threading.Thread(target=long_answer)
    in_flight.start()
    time.sleep(1.0)
    alone = start_job(http, dataset, name="alone", **job_options)
    in_flight.join(60)
    assert not in_flight.is_alive() and cut, "the answer in flight was not cut off for the job"
    assert "unloaded" in str(cut[0]), cut[0]
    # while it trains: the big model waits (503, Retry-After), the small one answers on the CPU
    refused = wait_for(
        lambda: _refusal(client, "tiny"), timeout=60, what="a 503 while the job trains", details=worker.tail
    )
    assert (
        refused is not None
        and refused.code == "gpus_training"
        and refused.response.headers["Retry-After"].isdigit()
    )
    assert "training job" in refused.message and f"{CPU_MAX:,}" in refused.message
    assert http.get(f"/api/jobs/{alone['id']}").json()["status"] == "running"
    ask(client, "micro")
    alone = wait_for_job(http, alone["id"], {"succeeded"}, logs=[worker])
    assert ask(client, "tiny") is not None  # the job ended: the big model answers again

    # the same job again, with requests coming all the while: the same adapter, bit for bit
    stop = threading.Event()
    served = {"micro": 0, "tiny": 0}

    def traffic() -> None:
        while not stop.is_set():
            for model in ("micro", "tiny"):
                try:
                    ask(client, model, seed=served[model])
                    served[model] += 1
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    busy = start_job(http, dataset, name="busy", **job_options)
    try:
        busy = wait_for_job(http, busy["id"], {"succeeded"}, logs=[worker])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert served["micro"] > 0
    assert adapter_bits(busy, 6) == adapter_bits(alone, 6)


def _refusal(client: openai.OpenAI, model: str) -> openai.APIStatusError | None:
    try:
        ask(client, model)
    except openai.APIStatusError as exc:
        if exc.status_code == 503:
            return exc
        raise
    return None
