"""Continuous batching: the answers of one base model decoded together, one forward per step.

A ``Batcher`` runs one decode thread over the models it is given. Each request (``Ask``) is
prefilled alone (its prompt once, whatever its ``n``); its KV cache is repeated for each of its
``n`` choices and joined to its model's running batch: every cache is left-padded to one length,
and each step feeds every active choice's last token in one forward, with an attention mask that
hides the padding and each row's own position ids. Choices leave the batch when they end, and the
columns only padding is left in are cut off. A request that joins waits at most one step.

LoRA adapters share their base: a ``Model`` wraps its base in one ``PeftModel`` that holds every
adapter asked for, and peft's ``adapter_names`` picks each row's adapter in the same forward
(``"__base__"``: none), so the base is loaded once and never merged.

Only plain growing caches (``DynamicLayer``) are joined; a model with sliding-window or recurrent
layers decodes each request as its own batch (its ``n`` choices together).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engine.inference.chat import Sampling, context_length, pick
from engine.inference.images import Prompt, next_position, on_device, rope_holder
from engine.inference.text import StopText

BASE = "__base__"  # peft's adapter name for "no adapter" in a mixed batch
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Token:
    """A new token of choice ``index``: the text it lets through (may be empty) and, when asked,
    its log-probability and the ``top`` likeliest (token, log-probability) at its position."""

    index: int
    token: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class End:
    """The end of choice ``index``: ``stop`` (a stop token or string), ``length`` (its budget),
    ``cancelled`` (the asker went away), ``preempted`` (the model was unloaded), ``error``."""

    index: int
    reason: Literal["stop", "length", "cancelled", "preempted", "error"]
    tokens: int
    text: str = ""  # the last of the text, held back until now
    error: str | None = None


Event = Token | End


@dataclass
class Ask:
    """One request: a prompt's token ids and how to answer it, ``n`` times.

    ``emit`` is called from the decode thread with each ``Token`` and one ``End`` per choice.
    ``inputs``: a VLM prompt's image tensors (``engine.inference.images.Prompt.inputs``), given
    to its prefill only.
    ``adapter`` is a name from ``Model.adapter``; ``logprobs``: None for none, k for the chosen
    token's log-probability and the k likeliest. Choice i samples with ``seed + i``.
    """

    ids: list[int]
    sampling: Sampling
    tokenizer: Any
    emit: Callable[[Event], None]
    n: int = 1
    stop_ids: frozenset[int] = frozenset()
    stop_texts: tuple[str, ...] = ()
    adapter: str | None = None
    logprobs: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


class Closed(RuntimeError):
    """The model was unloaded (or is being unloaded): it takes no new requests."""


@dataclass
class _Row:
    ask: Ask
    index: int
    generator: torch.Generator
    text: StopText
    budget: int
    position: int  # real tokens before the next one (its position id)
    last: int = -1
    count: int = 0


@dataclass
class _Batch:
    rows: list[_Row]
    cache: Any
    mask: torch.Tensor  # [rows, cache length]: 0 over the left padding


def _joinable(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], n, t.shape[-1]), t], dim=-2)


class Model:
    """A base model on its device(s), with the LoRA adapters loaded on it and its running batches."""

    def __init__(self, module: Any, *, name: str = "") -> None:
        self.module = module.eval()
        self.name = name
        self.adapters: dict[str, str] = {}  # adapter folder -> its name on the model
        self.batches: list[_Batch] = []
        self.lock = threading.Lock()  # held during a step and while an adapter loads
        self.closed = False
        self.context = context_length(module)
        self.device = next(module.parameters()).device
        self.rope = rope_holder(module)  # Qwen2.5-VL's: where a prompt's images leave the positions
        # the KV cache's keyword: ``cache`` from transformers 5.2x, ``past_key_values`` before
        self.cache_keyword = (
            "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        )

    def adapter(self, folder: str) -> str:
        """The name of the adapter in ``folder`` on this model, loading it on first use."""
        with self.lock:
            if folder in self.adapters:
                return self.adapters[folder]
            from peft import PeftModel

            name = f"a{len(self.adapters)}"
            if isinstance(self.module, PeftModel):
                self.module.load_adapter(folder, adapter_name=name)
            else:
                self.module = PeftModel.from_pretrained(self.module, folder, adapter_name=name)
            self.module.eval()
            self.adapters[folder] = name
            return name

    @property
    def active(self) -> int:
        return sum(len(b.rows) for b in self.batches)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: Any, rows: list[_Row], **kw: Any
    ) -> tuple[torch.Tensor, Any]:
        if self.adapters:  # a PeftModel: each row's adapter
            kw["adapter_names"] = [r.ask.adapter or BASE for r in rows]
        kw[self.cache_keyword] = cache
        out = self.module(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **kw,
        )
        return out.logits, getattr(out, self.cache_keyword)


def _choose(row: _Row, logits: torch.Tensor) -> End | None:
    """Sample ``row``'s next token from its ``[vocab]`` logits and emit it; its ``End`` if it ends there."""
    ask = row.ask
    token = pick(logits, ask.sampling, row.generator)
    row.count += 1
    row.last = token
    if token in ask.stop_ids:
        return End(row.index, "stop", row.count, row.text.rest())
    logprob = top = None
    if ask.logprobs is not None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        logprob = float(logp[token])
        if ask.logprobs:
            values, ids = torch.topk(logp, min(ask.logprobs, logp.numel()))
            top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    ask.emit(Token(row.index, token, row.text.add(token), logprob, top))
    if row.text.stopped:
        return End(row.index, "stop", row.count)
    if row.count >= row.budget:
        return End(row.index, "length", row.count, row.text.rest())
    return None


