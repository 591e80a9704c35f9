"""The worker host's inference service: a process beside the Celery worker that answers prompts.

``roundhouse worker`` starts it (``server/worker/inference_link.py``) on a local port with a
random token, and records the address in its ``workers`` row; the API forwards ``/v1/chat/completions``,
``/v1/completions`` and the playground here and never loads a model itself. One decode thread
batches every answer of a model per step (``engine.inference.batching``). Before a job takes the
devices, the worker posts ``/training``: models in the way are unloaded (answers in flight get
``release_grace_s`` to finish) before it returns.

A conversation may hold images (parts ``{"type": "image", "data": <base64>}``, which the API makes
of ``image_url`` parts): a VLM's processor renders it and its image tensors go into the prompt's
first forward (``engine.inference.images``); a text-only model refuses them with a 400 naming the
part, before it is loaded.

Routes (internal; bearer token): ``POST /generate`` (an NDJSON stream of ``start``, ``token`` and
``end`` lines, or an error status with ``{"code", "message", "param"}``), ``POST /training``,
``GET /health``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from server.worker.inference_models import Busy, Models

log = logging.getLogger("roundhouse.inference")
KEEPALIVE_S = 10.0
MAX_TOKENS = 4096  # engine.inference.chat.MAX_TOKENS: the most new tokens of one answer


class GenerateBody(BaseModel):
    """One request as the API forwards it: a resolved model and OpenAI's sampling parameters."""

    name: str  # the model as the request named it, for messages
    model: str  # the base model's folder
    adapter: str | None = None  # a LoRA adapter's folder, served on the base
    parameters: int = 0  # the base model's parameter count
    models_dir: str = ""  # where "demo" is prepared
    # content: text, or parts {"type": "text", "text"} and {"type": "image", "data": <base64 bytes>}
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    fit: bool = False  # max_tokens is an upper bound (the playground), not a demand to refuse at the context
    seed: int | None = None
    stop: list[str] = []
    logprobs: int | None = None


class TrainingBody(BaseModel):
    training: bool


def _error(status: int, code: str, message: str, param: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"code": code, "message": message, "param": param}, status_code=status, headers=headers
    )


class Service:
    def __init__(self, *, token: str, gpus: int, cpu_max_params: int, release_grace_s: float) -> None:
        from engine.inference import Batcher

        self.token = token
        self.models = Models(gpus=gpus, cpu_max_params=cpu_max_params)
        self.batcher = Batcher().start()
        self.release_grace_s = release_grace_s
        self.training_lock = threading.Lock()
        self.processors: dict[str, Any] = {}  # model folder -> its VLM processor, or None
        self.processors_lock = threading.Lock()

    def processor(self, folder: str) -> Any:
        """The processor of a VLM folder (its LoRA adapters use it too); None for a text model."""
        from engine.inference import load_processor

        with self.processors_lock:
            if folder not in self.processors:
                self.processors[folder] = load_processor(folder)
            return self.processors[folder]

    def release(self, training: bool) -> list[str]:
        """A job starts (``training``) or ended: unload what is in the way; the names unloaded."""
        with self.training_lock:
            going = self.models.set_training(training)
            for loaded in going:
                self.batcher.drop(loaded.model, grace_s=self.release_grace_s)
                self.models.free(loaded)
        return [m.model.name for m in going]


def _messages(body: GenerateBody) -> list[dict[str, Any]]:
    """The conversation with each image part's bytes decoded (the engine's image parts).

    Raises:
        ValueError: an image part without valid base64 ``data`` (the message names it).
    """
    import base64
    import binascii

    out = []
    for i, m in enumerate(body.messages or []):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image":
                    try:
                        part = {
                            "type": "image",
                            "image": base64.b64decode(part.get("data") or "", validate=True),
                        }
                    except (binascii.Error, ValueError):
                        raise ValueError(f"messages.{i}.content.{j}: the image's base64 is invalid") from None
                parts.append(part)
            content = parts
        out.append({**m, "content": content})
    return out


