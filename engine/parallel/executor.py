"""Stage workers: one thread per device, running the slots the schedule hands it, in order.

A worker is stateless between stages: it uploads a stage's weights from the host compute copy,
runs every micro-batch of the round through it, sends activations, input gradients and weight
gradients back to host memory, and forgets the stage. While it computes one stage it prefetches
the next stage queued on it, its parameters cut into micro-batch windows (``plan_windows``),
each window's copy queued behind that micro-batch's activation copy.

Forward stages run without autograd and keep the hidden states at every boundary where a
backward stage starts (its recompute input). The fused stage runs its layers, the loss and the
backward together. A backward stage recomputes its layers from the kept input — with the same
dropout seeds as the forward — and back-propagates the gradient arriving from the stage above.
Backward runs layer by layer, so per-layer times can be measured for the partitioner.
A stage run also records its waits, copies and prefetch, and the worker's idle gap before an
iteration (``engine.parallel.activity``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.func import functional_call

from engine.errors import Cancelled, EngineError
from engine.kinds import LayerKind
from engine.model.adapter import PARAMETRIZE_LOCK, Layer, run_layer
from engine.parallel.activity import ACTIVATIONS, WEIGHTS, IdleGaps
from engine.parallel.board import Iteration
from engine.parallel.context import WorkerContext
from engine.parallel.gradients import send_gradients
from engine.parallel.pairs import adapters_disabled
from engine.parallel.replica import meta_copy, rng_lock
from engine.parallel.routing import RouterAccounting
from engine.parallel.transfer import DeviceLink, plan_windows
from engine.scheduling.partition import Stage, StageKind
from engine.scheduling.schedule import SlotRun

Params = dict[int, dict[str, torch.Tensor]]  # layer -> local name -> device tensor


class Worker:
    """One device of the pool and the thread that drives it."""

    def __init__(self, index: int, device: torch.device, context: WorkerContext) -> None:
        self.index = index
        self.device = device
        self.context = context
        self.host = context.host
        self.board = context.board
        self.link = DeviceLink(device)
        self.modules = [meta_copy(layer.module) for layer in context.model.layers]
        self.parametrized = [layer.parametrized for layer in context.model.layers]
        self.rotary = copy.deepcopy(context.model.rotary).to(device)
        self.routing = RouterAccounting(context.router_loss, self.modules, self.link, self.board)
        self.queue: deque[tuple[Iteration, SlotRun]] = deque()
        self.prefetched: dict[int, tuple[Params, Any]] = {}
        self.prefetch_oom = 0  # prefetches given up for want of device memory
        self.waits: list[tuple[str, Any, Any]] = []  # the running stage's (kind, start, end)
        self.idle = IdleGaps(index)
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"roundpipe-worker-{index}", daemon=True)
        self.thread.start()

    def __repr__(self) -> str:
        return f"worker {self.index} ({self.device})"

    # -- queue -----------------------------------------------------------------------------
    def enqueue(self, it: Iteration, run: SlotRun) -> None:
        with self.board.cv:
            self.queue.append((it, run))
            self.board.cv.notify_all()

    def stop(self) -> None:
        with self.board.cv:
            self.stopping = True
            self.board.cv.notify_all()
        self.thread.join()
        self.prefetched.clear()

    def _next(self) -> tuple[Iteration, SlotRun] | None:
        with self.board.cv:
            while not self.queue:
                if self.stopping:
                    return None
                self.board.cv.wait(timeout=1.0)
            return self.queue.popleft()

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            it, run = task
            stage = it.plan.slots[run.slot]
            owners = self._owners(stage)
            released = [False]
            try:
                with self.board.cv:
                    self.board.check(it)
                self._run(it, run, stage, owners, released)
            except Cancelled as exc:
                # kept without its traceback: the frames would keep the stage's device tensors
                with self.board.cv:
                    it.aborted = it.aborted or exc.with_traceback(None)
            except BaseException as exc:
                what = f"stage {stage.name} (layers {stage.start}-{stage.stop - 1}) on {self}"
                error = EngineError(
                    f"{what}, iteration {it.serial}: {type(exc).__name__}: {exc}",
                    stage=stage.name,
                    stage_kind=str(stage.kind),
                    worker=str(self.device),
                    iteration=it.serial,
                )
                self.board.fail(error)
                traceback.clear_frames(exc.__traceback__)
            finally:
                if it.aborted is not None or self.board.error is not None:
                    self.prefetched.clear()
                if not released[0]:
                    self.board.release_uploads(owners, it.version)
                with self.board.cv:
                    it.remaining -= 1
                    if it.remaining == 0:
                        it.finished = time.perf_counter()
                    self.board.cv.notify_all()

    def _owners(self, stage: Stage) -> set[int]:
        host = self.host
        return set().union(*(host.layer_owners[i] for i in stage.layers))

    # -- weights -----------------------------------------------------------------------------
    def _allocate(self, stage: Stage) -> tuple[Params, list[tuple[Any, int]]]:
        host = self.host
        params: Params = {}
        sizes: list[tuple[Any, int]] = []
        # allocated on the stream that writes them; the compute stream is recorded as a user
        # before it reads them, so the allocator never hands the memory out while it is in use
        with self.link.on(self.link.param_up):
            for i in stage.layers:
                params[i] = {}
                for local, k in host.layer_keys[i].items():
                    params[i][local] = self.link.empty_like(host.tensors[k].compute)
                    sizes.append(((i, local), host.tensors[k].compute.numel()))
        return params, sizes

    def _source(self, it: Iteration, layer: int, local: str) -> torch.Tensor:
        """The host tensor an iteration uploads for a layer's tensor: the compute copy of its
        version, or the frozen initial weights for an objective that asks for them (a full
        fine-tune's reference model)."""
        key = self.host.layer_keys[layer][local]
        return self.host.upload_source(key, it.version, initial=it.objective.initial)

    def _pieces(
        self, params: Params, window: list[Any], it: Iteration
    ) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
        out = []
        for piece in window:
            i, local = piece.key
            out.append((self._source(it, i, local), params[i][local], piece.start, piece.stop))
        return out

    def _start_prefetch(self, num_windows: int) -> tuple[Any, Params, list[list[Any]], Iteration] | None:
        """Plan the next queued stage's upload if its weights are ready (never blocks).

        Out of device memory for it, the next stage is uploaded when it starts instead.
        """
        with self.board.cv:
            if not self.queue:
                return None
            it, run = self.queue[0]
        if it.aborted is not None or id(run) in self.prefetched:
            return None
        stage = it.plan.slots[run.slot]
        if not self.board.versions_ready(self._owners(stage), it.version):
            return None
        try:
            params, sizes = self._allocate(stage)
        except torch.OutOfMemoryError:
            self.prefetch_oom += 1
            return None
        return run, params, plan_windows(sizes, num_windows), it

    def _weights(
        self, it: Iteration, run: SlotRun, stage: Stage, owners: set[int], released: list[bool]
    ) -> Params:
        """The stage's device weights: prefetched, or uploaded now once their version is ready."""
        board = self.board
        if id(run) in self.prefetched:
            params, event = self.prefetched.pop(id(run))
        else:
            # layer by layer, each as soon as the optimizer published its weights: the first
            # layers' copies overlap the optimizer still updating the last ones
            params, _ = self._allocate(stage)
            event = None
            for i in stage.layers:
                board.wait_for(board.published(self.host.layer_owners[i], it.version), it)
                pieces = [(self._source(it, i, local), t, 0, t.numel()) for local, t in params[i].items()]
                event = self.link.copy_pieces(pieces, None)
        self.link.wait(self.link.compute, event)
        # the host copy may change once the upload finished: the optimizer waits for ``event``
        # before it rewrites it, and this thread goes on queueing work
        board.release_uploads(owners, it.version, event)
        released[0] = True
        host = self.host
        for i in stage.layers:
            for local, k in host.layer_keys[i].items():
                if self.link.is_cuda:
                    params[i][local].record_stream(self.link.compute)
                if stage.kind != StageKind.FORWARD and it.train and host.tensors[k].trainable:
                    params[i][local].requires_grad_(True)
                packed = host.tensors[k].packed
                if packed is not None:  # a 4-bit base weight: decoded here, on the compute stream
                    params[i][local] = packed.unpack(params[i][local])
        return params

    # -- one slot run --------------------------------------------------------------------------
    def _run(self, it: Iteration, run: SlotRun, stage: Stage, owners: set[int], released: list[bool]) -> None:
        with contextlib.ExitStack() as stack:
            if not it.objective.adapters:  # e.g. DPO's LoRA reference: the base model
                stack.enter_context(adapters_disabled(self.modules[i] for i in stage.layers))
            if it.train:
                self._run_stage(it, run, stage, owners, released)
                return
            modes = [self.modules[i].training for i in stage.layers]
            for i in stage.layers:
                self.modules[i].eval()  # evaluation: dropout off
            try:
                self._run_stage(it, run, stage, owners, released)
            finally:
                for i, mode in zip(stage.layers, modes, strict=True):
                    self.modules[i].train(mode)

    def _run_stage(
        self, it: Iteration, run: SlotRun, stage: Stage, owners: set[int], released: list[bool]
    ) -> None:
        accum: dict[tuple[int, str], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        spans: list[tuple[Any, Any]] = []
        self.link.take_copies()  # whatever a failed stage left is no part of this one
        self.waits = []
        prefetched = id(run) in self.prefetched
        with self.link.on(self.link.compute):
            wanted = self._mark()
            params = self._weights(it, run, stage, owners, released)
            ready = self._mark()
            self.waits.append((WEIGHTS, wanted, ready))
            n = len(run.microbatches)
            prefetch, first = None, 0
            for w, mb in enumerate(run.microbatches):
                self._check_cancel(it, stage, mb)
                x, after = self._stage_input(it, stage, mb)
                self.waits.append((ACTIVATIONS, spans[-1][1] if spans else ready, self._mark()))
                if prefetch is None:  # tried again at every micro-batch: the weights may be ready now
                    prefetch, first = self._start_prefetch(n - w), w
                if prefetch is not None:
                    window = prefetch[2][w - first]
                    self.link.copy_pieces(self._pieces(prefetch[1], window, prefetch[3]), after)
                t0 = self._mark()
                if stage.kind == StageKind.FORWARD:
                    self._forward(it, stage, mb, params, x)
                elif not it.train:
                    losses.append(self._evaluate(it, stage, mb, params, x))
                else:
                    loss = self._backward(it, stage, mb, params, x, accum)
                    if loss is not None:
                        losses.append(loss)
                spans.append((t0, self._mark()))
            if prefetch is not None:
                self.prefetched[id(prefetch[0])] = (prefetch[1], self.link.record(self.link.param_up))
            if stage.kind != StageKind.FORWARD and it.train:  # the gradients go down before anything waits
                summed = accum if self.context.fp32_accumulate else None
                send_gradients(
                    self.link, self.board, self.host, (it.serial, run.round), stage, params, summed
                )
            # the losses go down in one copy and are read, with the times, once per iteration (an
            # objective's report: the loss sum followed by what the objective reads back)
            sent = self.link.download(torch.cat([v.reshape(-1) for v in losses])) if losses else None
            starts = list(itertools.accumulate((v.numel() for v in losses), initial=0))
            gap = self.idle.gap(it.serial, spans, train=it.train)
            copies = [(self.index, *c) for c in self.link.take_copies()]
            with self.board.cv:
                if sent is not None:
                    for j, mb in enumerate(run.microbatches):
                        it.loss_sums[mb] = (sent[0], starts[j], sent[1])
                it.spans.extend((self.index, stage.name, a, b) for a, b in spans)
                it.activity.waits.extend(self.waits)
                it.activity.copies.extend(copies)
                it.activity.prefetched.append(prefetched)
                if gap is not None:
                    it.activity.gaps.append(gap)
                self.board.cv.notify_all()

    def _check_cancel(self, it: Iteration, stage: Stage, mb: int) -> None:
        """Honour the cancel flag, unless the caller already received this iteration's loss
        (async mode): its gradients then belong to a step the caller may already have asked for."""
        cancel = self.context.cancel
        if cancel is None or not cancel.is_set():
            return
        with self.board.cv:
            if not it.returned:
                raise Cancelled(f"cancelled before micro-batch {mb} of stage {stage.name}")

    def _mark(self) -> Any:
        """A point in time on the compute stream (an event on CUDA, a clock reading on the CPU)."""
        return self.link.record(self.link.compute, timing=True) if self.link.is_cuda else time.perf_counter()

    def _record(
        self, it: Iteration, table: dict[int, float], layer: int, took: float | tuple[Any, Any]
    ) -> None:
        """Add a layer's time to ``table``: seconds, or on a GPU the pair of events around its
        kernels, read once the iteration is done (``Iteration.settle_layer_times``)."""
        with self.board.cv:
            if isinstance(took, tuple):
                it.layer_events.append((table, layer, *took))
            else:
                table[layer] = table.get(layer, 0.0) + took

    def _clock(self, it: Iteration) -> Any:
        """Start timing a layer (profiling only). On a GPU an event on the compute stream: the
        layer's own kernels are timed between two events, with no wait on the host and none of
        another worker's kernels in between."""
        if not it.profile:
            return 0.0
        if self.link.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.link.compute)
            return start
        return time.perf_counter()

    def _elapsed(self, t0: Any) -> float | tuple[Any, Any]:
        """Seconds since ``t0`` (profiling only), or on a GPU the event pair to read later."""
        if self.link.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.link.compute)
            return (t0, end)
        return time.perf_counter() - float(t0)

    def _stage_input(self, it: Iteration, stage: Stage, mb: int) -> tuple[torch.Tensor, Any]:
        if stage.start == 0:
            ids = self.link.upload(it.microbatches[mb].input_ids)
            return ids, self.link.record(self.link.act_up)
        key = (mb, stage.start)
        self.board.wait_for(lambda: key in it.acts, it)
        with self.board.cv:
            host, event = it.acts[key]
            it.act_uses[key] -= 1
            if it.act_uses[key] == 0:
                del it.acts[key], it.act_uses[key]
        self.link.wait(self.link.act_up, event)
        return self.link.upload(host), self.link.record(self.link.act_up)

    def _publish(
        self, table: dict[tuple[int, int], Any], key: tuple[int, int], tensor: torch.Tensor | None
    ) -> None:
        host, event = (None, None) if tensor is None else self.link.download(tensor)
        with self.board.cv:
            table[key] = (host, event)
            self.board.cv.notify_all()

    @contextlib.contextmanager
    def _rng(self, it: Iteration, mb: int, layer: int) -> Iterator[None]:
        """Seed dropout per (iteration, micro-batch, layer), so a recompute draws the same masks."""
        if not (self.context.dropout and it.train):
            yield
            return
        seed = (it.seed * 1_000_003 + it.serial) * 1_000_003 + (it.first + mb) * 1_009 + layer
        seed &= (1 << 62) - 1
        with rng_lock(self.device):
            if self.link.is_cuda:
                torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
            else:
                torch.default_generator.manual_seed(seed)
            yield

    def _replay_lock(self, it: Iteration) -> contextlib.AbstractContextManager[Any]:
        """The device generator's lock where a backward replays random numbers (dropout under a
        recomputed per-sequence loss), else nothing."""
        if self.context.dropout and it.train and it.objective.scores:
            return rng_lock(self.device)
        return contextlib.nullcontext()

    def _call(
        self,
        it: Iteration,
        mb: int,
        layer: Layer,
        params: Params,
        x: torch.Tensor,
        ctx: Any,
        labels: torch.Tensor | None = None,
        *,
        grad_scale: float = 1.0,
    ) -> torch.Tensor:
        """Run one layer; the output layer given ``labels`` returns the loss sum (chunked), its
        gradients taken for ``grad_scale``, the gradient back-propagated into it, followed by the
        label tokens predicted right (``[2]``) unless the objective scores tokens or whole sequences."""
        module, tensors = self.modules[layer.index], params[layer.index]

        def call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(module, tensors, args, kwargs, tie_weights=False, strict=False)

        lock = PARAMETRIZE_LOCK if self.parametrized[layer.index] else contextlib.nullcontext()
        objective = it.objective
        images = it.microbatches[mb].images if layer.kind == LayerKind.INPUT else None
        if images:
            images = {k: self.link.upload(v) for k, v in images.items()}
        with self._rng(it, mb, layer.index), lock:
            return run_layer(
                layer,
                call,
                x,
                ctx,
                labels,
                per_sequence=objective.per_sequence,
                per_token=objective.per_token,
                grad_scale=grad_scale,
                count_correct=not objective.scores,
                images=images,
            )

    def _context(self, it: Iteration, mb: int, hidden: torch.Tensor) -> Any:
        batch = it.microbatches[mb]
        am, extra = batch.attention_mask, batch.context
        if not self.link.is_cuda:
            return self.context.model.build_context(self.rotary, hidden, am, images=extra)
        # built from the host copy of the mask and copied up: no wait for the GPU
        return self.context.model.build_context(
            self.rotary, hidden, am, lambda t: self.link.upload(t.pin_memory()), images=extra
        )

    def _forward(self, it: Iteration, stage: Stage, mb: int, params: Params, x: torch.Tensor) -> None:
        layers = self.context.model.layers
        ctx = None if stage.start == 0 else self._context(it, mb, x)
        sums: list[torch.Tensor] | None = None
        with torch.no_grad():
            for i in stage.layers:
                t0 = self._clock(it)
                x = self._call(it, mb, layers[i], params, x, ctx)
                if it.profile:
                    self._record(it, it.layer_fwd_s, i, self._elapsed(t0))
                if (stats := self.routing.statistics(it, mb, i)) is not None:
                    sums = list(stats) if sums is None else [sums[0] + stats[0], sums[1] + stats[1]]
                if ctx is None:
                    ctx = self._context(it, mb, x)
                if i + 1 in it.checkpoints:
                    self._publish(it.acts, (mb, i + 1), x)
        if sums is not None:
            self._publish(it.router_sums, (mb, stage.start), torch.stack(sums))  # to the fused stage

    def _evaluate(
        self, it: Iteration, stage: Stage, mb: int, params: Params, x: torch.Tensor
    ) -> torch.Tensor:
        """The fused stage of an evaluation: its layers and the loss, no backward."""
        layers = self.context.model.layers
        ctx = None if stage.start == 0 else self._context(it, mb, x)
        labels = self.link.upload(it.microbatches[mb].labels)
        with torch.no_grad():
            for i in stage.layers:
                # the output layer (last) returns the loss sum
                x = self._call(
                    it, mb, layers[i], params, x, ctx, labels if layers[i].kind == LayerKind.OUTPUT else None
                )
                self.routing.statistics(it, mb, i)  # an evaluation adds no router loss
                if ctx is None:
                    ctx = self._context(it, mb, x)
            x, correct = self._split_output(it, x)
            loss_sum, report = it.objective.fused_loss(it.first + mb, x, self.link.upload)
            return self._report(loss_sum, report, correct)

    def _backward(
        self,
        it: Iteration,
        stage: Stage,
        mb: int,
        params: Params,
        x: torch.Tensor,
        accum: dict[tuple[int, str], torch.Tensor],
    ) -> torch.Tensor | None:
        layers = self.context.model.layers
        ctx = None if stage.start == 0 else self._context(it, mb, x)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        weights: torch.Tensor | None = None  # the router loss's per-expert weights
        labels = self.link.upload(it.microbatches[mb].labels) if stage.kind == StageKind.FUSED else None
        # what will be back-propagated into the loss sum: its layer takes its gradients for it
        expected = self.board.scale_for(it) / it.total_tokens if labels is not None else 1.0
        with torch.enable_grad():
            for i in stage.layers:
                t0 = self._clock(it)
                inp = x if i == 0 else x.detach().requires_grad_(self._needs_input_grad(i))
                # the fused stage's output layer (last) returns the loss sum, chunk by chunk
                x = self._call(
                    it,
                    mb,
                    layers[i],
                    params,
                    inp,
                    ctx,
                    labels if layers[i].kind == LayerKind.OUTPUT else None,
                    grad_scale=expected,
                )
                if it.profile:
                    self._record(it, it.layer_fwd_s, i, self._elapsed(t0))
                if (stats := self.routing.statistics(it, mb, i)) is not None:
                    routed[i] = stats
                if ctx is None:
                    ctx = self._context(it, mb, x)
                saved.append((inp, x))
            loss_sum, report, correct = None, None, None
            if stage.kind == StageKind.FUSED:
                # x: the output layer's result (a token loss sum, or the rows' log-probabilities)
                x, correct = self._split_output(it, x)
                loss_sum, report = it.objective.fused_loss(it.first + mb, x, self.link.upload)
                scale = self.board.scale_for(it) / it.total_tokens
                top: torch.Tensor | None = loss_sum * scale
                grad: torch.Tensor | None = None
                if self.routing.active:
                    extra, weights = self.routing.fused(it, mb, routed, scale)
                    loss_sum = loss_sum + extra
            else:
                key = (mb, stage.stop)
                wanted = self._mark()
                self.board.wait_for(lambda: key in it.grads, it)
                with self.board.cv:
                    host, event = it.grads.pop(key)
                self.link.wait(self.link.act_up, event)
                top, grad = None, None if host is None else self.link.upload(host)
                self.waits.append((ACTIVATIONS, wanted, self._mark()))
            if routed and weights is None:
                weights = self.routing.weights(it, mb)
            for i, (inp, out) in zip(reversed(stage.layers), reversed(saved), strict=True):
                t0 = self._clock(it)
                if top is not None:
                    # a per-sequence loss runs its head chunks again here (torch.utils.checkpoint,
                    # replaying the head's random numbers by setting the device generator's
                    # state): under the generator's lock, like every draw
                    with self._replay_lock(it):
                        torch.autograd.backward(top)
                elif i in routed and weights is not None:
                    # the block's share of the router loss, with T held fixed (engine.model.router)
                    surrogate = (weights * routed[i][1]).sum()
                    pairs = [(out, grad), (surrogate, None)] if out.requires_grad else [(surrogate, None)]
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                elif out.requires_grad:
                    torch.autograd.backward(out, grad)
                if it.profile:
                    self._record(it, it.layer_bwd_s, i, self._elapsed(t0))
                top, grad = None, inp.grad if inp.requires_grad else None
        if stage.start > 0:  # None when nothing below trains (a frozen input layer)
            self._publish(it.grads, (mb, stage.start), grad)
        if self.context.fp32_accumulate:
            for i in stage.layers:
                for local, t in params[i].items():
                    if t.grad is not None:
                        acc = accum.get((i, local))
                        if acc is None:
                            accum[(i, local)] = t.grad.float()
                        else:
                            acc.add_(t.grad)
                        t.grad = None
        return None if loss_sum is None else self._report(loss_sum, report, correct)

    @staticmethod
    def _split_output(it: Iteration, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output layer's result without the count of right predictions, and the count (None:
        the objective scores tokens or whole sequences, and nothing was counted)."""
        if it.objective.scores:
            return out, None
        return out[0], out[1].detach()

    @staticmethod
    def _report(
        loss_sum: torch.Tensor, report: torch.Tensor | None, correct: torch.Tensor | None
    ) -> torch.Tensor:
        """What goes to the host for a micro-batch: the objective's report, or the loss sum (with the
        router loss) followed by the label tokens predicted right (``Iteration.correct_tokens``)."""
        if report is not None:
            return report
        if correct is None:
            return loss_sum.detach()
        return torch.stack([loss_sum.detach(), correct])

    def _needs_input_grad(self, layer: int) -> bool:
        """Whether the gradient of a block's input is needed: always, except for the block right
        above a frozen input layer (a LoRA base), where nothing below would use it."""
        return layer > 1 or bool(self.host.layer_owners[0])
