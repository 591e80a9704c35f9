"""``/v1/chat/completions`` and ``/v1/completions``: answers in OpenAI's shapes, streamed or whole.

The route resolves the model name (a base model, ``ft:...``, ``...:ckpt-step-N``) to folders and
forwards the request to a worker's inference service (``server.services.inference``), which
batches it with the other answers of its model; this process never loads a model. Errors come in
OpenAI's shape: ``model_not_found`` (404), ``context_length_exceeded`` (400), ``gpus_training``
and ``no_inference_worker`` (503, with ``Retry-After``). A conversation may hold ``image_url``
parts for a vision-language model (``server/api/openai/images.py``); a text-only model refuses
them (400 naming the part).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.api.openai.completion_shapes import (
    EVENT_STREAM,
    ChatCompletion,
    ChatCompletionCreate,
    Completion,
    CompletionCreate,
)
from server.api.openai.images import payload_messages
from server.api.openai.shapes import documented
from server.errors import ApiError, openai_body
from server.services import generation, inference
from server.services.generation import Target
from server.streams import stream_key

router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    dependencies=[Depends(stream_key)],
    responses=documented(400, 401, 404, 503),
)
FAILED = {
    "preempted": (503, "gpus_training"),
    "error": (500, "inference_failed"),
    "cancelled": (503, "cancelled"),
}


def resolve(request: Request, name: str) -> Target:
    """The folders behind a model name, or a 404 ``model_not_found`` / 400 naming ``model``."""
    state = request.app.state
    settings = state.settings
    where = {"models_dir": settings.models_dir, "hf_cache": settings.hf_cache_dir}
    try:
        with state.sessions() as session:
            tuned = generation.fine_tuned_target(
                session, name=name, storage=state.storage, cache=settings.cache_dir, **where
            )
            return tuned or generation.base_target(name=name, **where)
    except generation.NotFound as exc:
        message = f"The model `{name}` does not exist or you do not have access to it. ({exc})"
        raise ApiError(404, "model_not_found", message, param="model") from exc
    except generation.Refused as exc:
        raise ApiError(400, exc.code, str(exc), param="model") from exc


def find_service(request: Request) -> inference.Service:
    """An online worker's inference service, or a 503."""
    state = request.app.state
    with state.sessions() as session:
        return inference.pick(session, stale_after=state.settings.telemetry_seconds * 5)


def unavailable(exc: inference.Unavailable) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    body = openai_body(exc.status, exc.code, exc.message, exc.param)
    return JSONResponse(body, status_code=exc.status, headers=headers)


class Answers:
    """The open streams of one request (one per prompt), merged; ``close`` ends them all."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.starts: list[dict[str, Any]] = []
        self.streams: list[AsyncIterator[dict[str, Any]]] = []

    async def open(self, request: Request, target: Target, payloads: list[dict[str, Any]]) -> None:
        service = await run_in_threadpool(find_service, request)
        common: dict[str, Any] = {"name": target.name, "model": target.model, "adapter": target.adapter}
        common |= {"parameters": target.parameters, "models_dir": str(target.models_dir)}
        for payload in payloads:  # all admitted before any is read: they decode in one batch
            start, rest = await inference.open_stream(self.client, service, {**common, **payload})
            self.starts.append(start)
            self.streams.append(rest)

    async def events(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(prompt number, event) as they come from every stream."""
        queue: asyncio.Queue[tuple[int, dict[str, Any] | Exception | None]] = asyncio.Queue()

        async def pump(p: int, stream: AsyncIterator[dict[str, Any]]) -> None:
            try:
                async for event in stream:
                    await queue.put((p, event))
                await queue.put((p, None))
            except Exception as exc:  # the service went away mid-answer
                await queue.put((p, exc))

        tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(self.streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                p, item = await queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise inference.Unavailable(
                        503, "inference_unavailable", f"the inference service broke off: {item}"
                    )
                else:
                    yield p, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for stream in self.streams:
            with contextlib.suppress(RuntimeError):  # one a pump still iterates: closed with the client
                await stream.aclose()  # type: ignore[attr-defined]
        await self.client.aclose()


def _failure(event: dict[str, Any]) -> inference.Unavailable | None:
    if event["reason"] not in FAILED:
        return None
    status, code = FAILED[event["reason"]]
    message = event.get("error") or "the answer was cut off"
    return inference.Unavailable(status, code, message, retry_after=30 if status == 503 else None)


def _usage(starts: list[dict[str, Any]], tokens: int) -> dict[str, int]:
    prompt = sum(int(s["prompt_tokens"]) for s in starts)
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}


def _chat_logprob(event: dict[str, Any]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**one(event["token"], event["logprob"]), "top_logprobs": [one(t, lp) for t, lp in event["top"]]}


async def _start(request: Request, body: Any, payloads: list[dict[str, Any]]) -> Answers | JSONResponse:
    target = await run_in_threadpool(resolve, request, body.model)
    answers = Answers(httpx.AsyncClient())
    try:
        await answers.open(request, target, payloads)
    except inference.Unavailable as exc:
        await answers.close()
        return unavailable(exc)
    return answers


def _sampling(body: Any) -> dict[str, Any]:
    try:
        stop = body.stops()
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc), param="stop") from exc
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return {"temperature": temperature, "top_p": top_p, "seed": body.seed, "stop": stop, "n": body.n or 1}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


