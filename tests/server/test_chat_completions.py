"""``/v1/chat/completions`` and ``/v1/completions`` driven by the pinned ``openai`` client against a
live server and a real worker, whose inference service answers: greedy answers equal
``model.generate``, streaming (with usage), ``n``, ``seed``, ``stop``, logprobs, the legacy
completions, and OpenAI's error shapes, none of them a 5xx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from engine.inference.chat import prompt_ids, stop_ids
from engine.inference.generate import load_for_inference
from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.server.test_openai_api import LiveServer, _settings

HELLO: list[Any] = [{"role": "user", "content": "what is two plus three?"}]
READY_S = 120.0


def wait_ready(client: openai.OpenAI, worker: WorkerProcess, *, timeout: float = READY_S) -> None:
    """Until the worker's inference service answers (a 503 until its first sample is recorded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
            return
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline or not worker.running():
                raise AssertionError(
                    f"the inference service did not come up: {exc}\n{worker.tail()}"
                ) from exc
        time.sleep(0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, WorkerProcess]]:
    """A live server and a real worker (the no-server folder broker, as ``make run``)."""
    root = tmp_path_factory.mktemp("served")
    settings = _settings(root)
    with LiveServer(settings) as server:
        worker = WorkerProcess(settings, root / "worker.log").start()
        try:
            wait_ready(server.client(), worker)
            yield server, worker
        finally:
            worker.end()


def greedy(settings: Settings, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """What ``model.generate`` answers greedily, in this process, special tokens left out."""
    model, tokenizer = load_for_inference(settings.models_dir / "tiny")
    ids = prompt_ids(tokenizer, messages)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop_ids(model, tokenizer)),
            pad_token_id=tokenizer.pad_token_id,
        )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def test_a_greedy_answer_equals_generate_and_has_openai_s_shape(
    served: tuple[LiveServer, WorkerProcess],
) -> None:
    server, _ = served
    client = server.client()
    answer = client.chat.completions.create(
        model="tiny", messages=HELLO, temperature=0, max_completion_tokens=8
    )
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "tiny"
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.content == greedy(server.settings, HELLO, 8)
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # a developer message is a system message; max_tokens works as max_completion_tokens
    system: list[Any] = [{"role": "developer", "content": "answer"}, *HELLO]
    again = client.chat.completions.create(model="tiny", messages=system, temperature=0, max_tokens=6)
    expected = greedy(server.settings, [{"role": "system", "content": "answer"}, *HELLO], 6)
    assert again.choices[0].message.content == expected


def test_a_stream_adds_up_to_the_answer_and_ends_with_usage(served: tuple[LiveServer, WorkerProcess]) -> None:
    server, _ = served
    client = server.client()
    body: dict[str, Any] = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 10}
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    # the wire: server-sent events that end with data: [DONE]
    with server.http() as http:
        raw = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_n_seed_stop_and_logprobs(served: tuple[LiveServer, WorkerProcess]) -> None:
    server, _ = served
    client = server.client()
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": HELLO,
        "temperature": 1.5,
        "max_tokens": 12,
        "seed": 3,
    }
    first = client.chat.completions.create(**body, n=3)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.message.content for c in client.chat.completions.create(**body, n=3).choices] == texts
    assert client.chat.completions.create(**body).choices[0].message.content == texts[0]  # choice 0: seed
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**body, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts

    # stop: the answer ends before the first stop string, which is not sent
    text = texts[0] or ""
    cut = next((text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip()), None)
    assert cut is not None, text
    stopped = client.chat.completions.create(**body, stop=[cut, "\x01never"])
    assert stopped.choices[0].message.content == text[: text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"

    greedy_body = {**body, "temperature": 0, "max_tokens": 5}
    scored = client.chat.completions.create(**greedy_body, logprobs=True, top_logprobs=2)
    content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) >= 1
    for entry in content:  # greedy: the chosen token is the likeliest
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).startswith(scored.choices[0].message.content or "\x00")


def test_legacy_completions(served: tuple[LiveServer, WorkerProcess]) -> None:
    server, _ = served
    client = server.client()
    done = client.completions.create(model="tiny", prompt="two plus three is", temperature=0)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.usage is not None and done.usage.completion_tokens <= 16  # OpenAI's default max_tokens
    text = done.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="two plus three is", temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text
    echoed = client.completions.create(model="tiny", prompt="two plus three is", temperature=0, echo=True)
    assert echoed.choices[0].text == "two plus three is" + text
    scored = client.completions.create(
        model="tiny", prompt="two plus three is", temperature=0, max_tokens=4, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) >= 1
    assert all(1 <= len(t) <= 2 for t in logprobs.top_logprobs or [])  # keyed by text: two may be one
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    two = client.completions.create(
        model="tiny", prompt=["two plus", "three is"], temperature=0, max_tokens=3
    )
    assert [c.index for c in two.choices] == [0, 1]
    alone = client.completions.create(model="tiny", prompt="three is", temperature=0, max_tokens=3)
    assert two.choices[1].text == alone.choices[0].text


def test_errors_come_in_openai_s_shape(served: tuple[LiveServer, WorkerProcess]) -> None:
    server, _ = served
    client = server.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="ft:tiny:x:nojob", messages=HELLO)
    assert missing.value.code == "model_not_found"
    long: list[Any] = [{"role": "user", "content": "two plus three " * 20}]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny", messages=long)
    assert (too_long.value.code, too_long.value.param) == ("context_length_exceeded", "messages")
    assert "maximum context length is 64 tokens" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=60)
    assert (
        too_long.value.code == "context_length_exceeded" and "60 in the completion" in too_long.value.message
    )
    with pytest.raises(openai.BadRequestError) as stream_too_long:
        client.chat.completions.create(model="tiny", messages=long, stream=True)
    assert stream_too_long.value.code == "context_length_exceeded"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"tools": []}, "tools"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{"model": "tiny", "messages": HELLO, **extra})
        assert refused.value.type == "invalid_request_error", extra
        assert (refused.value.param or "").startswith(param), (extra, refused.value.param)
    with server.http() as http:
        for body in ({"model": "tiny"}, {"model": "tiny", "messages": "hi"}, {"model": 5, "messages": HELLO}):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        r = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": HELLO},
            headers={"Authorization": "Bearer no"},
        )
        assert r.status_code == 401


def test_no_worker_is_a_503_with_retry_after(tmp_path: Path) -> None:
    with LiveServer(_settings(tmp_path)) as server:
        with pytest.raises(openai.APIStatusError) as busy:
            server.client().chat.completions.create(model="tiny", messages=HELLO)
        assert busy.value.status_code == 503 and busy.value.code == "no_inference_worker"
        assert busy.value.response.headers["Retry-After"].isdigit()
        with pytest.raises(openai.NotFoundError):  # the model is checked first
            server.client().chat.completions.create(model="nope", messages=HELLO)
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"Authorization": f"Bearer {server.key}"},
        )
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