def _image_field(messages: list[dict[str, Any]]) -> str | None:
    return next(
        (
            f"messages.{i}.content.{j}"
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"])
            if isinstance(p, dict) and p.get("type") == "image"
        ),
        None,
    )


def _prompt(body: GenerateBody, messages: list[dict[str, Any]] | None, tokenizer: Any, processor: Any) -> Any:
    """The request's prompt (``engine.inference.Prompt``): the chat through the template (and the
    VLM's processor, for images), or a completion prompt as it is."""
    from engine.inference import Prompt, chat_prompt

    if messages is not None:
        if processor is not None and _image_field(messages) is not None:
            return chat_prompt(processor.tokenizer, messages, processor=processor)
        return chat_prompt(tokenizer, messages)
    return Prompt(list(tokenizer(body.prompt or "", add_special_tokens=True)["input_ids"]))


def _budget(body: GenerateBody, prompt: int, context: int | None) -> int | JSONResponse:
    """The most new tokens of each answer, or the 400 OpenAI answers when it cannot fit."""
    where = "messages" if body.messages is not None else "prompt"
    demanded = 0 if body.fit else body.max_tokens or 0
    if context is not None and (prompt >= context or prompt + demanded > context):
        asked = f" However, you requested {prompt + demanded} tokens ({prompt} in the {where}"
        asked += f", {demanded} in the completion)." if demanded else ")."
        message = f"This model's maximum context length is {context} tokens.{asked} Please reduce the length."
        return _error(400, "context_length_exceeded", message, where)
    room = MAX_TOKENS if context is None else min(MAX_TOKENS, context - prompt)
    if body.max_tokens is not None and body.max_tokens > MAX_TOKENS:
        return _error(
            400, "invalid_value", f"max_tokens: at most {MAX_TOKENS} (got {body.max_tokens})", "max_tokens"
        )
    return min(body.max_tokens, room) if body.max_tokens else room


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="Roundhouse inference", docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(authorization: Annotated[str, Header()] = "") -> None:
        if not hmac.compare_digest(authorization.encode(), f"Bearer {service.token}".encode()):
            from fastapi import HTTPException

            raise HTTPException(401, "bad token")

    @app.get("/health", dependencies=[Depends(authorized)])
    def health() -> dict[str, Any]:
        models = [{"name": m.model.name, "placement": m.placement} for m in service.models.loaded.values()]
        return {"training": service.models.training, "gpus": service.models.gpus, "models": models}

    @app.post("/training", dependencies=[Depends(authorized)])
    def training(body: TrainingBody) -> dict[str, Any]:
        return {"training": body.training, "unloaded": service.release(body.training)}

    @app.post("/generate", dependencies=[Depends(authorized)], response_model=None)
    async def generate(body: GenerateBody, request: Request) -> StreamingResponse | JSONResponse:
        from engine.inference import Ask, Closed, End, Sampling, Token, check_messages, stop_ids
        from engine.model import resolve_model_path

        images = _image_field(body.messages or [])
        try:
            folder = str(await run_in_threadpool(resolve_model_path, body.model, body.models_dir))
            processor = await run_in_threadpool(service.processor, folder) if images else None
        except Exception as exc:  # a folder transformers cannot load
            log.exception("loading the processor of %s failed", body.name)
            return _error(500, "model_load_failed", f"{body.name}: could not be loaded: {exc}", "model")
        if images and processor is None:  # before the model loads: it would not read them
            message = f"{images}: {body.name} is a text-only model: it reads no images (give text parts only)"
            return _error(400, "invalid_request", message, images)
        try:
            loaded = await run_in_threadpool(
                service.models.get, folder, parameters=body.parameters, name=body.name
            )
            tokenizer = await run_in_threadpool(service.models.tokenizer, body.adapter or folder)
            model = loaded.model
            adapter = await run_in_threadpool(model.adapter, body.adapter) if body.adapter else None
        except Busy as exc:
            return _error(503, "gpus_training", str(exc), "model", **{"Retry-After": str(exc.retry_after)})
        except Exception as exc:  # a folder transformers cannot load
            log.exception("loading %s failed", body.name)
            return _error(500, "model_load_failed", f"{body.name}: could not be loaded: {exc}", "model")
        try:
            messages = _messages(body) if body.messages is not None else None
            if messages is not None:
                check_messages(messages)
            prompt = await run_in_threadpool(_prompt, body, messages, tokenizer, processor)
        except ValueError as exc:  # a bad part or image: the message names its field
            field = str(exc).split(":", 1)[0]
            param = field if field.startswith("messages.") else "messages"
            message = str(exc) if field.startswith("messages") else f"messages: {exc}"
            return _error(400, "invalid_request", message, param)
        except Exception as exc:  # the chat template refused the conversation
            return _error(400, "invalid_request", f"messages: {exc}", "messages")
        ids = prompt.ids
        budget = _budget(body, len(ids), model.context)
        if isinstance(budget, JSONResponse):
            return budget
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(event: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
                loop.call_soon_threadsafe(queue.put_nowait, event)

        sampling = Sampling(body.temperature, body.top_p, budget, body.seed)
        ask = Ask(
            ids,
            sampling,
            tokenizer,
            emit,
            n=body.n,
            stop_ids=frozenset(stop_ids(model.module, tokenizer)),
            stop_texts=tuple(body.stop),
            adapter=adapter,
            logprobs=body.logprobs,
            inputs=prompt.inputs,
        )
        try:
            service.batcher.submit(model, ask)
        except ValueError as exc:
            return _error(400, "invalid_request", str(exc), str(exc).split(":", 1)[0])
        except Closed as exc:
            return _error(503, "gpus_training", str(exc), "model", **{"Retry-After": "30"})

        def token_text(token: int) -> str:
            return str(tokenizer.decode([token]))

        async def lines() -> AsyncIterator[str]:
            import json

            yield (
                json.dumps({"type": "start", "prompt_tokens": len(ids), "placement": loaded.placement}) + "\n"
            )
            open_choices = body.n
            try:
                while open_choices:
                    try:
                        async with asyncio.timeout(KEEPALIVE_S):
                            event = await queue.get()
                    except TimeoutError:
                        yield '{"type": "ping"}\n'
                        continue
                    if isinstance(event, Token):
                        line: dict[str, Any] = {"type": "token", "index": event.index, "text": event.text}
                        if event.logprob is not None:
                            line["token"] = token_text(event.token)
                            line["logprob"] = event.logprob
                            line["top"] = [[token_text(t), lp] for t, lp in event.top or ()]
                        yield json.dumps(line) + "\n"
                    elif isinstance(event, End):
                        open_choices -= 1
                        end = {
                            "type": "end",
                            "index": event.index,
                            "reason": event.reason,
                            "tokens": event.tokens,
                        }
                        yield json.dumps({**end, "text": event.text, "error": event.error}) + "\n"
            finally:
                ask.cancel.set()  # the client went away: its rows leave the batch at the next step

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _watch_parent(parent: int) -> None:
    """Exit when the worker that started this process is gone (its SIGKILL leaves no other trace)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    import torch
    import uvicorn

    from server.settings import get_settings

    parser = argparse.ArgumentParser(prog="python -m server.worker.inference")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    token = sys.stdin.readline().strip()  # from the worker: never on the command line
    if not token:
        print("no token on stdin", file=sys.stderr)
        return 2
    settings = get_settings()
    gpus = torch.cuda.device_count()  # what this process can load on (not a test's worker_gpus)
    logging.basicConfig(level=logging.INFO, format="[inference] %(levelname)s %(message)s")
    service = Service(
        token=token,
        gpus=gpus,
        cpu_max_params=settings.inference_cpu_max_params,
        release_grace_s=settings.inference_release_seconds,
    )
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
