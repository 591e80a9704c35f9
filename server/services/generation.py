"""The chat playground: answers from a base model or a job's checkpoint, streamed as they are made.

Where it runs: on the API host's CPU, in a small thread pool of the API process
(``playground_threads``, 2 by default), never on the training GPUs: the worker owns those, and a
job that trains goes on untouched while the playground keeps answering on the CPU. One generation
at a time per model (a second request for the same model waits its turn); the loaded models are
kept in a small LRU cache (``playground_cached_models``); a model with more than
``playground_max_params`` parameters is refused before anything is loaded. Closing the stream (the
client went away) sets a cancel flag that the sampling loop reads after every token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from engine.inference.chat import Finish, Piece, Sampling, chat_stream
from server.services import checkpoints, fine_tuned, jobs, models
from server.storage import Storage

KEEPALIVE_S = 15.0
log = logging.getLogger(__name__)


class NotFound(LookupError):
    """No such model, job or checkpoint; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Refused(ValueError):
    """A model the playground does not run (unsupported, too large); ``param`` names the field."""

    def __init__(self, code: str, param: str, message: str) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class Target:
    """What to load: a model folder (or ``demo``), optionally with a LoRA adapter folder on it."""

    name: str  # as the request named it, for messages
    model: str
    adapter: str | None
    models_dir: Path

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.model, self.adapter)


def _check_size(parameters: int, *, max_params: int, name: str, param: str) -> None:
    if parameters > max_params:
        raise Refused(
            "model_too_large",
            param,
            f"{name} has {parameters:,} parameters; the playground runs models of at most "
            f"{max_params:,} on the API host's CPU (ROUNDHOUSE_PLAYGROUND_MAX_PARAMS)",
        )


def _parameters(info: models.BaseModelInfo) -> int:
    # no safetensors header to count from: the size of the files as 2-byte weights (an overestimate
    # for fp32 files, so a model is refused rather than loaded when in doubt)
    return info.parameters if info.parameters is not None else info.size_bytes // 2


def base_target(*, name: str, models_dir: Path, hf_cache: Path | None, max_params: int) -> Target:
    """A base model from ``GET /api/models`` by name.

    Raises:
        NotFound: (``model``) no such model.
        Refused: (``model``) the engine does not support it, or it is above ``max_params``.
    """
    info = models.find(name, models_dir, hf_cache)
    if info is None:
        raise NotFound("model", f"no base model {name!r} (see GET /api/models)")
    if not info.supported:
        raise Refused("unsupported_model", "model", f"base model {name!r}: {info.unsupported_reason}")
    _check_size(_parameters(info), max_params=max_params, name=f"base model {name!r}", param="model")
    model = str(info.path) if info.path is not None and info.ready else name  # "demo": prepared on load
    return Target(name, model, None, models_dir)


