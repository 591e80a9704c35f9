"""``POST /api/generate``: the playground's answers streamed as server-sent events by a real
worker's inference service (the path of ``/v1/chat/completions``), from a base model and from a
job's LoRA checkpoint, the same as the engine's own sampler; the 4xx cases; and a dropped stream
not holding up the next answer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.inference.chat import Piece, Sampling, chat_stream
from engine.inference.generate import load_for_inference
from server.app import create_app
from server.services import checkpoints
from server.settings import Settings
from tests.engine.tiny import tiny_model, tiny_tokenizer
from tests.server.conftest import WorkerProcess
from tests.server.test_chat_completions import served
from tests.server.test_openai_api import LiveServer
from tests.utils import LOGIN_LINE, Process, child_env, free_port, roundhouse
from tests.utils.jobs import start_job

__all__ = ["served"]  # the module's live server and worker

HELLO = [{"role": "user", "content": "what is two plus three?"}]


def events(text: str) -> list[tuple[str, Any]]:
    """The (event, data) pairs of an SSE body (comments left out)."""
    found = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            found.append((fields.get("event", "message"), json.loads(fields["data"])))
    return found


def answer_of(found: list[tuple[str, Any]]) -> str:
    return "".join(data["text"] for kind, data in found if kind == "delta")


def expected(
    folder: Path, messages: list[dict[str, str]], sampling: Sampling, adapter: Path | None = None
) -> str:
    model, tokenizer = load_for_inference(folder, adapter=adapter)
    pieces = chat_stream(model, tokenizer, messages, sampling=sampling)
    return "".join(p.text for p in pieces if isinstance(p, Piece))


def post(client: TestClient | httpx.Client, **body: Any) -> Any:
    return client.post("/api/generate", json={"messages": HELLO, **body})


@pytest.fixture
def live(served: tuple[LiveServer, WorkerProcess]) -> Iterator[httpx.Client]:
    with served[0].http() as http:
        yield http


def test_streams_the_answer_of_a_base_model(live: httpx.Client, served: tuple[LiveServer, Any]) -> None:
    r = post(live, model="tiny", temperature=0, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    found = events(r.text)
    kinds = [k for k, _ in found]
    assert kinds[:2] == ["status", "status"] and found[0][1]["state"] == "loading"
    assert found[1][1] == {"state": "generating", "model": "tiny", "placement": "cpu"}
    assert kinds[-1] == "done" and "delta" in kinds and "error" not in kinds
    done = found[-1][1]
    assert done["finish_reason"] in ("stop", "length") and 1 <= done["completion_tokens"] <= 8
    assert done["prompt_tokens"] > 0
    # greedy: exactly what the engine's sampler answers in process
    assert answer_of(found) == expected(served[0].settings.models_dir / "tiny", HELLO, Sampling(0.0, 1.0, 8))


def test_a_seed_makes_sampling_reproducible(live: httpx.Client) -> None:
    client = live
    body = {"model": "tiny", "temperature": 1.5, "top_p": 0.9, "max_tokens": 12, "seed": 7}
    first, second = (answer_of(events(post(client, **body).text)) for _ in range(2))
    assert first == second and first
    other = answer_of(events(post(client, **{**body, "seed": 8}).text))
    assert other != first


def lora_checkpoint(client: TestClient, settings: Settings) -> tuple[str, int, Path]:
    """A queued job with one LoRA checkpoint of the tiny model on disk, recorded as the worker does
    (``client``'s app sends jobs to a queue no worker reads)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", rows)})
    assert r.status_code == 201, r.text
    dataset = r.json()
    job = start_job(client, dataset["id"])
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / "step_000002"
    base = settings.models_dir / "tiny"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=2, path=str(folder), kind="adapter", metrics={})
    return job["id"], 2, folder


def test_streams_the_answer_of_a_lora_checkpoint(served: tuple[LiveServer, Any], live: httpx.Client) -> None:
    settings = served[0].settings
    app = create_app(settings.model_copy(update={"queue": "nobody"}))
    with TestClient(app) as sender:
        sender.headers["Authorization"] = f"Bearer {served[0].key}"
        job_id, step, folder = lora_checkpoint(sender, settings)
    client = live
    chat = [
        {"role": "user", "content": "two plus three?"},
        {"role": "assistant", "content": "five"},
        {"role": "user", "content": "one?"},
    ]
    r = client.post(
        "/api/generate",
        json={
            "checkpoint": {"job_id": job_id, "step": step},
            "messages": chat,
            "temperature": 0,
            "max_tokens": 6,
        },
    )
    assert r.status_code == 200, r.text
    found = events(r.text)
    assert found[-1][0] == "done", found
    base = settings.models_dir / "tiny"
    assert answer_of(found) == expected(base, chat, Sampling(0.0, 1.0, 6), adapter=folder)
    assert answer_of(found) != expected(base, chat, Sampling(0.0, 1.0, 6))  # the adapter is applied

    missing = client.post(
        "/api/generate", json={"checkpoint": {"job_id": job_id, "step": 9}, "messages": HELLO}
    )
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "checkpoint.step"
    nojob = client.post(
        "/api/generate", json={"checkpoint": {"job_id": "f00d", "step": 2}, "messages": HELLO}
    )
    assert nojob.status_code == 404 and nojob.json()["error"]["param"] == "checkpoint.job_id"