@router.post("/chat/completions", response_model=ChatCompletion, responses={200: EVENT_STREAM})
async def chat_completions(body: ChatCompletionCreate, request: Request) -> Any:
    """Answer a conversation through the model's chat template (OpenAI's chat completions)."""
    allow_urls = request.app.state.settings.allow_image_urls
    messages = await payload_messages(body.messages, allow_urls=allow_urls)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    payload = {**_sampling(body), "messages": messages, "logprobs": logprobs}
    payload["max_tokens"] = body.max_completion_tokens or body.max_tokens
    answers = await _start(request, body, [payload])
    if isinstance(answers, JSONResponse):
        return answers
    ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": ident, "created": created, "model": body.model, "system_fingerprint": None}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _event_stream(answers, _chat_chunks(answers, head, body.n or 1, usage=usage))
    try:
        choices = await _collect(answers, body.n or 1)
    except inference.Unavailable as exc:
        return unavailable(exc)
    finally:
        await answers.close()
    out = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(c["text"]), "refusal": None},
            "logprobs": {"content": c["logprobs"], "refusal": None} if body.logprobs else None,
            "finish_reason": c["reason"],
        }
        for i, c in enumerate(choices)
    ]
    tokens = sum(c["tokens"] for c in choices)
    return {**head, "object": "chat.completion", "choices": out, "usage": _usage(answers.starts, tokens)}


@router.post("/completions", response_model=Completion, responses={200: EVENT_STREAM})
async def completions(body: CompletionCreate, request: Request) -> Any:
    """Continue a prompt as it is, no chat template (OpenAI's legacy completions)."""
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "invalid_request", "echo: not with logprobs here", param="echo")
    sampling = {**_sampling(body), "max_tokens": body.max_tokens, "logprobs": body.logprobs}
    prompts = body.prompts()
    answers = await _start(request, body, [{**sampling, "prompt": p} for p in prompts])
    if isinstance(answers, JSONResponse):
        return answers
    n = body.n or 1
    echo = [p if body.echo else "" for p in prompts for _ in range(n)]
    ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": ident, "created": created, "model": body.model, "system_fingerprint": None}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _event_stream(answers, _text_chunks(answers, head, n, echo, usage=usage))
    try:
        choices = await _collect(answers, n)
    except inference.Unavailable as exc:
        return unavailable(exc)
    finally:
        await answers.close()
    out = []
    for i, c in enumerate(choices):
        logprobs = _legacy_logprobs(c["logprobs"], offset=len(echo[i])) if body.logprobs is not None else None
        text = echo[i] + "".join(c["text"])
        out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c["reason"]})
    tokens = sum(c["tokens"] for c in choices)
    return {**head, "object": "text_completion", "choices": out, "usage": _usage(answers.starts, tokens)}


async def _collect(answers: Answers, n: int) -> list[dict[str, Any]]:
    """Every choice whole: its text pieces, logprobs, finish reason and token count.

    Raises:
        inference.Unavailable: a choice was cut off (the model unloaded for a job) or failed.
    """
    choices = [
        {"text": [], "logprobs": [], "reason": "stop", "tokens": 0} for _ in range(len(answers.starts) * n)
    ]
    async for p, event in answers.events():
        c = choices[p * n + event["index"]]
        if event["type"] == "token":
            c["text"].append(event["text"])
            if "logprob" in event:
                c["logprobs"].append(_chat_logprob(event))
        elif event["type"] == "end":
            failure = _failure(event)
            if failure is not None:
                raise failure
            c["text"].append(event["text"])
            c["reason"], c["tokens"] = event["reason"], event["tokens"]
    return choices


def _legacy_logprobs(entries: list[dict[str, Any]], *, offset: int) -> dict[str, Any]:
    """The legacy completions' logprobs object from the chat form of each token."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _event_stream(answers: Answers, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        except inference.Unavailable as exc:  # after the 200: OpenAI's clients raise on an error chunk
            yield _sse(openai_body(exc.status, exc.code, exc.message, exc.param))
        finally:
            await answers.close()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _chat_chunks(
    answers: Answers, head: dict[str, Any], n: int, *, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if usage else {}

    def chunk(
        index: int, delta: dict[str, Any], *, logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
    tokens = 0
    async for _, event in answers.events():
        i = event["index"]
        if event["type"] == "token":
            logprobs = {"content": [_chat_logprob(event)], "refusal": None} if "logprob" in event else None
            if event["text"] or logprobs:
                yield chunk(i, {"content": event["text"]}, logprobs=logprobs)
        elif event["type"] == "end":
            failure = _failure(event)
            if failure is not None:
                raise failure
            tokens += event["tokens"]
            if event["text"]:
                yield chunk(i, {"content": event["text"]})
            yield chunk(i, {}, finish=event["reason"])
    if usage:
        yield {**base, "choices": [], "usage": _usage(answers.starts, tokens)}


async def _text_chunks(
    answers: Answers, head: dict[str, Any], n: int, echo: list[str], *, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    base = {**head, "object": "text_completion"}
    extra = {"usage": None} if usage else {}
    offsets = [len(e) for e in echo]

    def chunk(index: int, text: str, *, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            **extra,
        }

    for i, text in enumerate(echo):
        if text:
            yield chunk(i, text)
    tokens = 0
    async for p, event in answers.events():
        i = p * n + event["index"]
        if event["type"] == "token":
            logprobs = None
            if "logprob" in event:
                logprobs = _legacy_logprobs([_chat_logprob(event)], offset=offsets[i])
                offsets[i] += len(event["token"])
            if event["text"] or logprobs:
                yield chunk(i, event["text"], logprobs=logprobs)
        elif event["type"] == "end":
            failure = _failure(event)
            if failure is not None:
                raise failure
            tokens += event["tokens"]
            yield chunk(i, event["text"], finish=event["reason"])
    if usage:
        yield {**base, "choices": [], "usage": _usage(answers.starts, tokens)}