def checkpoint_target(
    session: Session,
    *,
    job_id: str,
    step: int,
    models_dir: Path,
    hf_cache: Path | None,
    max_params: int,
    storage: Storage,
    cache: Path,
) -> Target:
    """A job's checkpoint: a full model folder, or a LoRA adapter on the job's base model. Its
    export is read where the store keeps it (a local store), or pulled once into ``cache``.

    Raises:
        NotFound: (``checkpoint.job_id``, ``checkpoint.step``) no such job or checkpoint on disk;
            (``checkpoint``) the adapter's base model is gone.
        Refused: (``checkpoint``) its base model is unsupported or above ``max_params``.
    """
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise NotFound("checkpoint.job_id", f"no job {job_id!r}")
    found = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if found is None:
        raise NotFound("checkpoint.step", f"job {job.id!r} has no checkpoint at step {step}")
    key = storage.key_of(found.path)
    name = f"job {job.id[:8]} step {step}"
    info = models.find(job.base_model, models_dir, hf_cache)
    if info is not None:
        if not info.supported:
            raise Refused("unsupported_model", "checkpoint", f"{name}: {info.unsupported_reason}")
        _check_size(_parameters(info), max_params=max_params, name=name, param="checkpoint")
    if found.kind != "adapter":
        if info is None:  # its base is gone; the export's own weights are fp32
            weights = [
                s for k, s in storage.list(key) if "/" not in k[len(key) + 1 :] and k.endswith(".safetensors")
            ]
            _check_size(sum(weights) // 4, max_params=max_params, name=name, param="checkpoint")
        return Target(name, str(checkpoints.export_folder(storage, key, cache=cache)), None, models_dir)
    base = str((job.config.get("model") or {}).get("path") or "")
    if base != "demo" and not (Path(base) / "config.json").is_file():
        raise NotFound("checkpoint", f"{name} is a LoRA adapter on {job.base_model!r}, which is gone")
    return Target(name, base, str(checkpoints.export_folder(storage, key, cache=cache)), models_dir)


def fine_tuned_target(
    session: Session,
    *,
    name: str,
    models_dir: Path,
    hf_cache: Path | None,
    max_params: int,
    storage: Storage,
    cache: Path,
) -> Target | None:
    """A fine-tuned model or checkpoint by the name the OpenAI-compatible API gives it
    (``ft:<base>:<suffix>:<job id>[:ckpt-step-<step>]``, the job's latest checkpoint without a
    step); None for a name that is not one (a base model's).

    Raises:
        NotFound, Refused: (``model``) as :func:`checkpoint_target`, or no such job or checkpoint.
    """
    if fine_tuned.parse_model(name) is None:
        return None
    try:
        job, found = fine_tuned.resolve_model(session, name=name, storage=storage)
        target = checkpoint_target(
            session,
            job_id=job.id,
            step=found.step,
            models_dir=models_dir,
            hf_cache=hf_cache,
            max_params=max_params,
            storage=storage,
            cache=cache,
        )
    except LookupError as exc:  # NotFound too
        raise NotFound("model", str(exc)) from exc
    except Refused as exc:
        raise Refused(exc.code, "model", str(exc)) from exc
    return Target(name, target.model, target.adapter, target.models_dir)


def _load(target: Target) -> tuple[Any, Any]:
    from engine.inference.generate import load_for_inference
    from engine.model.loading import resolve_model_path

    folder = resolve_model_path(target.model, target.models_dir)
    return load_for_inference(folder, adapter=target.adapter)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Status:
    state: str  # waiting (another answer of this model runs), loading, generating


Event = Status | Piece | Finish
_DONE = object()


class Playground:
    """The playground of one app: its thread pool, its loaded models and their locks."""

    def __init__(
        self, *, threads: int, cached: int, load: Callable[[Target], tuple[Any, Any]] = _load
    ) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="playground")
        self.cached, self.load = cached, load
        self._models: OrderedDict[tuple[str, str | None], tuple[Any, Any]] = OrderedDict()
        self._locks: dict[tuple[str, str | None], threading.Lock] = {}
        self._guard = threading.Lock()
        self._loading = threading.Lock()

    def lock_of(self, target: Target) -> threading.Lock:
        """The lock held while ``target`` loads or answers."""
        with self._guard:
            return self._locks.setdefault(target.key, threading.Lock())

    def _loaded(self, target: Target, emit: Callable[[Event], None]) -> tuple[Any, Any]:
        with self._guard:
            hit = self._models.get(target.key)
            if hit is not None:
                self._models.move_to_end(target.key)
                return hit
        emit(Status("loading"))
        with self._loading:  # one load at a time: transformers' lazy imports are not thread-safe
            loaded = self.load(target)
        with self._guard:
            self._models[target.key] = loaded
            while len(self._models) > self.cached:  # the least recently used goes
                self._models.popitem(last=False)
        return loaded

    def run(
        self,
        target: Target,
        messages: list[dict[str, str]],
        sampling: Sampling,
        *,
        cancel: threading.Event,
        emit: Callable[[Event], None],
    ) -> None:
        """One answer, in the calling thread, each event handed to ``emit``; returns early once
        ``cancel`` is set (also while it waits for the model)."""
        lock = self.lock_of(target)
        if not lock.acquire(blocking=False):
            emit(Status("waiting"))
            while not lock.acquire(timeout=0.2):
                if cancel.is_set():
                    return
        try:
            if cancel.is_set():
                return
            model, tokenizer = self._loaded(target, emit)
            emit(Status("generating"))
            for event in chat_stream(model, tokenizer, messages, sampling=sampling, cancel=cancel):
                emit(event)
        finally:
            lock.release()

    async def events(
        self,
        target: Target,
        messages: list[dict[str, str]],
        sampling: Sampling,
        *,
        cancel: threading.Event | None = None,
    ) -> AsyncIterator[Event | Exception | None]:
        """The events of one answer as it is made in the pool; None every ``KEEPALIVE_S`` of
        silence; an exception it raised as the last item. Closing the iterator cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = cancel or threading.Event()

        def emit(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                self.run(target, messages, sampling, cancel=cancel, emit=emit)
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    log.exception("playground: %s failed", target.name)
                emit(exc)
            finally:
                emit(_DONE)

        self.pool.submit(work)
        try:
            while True:
                try:
                    async with asyncio.timeout(KEEPALIVE_S):
                        item = await queue.get()
                except TimeoutError:
                    yield None
                    continue
                if item is _DONE:
                    return
                yield item
        finally:
            cancel.set()