def test_a_conversation_longer_than_the_context_ends_with_an_error_event(live: httpx.Client) -> None:
    long = [{"role": "user", "content": "the quick brown fox " * 40}]
    r = live.post("/api/generate", json={"model": "tiny", "messages": long})
    assert r.status_code == 200
    kind, data = events(r.text)[-1]
    assert kind == "error" and data["error"]["param"] == "messages"
    assert data["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in data["error"]["message"]


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]  # type: ignore[no-any-return]


def test_bad_requests_are_4xx_naming_the_field(client: TestClient, settings: Settings) -> None:
    e = error_of(post(client, model="no-such-model"), 404)
    assert e["param"] == "model" and "no-such-model" in e["message"]
    for field, value in [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 100_000),
        ("seed", -1),
    ]:
        assert error_of(post(client, model="tiny", **{field: value}), 422)["param"] == field
    assert error_of(post(client), 422)["param"] == "model"  # neither a model nor a checkpoint
    both = post(client, model="tiny", checkpoint={"job_id": "x", "step": 1})
    assert error_of(both, 422)["param"] == "model"
    bad_role = client.post(
        "/api/generate", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert error_of(bad_role, 422)["param"] == "messages.0.role"
    last = client.post(
        "/api/generate", json={"model": "tiny", "messages": [*HELLO, {"role": "assistant", "content": "5"}]}
    )
    assert error_of(last, 422)["param"] == "messages.1.role"
    assert (
        error_of(client.post("/api/generate", json={"model": "tiny", "messages": []}), 422)["param"]
        == "messages"
    )
    # a model the engine does not support is refused
    folder = settings.models_dir / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    e = error_of(post(client, model="bert"), 422)
    assert e["code"] == "unsupported_model" and e["param"] == "model"


def test_a_key_is_required(client: TestClient) -> None:
    for model in ("tiny", "no-such-model"):  # the key first: nothing is said about the models
        r = client.post(
            "/api/generate", json={"model": model, "messages": HELLO}, headers={"Authorization": ""}
        )
        assert error_of(r, 401)["code"] == "unauthorized"


def long_context_model(folder: Path, **extra: object) -> Path:
    """The tiny model with an 8192-token context: an answer of thousands of tokens fits."""
    tokenizer = tiny_tokenizer()
    vocab = max(96, len(tokenizer))
    tiny_model("llama", vocab_size=vocab, max_position_embeddings=8192, **extra).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_client_that_disconnects_stops_its_generation_on_a_real_server(tmp_path: Path) -> None:
    """``roundhouse serve --with-worker`` on a port: a stream dropped after its first piece leaves
    the batch at the next step (``tests/engine/inference/test_batching.py`` counts the steps); the
    next answer of that model is not kept waiting for 2000 more tokens."""
    home = tmp_path / "home"
    long_context_model(home / "models" / "long", hidden_size=256, intermediate_size=512, blocks=16)
    port = free_port()
    env = child_env(ROUNDHOUSE_HOME=str(home), ROUNDHOUSE_PORT=str(port))
    command = roundhouse("serve", "--with-worker", "--new-login-key")
    serve = Process(command, env=env, log=tmp_path / "serve.log").start()
    try:
        found = serve.wait_for_line(LOGIN_LINE, timeout=60)
        assert found is not None, serve.tail()
        serve.wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=60)
        # greedy: this model never samples an end-of-turn token; all 2048 take a minute here
        body = {"model": "long", "messages": HELLO, "temperature": 0.0, "max_tokens": 2048}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            client.get(found.group(1))  # the one-time login link: a session cookie
            deadline = time.monotonic() + 60  # the worker's inference service comes up
            while "event: done" not in client.post("/api/generate", json={**body, "max_tokens": 1}).text:
                assert time.monotonic() < deadline, serve.tail()
                time.sleep(0.5)
            with client.stream("POST", "/api/generate", json=body) as r:
                assert r.status_code == 200, r.read()
                next(line for line in r.iter_lines() if line.startswith("event: delta"))
            start = time.monotonic()  # dropped; the same model again:
            r = client.post("/api/generate", json={**body, "max_tokens": 1})
            took = time.monotonic() - start
        found_events = events(r.text)
        assert found_events[-1][0] == "done", found_events
        assert took < 8, f"the dropped answer went on: the next one took {took:.1f} s ({found_events})"
    finally:
        serve.stop()
