"""``/api/generate``: the chat playground's answers, streamed as server-sent events.

The same path as ``/v1/chat/completions``: the model is resolved here and the answer is made by a
worker's inference service (``server/api/openai/completions.py``, ``server/worker/inference.py``),
batched with every other answer of that model; this process loads no model. The route checks the
key and finds the model with a short-lived session of its own: an open stream holds no database
connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from server import errors
from server.api.openai.completion_shapes import ContentPart
from server.api.openai.completions import FAILED, Answers, resolve
from server.api.openai.images import payload_messages
from server.errors import ApiError, documented
from server.schemas import GENERATION_STREAM, ChatMessage, GenerationCreate
from server.services import generation, inference
from server.services.generation import Target
from server.streams import frame, stream_key


class PlaygroundMessage(ChatMessage):
    """A chat message whose content may hold images for a vision-language model: text, or text and
    ``image_url`` parts as in OpenAI's chat completions (data URLs)."""

    content: str | list[ContentPart] = Field(  # type: ignore[assignment]
        description="text, or a list of {type: text, text} and {type: image_url, image_url: {url}} parts"
    )


class PlaygroundCreate(GenerationCreate):
    """``GenerationCreate`` whose messages may hold images."""

    messages: list[PlaygroundMessage] = Field(min_length=1, max_length=200)  # type: ignore[assignment]


router = APIRouter(prefix="/api/generate", tags=["generate"], responses=documented(400, 401, 404, 422, 503))


def find_target(request: Request, body: PlaygroundCreate) -> Target:
    """The model the body names (a base model, a fine-tuned name, or a job's checkpoint), or a
    404/422 naming the field."""
    settings = request.app.state.settings
    if body.messages[-1].role != "user":
        last = len(body.messages) - 1
        message = f"messages.{last}.role: the last message must be the user's"
        raise ApiError(422, "invalid_request", message, param=f"messages.{last}.role")
    ref = body.checkpoint
    if (body.model is None) == (ref is None):
        raise ApiError(
            422, "invalid_request", "model: give either model (a base model) or checkpoint", param="model"
        )
    if ref is None:
        try:
            return resolve(request, str(body.model))
        except ApiError as exc:
            raise ApiError(
                404 if exc.status == 404 else 422,
                "not_found" if exc.status == 404 else exc.code,
                exc.message,
                param="model",
            ) from exc
    try:
        with request.app.state.sessions() as session:
            return generation.checkpoint_target(
                session,
                job_id=ref.job_id,
                step=ref.step,
                models_dir=settings.models_dir,
                hf_cache=settings.hf_cache_dir,
                storage=request.app.state.storage,
                cache=settings.cache_dir,
            )
    except generation.NotFound as exc:
        raise ApiError(404, "not_found", str(exc), param=exc.param) from exc
    except generation.Refused as exc:
        raise ApiError(422, exc.code, str(exc), param=exc.param) from exc


def _error(exc: inference.Unavailable) -> str:
    return frame(data=errors.body(exc.code, exc.message, exc.param), event="error")


async def answer(request: Request, target: Target, body: PlaygroundCreate) -> AsyncIterator[str]:
    """The events of one answer as SSE frames; closing the stream stops the generation."""
    import httpx

    yield frame(data={"state": "loading", "model": target.name}, event="status")
    allow_urls = request.app.state.settings.allow_image_urls
    try:
        messages = await payload_messages(body.messages, allow_urls=allow_urls)
    except ApiError as exc:
        yield frame(data=errors.body(exc.code, exc.message, exc.param), event="error")
        return
    payload = {
        "messages": messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_tokens": body.max_tokens,
        "seed": body.seed,
        "fit": True,  # max_tokens as a bound: the answer stops at the context's end
    }
    answers = Answers(httpx.AsyncClient())
    try:
        await answers.open(request, target, [payload])
        start = answers.starts[0]
        yield frame(
            data={"state": "generating", "model": target.name, "placement": start.get("placement")},
            event="status",
        )
        async for _, event in answers.events():
            if event["type"] == "token" and event["text"]:
                yield frame(data={"text": event["text"]}, event="delta")
            elif event["type"] == "end":
                if event["reason"] in FAILED:
                    status, code = FAILED[event["reason"]]
                    message = event.get("error") or "the answer was cut off"
                    yield _error(inference.Unavailable(status, code, message))
                    return
                if event["text"]:
                    yield frame(data={"text": event["text"]}, event="delta")
                data = {
                    "finish_reason": event["reason"],
                    "prompt_tokens": start["prompt_tokens"],
                    "completion_tokens": event["tokens"],
                }
                yield frame(data=data, event="done")
    except inference.Unavailable as exc:
        yield _error(exc)
    finally:
        await answers.close()


@router.post(
    "",
    response_class=StreamingResponse,
    dependencies=[Depends(stream_key)],
    responses={200: GENERATION_STREAM},
)
async def generate(body: PlaygroundCreate, request: Request) -> Any:
    """Answer a chat on a worker's inference service, streamed: status, delta (text) events, then done."""
    target = await run_in_threadpool(find_target, request, body)
    return StreamingResponse(
        answer(request, target, body),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
