"""The shared blackboard of one engine: what the worker and optimizer threads wait on.

Everything here is guarded by one condition variable; every change wakes every waiter, and
every wait re-raises the engine's failure or its iteration's cancellation, so no thread can be
left blocked on an error elsewhere.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.model.adapter import count_label_tokens
from engine.parallel.activity import Activity, seconds
from engine.parallel.objective import TOKEN_LOSS, Objective
from engine.scheduling.partition import Plan
from engine.scheduling.schedule import SlotRun

if TYPE_CHECKING:
    import torch


@dataclass
class MicroBatch:
    input_ids: Any
    labels: Any
    attention_mask: Any
    # a VLM's micro-batch: its rows' image tensors for the input layer, and what the blocks'
    # context needs of them (``engine.vision.batch``); None for text
    images: dict[str, Any] | None = None
    context: dict[str, Any] | None = None


def split_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    num_microbatches: int,
    *,
    pin: bool = False,
) -> tuple[list[MicroBatch], int]:
    """Check a batch and cut it into ``num_microbatches`` micro-batches in host memory.

    With ``pin`` the micro-batches are pinned (GPU workers upload them asynchronously).

    Returns:
        The micro-batches and the number of label tokens of the whole batch.

    Raises:
        ValueError: bad shapes, fewer sequences than micro-batches, or no label token.
    """
    check_batch(input_ids, labels, attention_mask)
    m = num_microbatches
    if input_ids.shape[0] < m:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences cannot fill num_microbatches={m}")
    total = count_label_tokens(labels)
    if total == 0:
        raise ValueError("labels: every label is -100, there is no token to train on")
    return cut_batch(input_ids, labels, attention_mask, m, pin=pin), total


def check_batch(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``input_ids`` is ``[batch, seq]`` and the others have its shape."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} "
            f"differs from input_ids {tuple(input_ids.shape)}"
        )


def cut_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sections: int | list[int],
    *,
    pin: bool = False,
) -> list[MicroBatch]:
    """Cut a checked batch into micro-batches in host memory, by rows: ``sections`` as
    ``torch.tensor_split`` takes it (a count of near-equal parts, or the row indices to cut at)."""
    m = sections if isinstance(sections, int) else len(sections) + 1
    ids = input_ids.detach().cpu().tensor_split(sections)
    lab = labels.detach().cpu().tensor_split(sections)
    am = attention_mask.detach().cpu().tensor_split(sections) if attention_mask is not None else [None] * m

    def host(t: torch.Tensor) -> torch.Tensor:
        # GPU workers upload with non_blocking copies, which are asynchronous only from pinned memory
        return t.contiguous().pin_memory() if pin else t.contiguous()

    return [
        MicroBatch(host(i), host(t), None if a is None else host(a))
        for i, t, a in zip(ids, lab, am, strict=True)
    ]


@dataclass
class Iteration:
    """One ``forward_backward`` call: its schedule, inputs and in-flight tensors."""

    serial: int
    version: int
    plan: Plan
    runs: list[SlotRun]
    microbatches: list[MicroBatch]
    total_tokens: int  # what the loss is a mean over: label tokens, or pairs (a preference method)
    rounds: list[tuple[int, ...]]
    seed: int
    checkpoints: frozenset[int]
    profile: bool = False
    train: bool = True
    returned: bool = False  # forward_backward handed its loss to the caller
    acts: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    act_uses: dict[tuple[int, int], int] = field(default_factory=dict)
    grads: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    # per micro-batch: (host tensor, index, copy event) of its loss sum (read with ``loss_sum``);
    # an objective's report follows it (a sequence-scoring iteration's rows' log-probabilities),
    # else the label tokens predicted right (``correct_tokens``)
    loss_sums: dict[int, tuple[Any, int, Any]] = field(default_factory=dict)
    objective: Objective = TOKEN_LOSS  # what the fused stage makes of the output layer's result
    # busy spans (worker, stage name, start, end): clock readings, or CUDA timing events
    spans: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    # MoE router loss: (micro-batch, forward stage start) -> that stage's summed (counts, probs),
    # and per micro-batch the weight of each expert's probability sum (set by the fused stage)
    router_sums: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    router_weights: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    remaining: int = 0
    aborted: BaseException | None = None
    busy_s: dict[int, float] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    layer_fwd_s: dict[int, float] = field(default_factory=dict)
    layer_bwd_s: dict[int, float] = field(default_factory=dict)
    # on GPU workers: (table, layer, start event, end event) of each timed layer run, not yet read
    layer_events: list[tuple[dict[int, float], int, Any, Any]] = field(default_factory=list)
    # waits, copies, idle gaps and prefetches of its stage runs (engine.parallel.activity)
    activity: Activity = field(default_factory=Activity)
    fold_s: float = 0.0  # the optimizer thread's time adding its gradients into the fp32 buffers
    started: float = 0.0
    finished: float = 0.0
    # on several boxes (``engine.distributed``): the index of this box's first micro-batch in the
    # whole batch's (the objective keeps the whole batch's per micro-batch), and the whole batch's
    # loss sum and right predictions, every box's share summed, once the loss is handed over
    first: int = 0
    boxes_loss: float | None = None
    boxes_correct: int | None = None

    def loss_sum(self, microbatches: Iterable[int] | None = None) -> float:
        """The summed loss of some micro-batches (all by default), waiting for their copies; on
        several boxes, all of them the whole batch's (``boxes_loss``, every box's share summed)."""
        if microbatches is None and self.boxes_loss is not None:
            return self.boxes_loss
        total = 0.0
        for mb in range(len(self.microbatches)) if microbatches is None else microbatches:
            host, j, event = self.loss_sums[mb]
            if event is not None:
                event.synchronize()
            total += float(host[j])
        return total

    def correct_tokens(self) -> int | None:
        """The label tokens whose logits' argmax was the label, over every micro-batch (None: the
        objective scores tokens or whole sequences, e.g. DPO or GRPO, and nothing was counted)."""
        if self.objective.scores:
            return None
        if self.boxes_correct is not None:
            return self.boxes_correct
        total = 0
        for mb in range(len(self.microbatches)):
            host, j, event = self.loss_sums[mb]
            if event is not None:
                event.synchronize()
            total += int(host[j + 1])
        return total

    def settle_layer_times(self) -> None:
        """Read the GPU event pairs of a finished iteration's timed layers into ``layer_fwd_s`` and
        ``layer_bwd_s`` (seconds); each pair is read once."""
        events, self.layer_events = self.layer_events, []
        for table, layer, start, end in events:
            end.synchronize()
            table[layer] = table.get(layer, 0.0) + start.elapsed_time(end) / 1000.0

    def settle_times(self) -> None:
        """Turn the busy spans into seconds per worker (``busy_s``) and per stage (``stage_s``)."""
        spans, self.spans = self.spans, []
        for worker, stage, a, b in spans:
            took = seconds(a, b)
            self.busy_s[worker] = self.busy_s.get(worker, 0.0) + took
            self.stage_s[stage] = self.stage_s.get(stage, 0.0) + took


class Board:
    """Condition variable plus the state threads coordinate through."""

    def __init__(self, num_owners: int) -> None:
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        # latest weights version published per optimizer unit, and uploads still to read each one
        self.version = [0] * num_owners
        self.outstanding: dict[tuple[int, int], int] = {}
        # float16 loss scale that goes with each weights version (set by the step producing it):
        # an iteration on version v scales by loss_scales[v], whatever the timing of its launch
        self.loss_scales: dict[int, float] = {}
        # gradient contributions: (iteration serial, round, layer) -> {tensor key: (grad, event)}
        # (host flat fp32 tensor, copy event, [(tensor key, offset, numel)], buffer reusable)
        self.deposits: dict[tuple[int, int, int], tuple[Any, Any, list[tuple[int, int, int]], bool]] = {}
        # pinned gradient buffers handed back by the optimizer, by number of elements
        self.buffers: dict[int, list[Any]] = {}
        # the copy events of finished uploads per (optimizer unit, version): waited for before
        # the unit's host copy is rewritten
        self.upload_events: dict[tuple[int, int], list[Any]] = {}

    def take_buffer(self, numel: int) -> Any:
        """A pinned fp32 buffer of ``numel`` elements handed back earlier, or None."""
        with self.cv:
            free = self.buffers.get(numel)
            return free.pop() if free else None

    def give_buffer(self, buffer: Any) -> None:
        """Hand a gradient buffer back once its contents were consumed."""
        with self.cv:
            self.buffers.setdefault(buffer.numel(), []).append(buffer)

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()

    def check(self, it: Iteration | None = None) -> None:
        """Raise the engine's failure, or the iteration's cancellation (caller holds cv).

        Raises a copy: every thread that raised the one stored exception would add its frames
        to that object's traceback, and with them its locals (a stage's device tensors).
        """
        if self.error is not None:
            raise copy.copy(self.error).with_traceback(None)
        if it is not None and it.aborted is not None:
            raise copy.copy(it.aborted).with_traceback(None)

    def wait_for(self, ready: Callable[[], bool], it: Iteration | None = None) -> None:
        """Block until ``ready()`` (evaluated under the lock), failure or cancellation."""
        with self.cv:
            while True:
                self.check(it)
                if ready():
                    return
                self.cv.wait(timeout=1.0)

    def scale_for(self, it: Iteration) -> float:
        """The loss scale of a training iteration: the one recorded with its weights version."""
        if not it.train:
            return 1.0
        self.wait_for(lambda: it.version in self.loss_scales, it)
        with self.cv:
            return self.loss_scales[it.version]

    # -- versions of the compute copy ------------------------------------------------------
    def register_uploads(self, owners: set[int], version: int) -> None:
        with self.cv:
            for o in owners:
                self.outstanding[(o, version)] = self.outstanding.get((o, version), 0) + 1

    def release_uploads(self, owners: set[int], version: int, event: Any = None) -> None:
        """An upload of ``version`` was queued; ``event`` (None on the CPU) marks its end."""
        with self.cv:
            for o in owners:
                if event is not None:
                    self.upload_events.setdefault((o, version), []).append(event)
                n = self.outstanding[(o, version)] - 1
                if n:
                    self.outstanding[(o, version)] = n
                else:
                    del self.outstanding[(o, version)]
            self.cv.notify_all()

    def published(self, owners: set[int], version: int) -> Callable[[], bool]:
        """A test (for ``wait_for``) that every unit in ``owners`` published weights ``version``."""
        return lambda: all(self.version[o] >= version for o in owners)

    def versions_ready(self, owners: set[int], version: int) -> bool:
        with self.cv:
            return all(self.version[o] >= version for o in owners)

    def set_version(self, owner: int, version: int) -> None:
        with self.cv:
            self.version[owner] = version
            self.cv.notify_all()
