"""``/api/generate``: the chat playground's answers, streamed as server-sent events.

Generation runs on the API host's CPU (``server/services/generation.py``), never on the GPUs the
worker trains on. The route checks the key and finds the model with a short-lived session of its
own: an open stream holds no database connection.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.inference.chat import Finish, Piece, Sampling
from server import errors
from server.errors import ApiError, documented
from server.schemas import GENERATION_STREAM, GenerationCreate
from server.services import generation
from server.services.generation import Playground, Status, Target
from server.streams import frame, stream_key

router = APIRouter(prefix="/api/generate", tags=["generate"], responses=documented(400, 401, 404, 422))
_creating = threading.Lock()


def playground(request: Request) -> Playground:
    """The app's playground, made on first use (its threads start only then)."""
    state = request.app.state
    with _creating:
        if getattr(state, "playground", None) is None:
            settings = state.settings
            state.playground = Playground(
                threads=settings.playground_threads, cached=settings.playground_cached_models
            )
    return state.playground  # type: ignore[no-any-return]


def find_target(request: Request, body: GenerationCreate) -> Target:
    """The model the body names (a base model, or a job's checkpoint), or a 404/422 naming the field."""
    settings = request.app.state.settings
    where = {"models_dir": settings.models_dir, "hf_cache": settings.hf_cache_dir}
    stored = {"storage": request.app.state.storage, "cache": settings.cache_dir}
    limit = settings.playground_max_params
    if body.messages[-1].role != "user":
        last = len(body.messages) - 1
        message = f"messages.{last}.role: the last message must be the user's"
        raise ApiError(422, "invalid_request", message, param=f"messages.{last}.role")
    ref = body.checkpoint
    if (body.model is None) == (ref is None):
        raise ApiError(
            422, "invalid_request", "model: give either model (a base model) or checkpoint", param="model"
        )
    try:
        with request.app.state.sessions() as session:
            if ref is None:
                name = str(body.model)
                tuned = generation.fine_tuned_target(session, name=name, max_params=limit, **where, **stored)
                return tuned or generation.base_target(name=name, max_params=limit, **where)
            return generation.checkpoint_target(
                session, job_id=ref.job_id, step=ref.step, max_params=limit, **where, **stored
            )
    except generation.NotFound as exc:
        raise ApiError(404, "not_found", str(exc), param=exc.param) from exc
    except generation.Refused as exc:
        raise ApiError(422, exc.code, str(exc), param=exc.param) from exc


async def answer(playground: Playground, target: Target, request: GenerationCreate) -> AsyncIterator[str]:
    """The events of one answer as SSE frames; closing the stream stops the generation."""
    sampling = Sampling(request.temperature, request.top_p, request.max_tokens, request.seed)
    messages = [m.model_dump() for m in request.messages]
    async for event in playground.events(target, messages, sampling):
        if event is None:
            yield ": keep-alive\n\n"
        elif isinstance(event, Piece):
            yield frame(data={"text": event.text}, event="delta")
        elif isinstance(event, Status):
            yield frame(data={"state": event.state, "model": target.name}, event="status")
        elif isinstance(event, Finish):
            data = {
                "finish_reason": event.reason,
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
            }
            yield frame(data=data, event="done")
        elif isinstance(event, ValueError):  # the engine's: a conversation longer than the context
            message = str(event)
            param = message.split(":", 1)[0] if ":" in message else "messages"
            yield frame(data=errors.body("invalid_request", message, param), event="error")
        else:
            yield frame(data=errors.body("generation_failed", f"{target.name}: {event}"), event="error")


@router.post(
    "",
    response_class=StreamingResponse,
    dependencies=[Depends(stream_key)],
    responses={200: GENERATION_STREAM},
)
def generate(
    body: GenerationCreate,
    target: Annotated[Target, Depends(find_target)],
    pool: Annotated[Playground, Depends(playground)],
) -> Any:
    """Answer a chat on the API host's CPU, streamed: status, delta (text) events, then done."""
    return StreamingResponse(
        answer(pool, target, body),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