class Batcher:
    """The decode thread of a set of models: requests join their model's batch between steps."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Model, Ask]] = deque()
        self._models: list[Model] = []
        self._drops: dict[int, tuple[float, threading.Event]] = {}  # id(model) -> (deadline, done)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0  # forwards run (prefills included), for tests and benchmarks

    def start(self) -> Batcher:
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="decode", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(30)

    def submit(self, model: Model, ask: Ask) -> None:
        """Queue ``ask`` on ``model``; its events come through ``ask.emit``.

        Raises:
            ValueError: bad sampling values, no prompt, or a prompt that fills the context.
            Closed: the model is unloaded or being unloaded.
        """
        ask.sampling.check()
        if not ask.ids:
            raise ValueError("prompt: the rendered prompt is empty")
        if model.context is not None and len(ask.ids) >= model.context:
            raise ValueError(f"prompt: {len(ask.ids)} tokens; the model's context is {model.context}")
        if ask.n < 1:
            raise ValueError(f"n: must be at least 1 (got {ask.n})")
        with self._wake:
            if model.closed or id(model) in self._drops:
                raise Closed(f"{model.name} is being unloaded")
            if model not in self._models:
                self._models.append(model)
            self._pending.append((model, ask))
            self._wake.notify_all()

    def drop(self, model: Model, *, grace_s: float) -> None:
        """Unload ``model``: no new requests; its answers get ``grace_s`` seconds to finish, then
        end ``preempted``. Returns once it is gone from the decode thread."""
        done = threading.Event()
        with self._wake:
            if model.closed:
                return
            self._drops[id(model)] = (time.monotonic() + grace_s, done)
            self._wake.notify_all()
        if self._thread is None:
            self._retire(model)
            return
        done.wait()

    # -- the decode thread ----------------------------------------------------------------
    def _retire(self, model: Model) -> None:
        with self._wake:
            for batch in model.batches:
                for row in batch.rows:
                    row.ask.emit(End(row.index, "preempted", row.count, error=f"{model.name} was unloaded"))
            model.batches = []
            model.closed = True
            kept = [(m, a) for m, a in self._pending if m is not model]
            for m, a in self._pending:
                if m is model:
                    for i in range(a.n):
                        a.emit(End(i, "preempted", 0, error=f"{model.name} was unloaded"))
            self._pending = deque(kept)
            if model in self._models:
                self._models.remove(model)
            entry = self._drops.pop(id(model), None)
        if entry is not None:
            entry[1].set()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._pending and not any(m.batches for m in self._models):
                    if self._drops:
                        break
                    self._wake.wait()
                if self._stop:
                    return
                pending, self._pending = list(self._pending), deque()
                models = list(self._models)
                drops = dict(self._drops)
            for model, ask in pending:
                self._guard(model, lambda m=model, a=ask: self._prefill(m, a), [ask])  # type: ignore[misc]
            for model in models:
                entry = drops.get(id(model))
                if entry is not None and (not model.active or time.monotonic() >= entry[0]):
                    self._retire(model)
                    continue
                for batch in list(model.batches):
                    self._guard(model, lambda m=model, b=batch: self._step(m, b), [r.ask for r in batch.rows])  # type: ignore[misc]

    def _guard(self, model: Model, work: Callable[[], None], asks: list[Ask]) -> None:
        """Run ``work`` under the model's lock; an exception ends the rows it touched with ``error``."""
        try:
            with model.lock, torch.inference_mode():
                work()
        except Exception as exc:
            log.exception("decoding %s failed", model.name)
            failed = {id(a) for a in asks}
            for batch in list(model.batches):
                for row in batch.rows:
                    if id(row.ask) in failed:
                        row.ask.emit(End(row.index, "error", row.count, error=str(exc)))
                if any(id(r.ask) in failed for r in batch.rows):
                    model.batches.remove(batch)  # its cache may be half-updated
                    for row in batch.rows:
                        if id(row.ask) not in failed:
                            row.ask.emit(End(row.index, "error", row.count, error=str(exc)))

    def _prefill(self, model: Model, ask: Ask) -> None:
        ids = torch.tensor([ask.ids])
        mask = torch.ones_like(ids)
        room = ask.sampling.max_tokens if model.context is None else model.context - len(ask.ids)
        budget = min(ask.sampling.max_tokens, room)
        rows = []
        for i in range(ask.n):
            generator = torch.Generator()
            if ask.sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(ask.sampling.seed + i)
            text = StopText(ask.tokenizer, ask.stop_texts)
            rows.append(_Row(ask, i, generator, text, budget, position=len(ask.ids)))
        if ask.cancel.is_set():
            for row in rows:
                ask.emit(End(row.index, "cancelled", 0))
            return
        logits, cache = model._forward(ids, mask, None, rows[:1], **on_device(ask.inputs, model.module))
        self.steps += 1
        # a prompt's images may move the positions after it (Qwen2.5-VL's 3-D rotary positions)
        position = next_position(model.rope, Prompt(ask.ids, ask.inputs))
        for row in rows:
            row.position = position
        logits = logits[0, -1].float().cpu()
        keep = []
        for i, row in enumerate(rows):
            end = _choose(row, logits)
            if end is not None:
                ask.emit(end)
            else:
                keep.append(i)
        if not keep:
            return
        if ask.n > 1:
            cache.batch_repeat_interleave(ask.n)
        batch = _Batch([rows[i] for i in keep], cache, mask.expand(ask.n, -1).clone())
        if len(keep) < ask.n:
            self._select(batch, keep)
        self._join(model, batch)

    @staticmethod
    def _select(batch: _Batch, keep: list[int]) -> None:
        """Keep rows ``keep`` of the cache and mask (``batch.rows`` is already the kept rows);
        cut the columns that are padding in every kept row."""
        mask = batch.mask[keep]
        start = int((mask.sum(0) > 0).nonzero()[0]) if mask.numel() else 0
        batch.mask = mask[:, start:]
        for layer in batch.cache.layers:
            index = torch.tensor(keep, device=layer.keys.device)
            layer.keys = layer.keys[index][..., start:, :]
            layer.values = layer.values[index][..., start:, :]

    @staticmethod
    def _join(model: Model, new: _Batch) -> None:
        target = next((b for b in model.batches if _joinable(b.cache)), None)
        if target is None or not _joinable(new.cache):
            model.batches.append(new)
            return
        length = max(target.mask.shape[1], new.mask.shape[1])
        pads = (length - target.mask.shape[1], length - new.mask.shape[1])
        for old, add in zip(target.cache.layers, new.cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, pads[0]), _pad_left(add.keys, pads[1])])
            old.values = torch.cat([_pad_left(old.values, pads[0]), _pad_left(add.values, pads[1])])
        masks = [
            torch.cat([m.new_zeros(m.shape[0], p), m], dim=1)
            for m, p in zip((target.mask, new.mask), pads, strict=True)
        ]
        target.mask = torch.cat(masks)
        target.rows += new.rows

    def _step(self, model: Model, batch: _Batch) -> None:
        rows = batch.rows
        ended = {i for i, r in enumerate(rows) if r.ask.cancel.is_set()}
        for i in ended:
            rows[i].ask.emit(End(rows[i].index, "cancelled", rows[i].count))
        if len(ended) < len(rows):
            ids = torch.tensor([[r.last] for r in rows])
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(rows), 1)], dim=1)
            positions = torch.tensor([[r.position] for r in rows], device=model.device)
            logits, batch.cache = model._forward(ids, batch.mask, batch.cache, rows, position_ids=positions)
            self.steps += 1
            logits = logits[:, -1].float().cpu()
            for i, row in enumerate(rows):
                row.position += 1
                if i in ended:
                    continue
                end = _choose(row, logits[i])
                if end is not None:
                    row.ask.emit(end)
                    ended.add(i)
        if not ended:
            return
        keep = [i for i in range(len(rows)) if i not in ended]
        batch.rows = [rows[i] for i in keep]
        if not keep:
            model.batches.remove(batch)
            return
        self._select(batch, keep)
