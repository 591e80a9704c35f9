"""RoundPipe: pipeline training with all state in host memory and stateless device workers.

``RoundPipe(hf_model, EngineConfig(...))`` adapts a causal LM into layers, keeps its weights,
fp32 masters, moments and gradients in host memory, and trains it over a pool of workers
(CUDA devices, or ``"cpu"`` threads for testing) that receive stages round-robin. Its
iterations that score whole sequences (the preference methods') are in ``engine.parallel.sequences``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.config import EngineConfig
from engine.errors import Cancelled, ConfigError, EngineError
from engine.kinds import EngineEvent
from engine.metrics import NullSink, Sink
from engine.model.adapter import AdaptedModel, uses_dropout
from engine.model.router import RouterLoss
from engine.parallel.board import Board, Iteration, MicroBatch, split_batch
from engine.parallel.context import WorkerContext
from engine.parallel.executor import Worker
from engine.parallel.host import DTYPES, HostState
from engine.parallel.objective import TOKEN_LOSS, Objective
from engine.parallel.optimizer import OptimizerWorker, StepJob
from engine.parallel.sequences import SequenceMethods
from engine.parallel.stages import choose_plan, measured_costs, memory_budget, memory_costs, plan_grid
from engine.parallel.transfer import resolve_device
from engine.planner.activations import model_shape
from engine.scheduling.partition import Plan
from engine.scheduling.schedule import build_schedule
from engine.vision.batch import RowImages, check_images, context_inputs, join_images

if TYPE_CHECKING:
    from engine.distributed.group import Group

T = TypeVar("T")

__all__ = ["Cancelled", "EngineConfig", "EngineError", "RoundPipe"]


class RoundPipe(SequenceMethods):
    """Train a Hugging Face causal LM with the RoundPipe schedule.

    Args:
        hf_model: a Llama/Qwen2/Qwen3/Mistral ``*ForCausalLM``, optionally peft-wrapped. The
            engine takes over its weights: the model's parameters hold the compute copy.
        config: the engine configuration.
        sink: receives per-step metrics and events (called from the optimizer thread).
        cancel: when set, running iterations stop between micro-batches (``Cancelled``).
        group: the boxes of a job that spans several (``engine.distributed.join``): every box is
            given the whole batch, trains its share of the micro-batches (the whole batch is cut
            into ``num_microbatches`` per box) and the boxes sum their gradients before each
            step, so each holds the same weights. None: this box alone.

    Raises:
        ConfigError: unsupported architecture, bad manual partition, CUDA asked for but absent
            (a ``ValueError``; ``field`` names the setting).
    """

    def __init__(
        self,
        hf_model: torch.nn.Module,
        config: EngineConfig,
        *,
        sink: Sink | None = None,
        cancel: threading.Event | None = None,
        group: Group | None = None,
    ) -> None:
        self.config = config
        self.group = group if group is not None and group.world_size > 1 else None
        self.sink: Sink = sink or NullSink()
        self._sink_lock = threading.Lock()
        self.adapted = AdaptedModel(hf_model, loss_chunk_tokens=config.loss_chunk_tokens)
        dropout = uses_dropout(hf_model, self.adapted.config)
        self.devices = [resolve_device(d) for d in config.devices]
        self.dtype = DTYPES[config.compute_dtype]
        is_cuda = any(d.type == "cuda" for d in self.devices)
        # TensorFloat-32 for fp32 compute on GPUs (process-wide: restored by close())
        self.tf32 = is_cuda and config.tf32 and self.dtype == torch.float32
        self._tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        if is_cuda and self.dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32
        self.host = HostState(
            self.adapted,
            compute_dtype=self.dtype,
            pin=is_cuda,
            double_buffer=config.async_optimizer,
            base_bits=config.base_bits,
        )
        if config.base_bits == 4 and not any(t.packed is not None for t in self.host.tensors):
            raise ConfigError(
                "EngineConfig.base_bits",
                "EngineConfig.base_bits=4: the model has no frozen block weights to keep in 4 bits "
                "(a 4-bit base is for LoRA, whose base does not train)",
                value=4,
            )
        self.board = Board(self.host.num_layers)
        self.plan: Plan | None = None
        self._manual = config.partition is not None
        if config.partition is not None:
            try:
                self.plan = Plan.from_counts(self.host.num_layers, **config.partition)
            except ValueError as exc:
                raise ConfigError("EngineConfig.partition", str(exc), value=config.partition) from exc
        self.steps = 0
        self._serial = 0
        self._evaluations = 0
        self._rotation = 0
        self._pending: list[Iteration] = []
        self._inflight: list[Iteration] = []
        self._calibration: list[Iteration] = []
        # a training iteration ran since the last step: gradient buffers no contribution reached
        # (or a cancelled one reached in part) are zeroed by ``synchronize``
        self._unsettled = False
        self._closed = False
        self.workers: list[Worker] = []
        self.optimizer = OptimizerWorker(self.host, self.board, config, self._on_step, group=self.group)
        context = WorkerContext(
            model=self.adapted,
            host=self.host,
            board=self.board,
            cancel=cancel,
            dropout=dropout,
            fp32_accumulate=self.dtype != torch.float32,
            router_loss=(
                RouterLoss.for_model(self.adapted, config.router_aux_loss_coef)
                if config.router_aux_loss
                else None
            ),
        )
        try:
            self.workers = [Worker(i, d, context) for i, d in enumerate(self.devices)]
        except BaseException:
            self.close()
            raise

    # -- training --------------------------------------------------------------------------
    def forward_backward(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        images: Sequence[RowImages | None] | None = None,
    ) -> float:
        """Run forward and backward of one batch; gradients accumulate until ``step()``.

        Args:
            input_ids: ``[batch, seq]`` token ids.
            labels: ``[batch, seq]``, -100 where no loss is taken (shifted inside).
            attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding.
            images: a vision-language model's images, one entry per row: None for a text row,
                else the row's image tensors (``engine.vision.pixels.row_pixels``).

        Returns:
            The mean loss over every label token of the whole batch.

        Raises:
            ValueError: bad shapes, fewer sequences than micro-batches, no label token.
            EngineError: a worker failed (the message names stage and worker).
            Cancelled: the cancel flag was set.
        """
        self._check_open()
        self._check_rows(int(input_ids.shape[0]) if input_ids.dim() == 2 else 0, "sequences")
        mbs, total = split_batch(input_ids, labels, attention_mask, self.cuts, pin=self.host.pinned)
        self._attach_images(mbs, images)
        mine, first = self.share(mbs)
        return self._train(mine, total, first=first).loss_sum() / total

    # -- several boxes ---------------------------------------------------------------------------
    @property
    def boxes(self) -> int:
        """The boxes the job spans (1: this one alone)."""
        return 1 if self.group is None else self.group.world_size

    @property
    def cuts(self) -> int:
        """The micro-batches a whole training batch is cut into: ``num_microbatches`` per box."""
        return self.config.num_microbatches * self.boxes

    def share(self, mbs: list[T]) -> tuple[list[T], int]:
        """This box's micro-batches of the whole batch's ``cuts``, and the index of its first."""
        if self.group is None:
            return mbs, 0
        m = self.config.num_microbatches
        first = self.group.rank * m
        return mbs[first : first + m], first

    def _check_rows(self, rows: int, what: str) -> None:
        """Refuse a batch that cannot give every box its micro-batches (one box: ``split_batch``
        says it)."""
        if self.group is not None and 0 < rows < self.cuts:
            raise ValueError(
                f"batch of {rows} {what} cannot fill num_microbatches={self.config.num_microbatches} "
                f"on each of {self.boxes} boxes (at least {self.cuts})"
            )

    def _attach_images(self, mbs: list[MicroBatch], images: Sequence[RowImages | None] | None) -> None:
        """Give each micro-batch its rows' images and the blocks' context inputs they need
        (``engine.vision.batch``); a VLM's text-only batch gets its context inputs too."""
        if images is None and self.adapted.vision is None:
            return
        rows = sum(int(mb.input_ids.shape[0]) for mb in mbs)
        if images is not None:
            if self.adapted.vision is None:
                raise ValueError(
                    f"images given to {self.adapted.architecture}, which is not a vision-language model"
                )
            check_images(images, rows)
        start = 0
        for mb in mbs:
            n = int(mb.input_ids.shape[0])
            joined = None if images is None else join_images(images[start : start + n])
            start += n
            extra = context_inputs(self.adapted, mb.input_ids, mb.attention_mask, joined)

            def host(t: torch.Tensor) -> torch.Tensor:
                return t.contiguous().pin_memory() if self.host.pinned else t.contiguous()

            mb.images = None if joined is None else {k: host(v) for k, v in joined.items()}
            mb.context = {k: host(v) for k, v in extra.items()} or None

    def _train(
        self, mbs: list[MicroBatch], total: int, objective: Objective | None = None, *, first: int = 0
    ) -> Iteration:
        """Launch a training iteration; return once its loss is handed over (its gradients
        folded, in sync mode). On several boxes ``mbs`` are this box's, ``first`` the index of
        the first in the whole batch's, and the loss handed over is the whole batch's."""
        it = self._launch(mbs, total, train=True, objective=objective, first=first)
        m = len(mbs)
        try:
            async_mode = self.config.async_optimizer

            def handed_over() -> bool:  # evaluated under the lock: no cancel can slip in after
                done = len(it.loss_sums) == m if async_mode else it.remaining == 0
                it.returned = done
                return done

            self.board.wait_for(handed_over, it)
        except Cancelled:
            # the optimizer discards every gradient accumulated since the last step
            self._pending = []
            raise
        if self.group is not None:  # every box's share of the loss and of the right predictions
            correct = it.correct_tokens()
            loss, right = self.group.sum_values([it.loss_sum(), float(correct or 0)], name="control")
            it.boxes_loss = loss
            it.boxes_correct = None if correct is None else int(right)
        return it

    def evaluate(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        images: Sequence[RowImages | None] | None = None,
    ) -> float:
        """Mean loss of a batch without training: forward stages and the fused stage's forward.

        Runs on the weights the next ``forward_backward`` would use, with dropout off.

        Returns:
            The mean loss over every label token of the batch.
        """
        return self.evaluate_counts(
            input_ids=input_ids, labels=labels, attention_mask=attention_mask, images=images
        )[0]

    def evaluate_counts(
        self,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        images: Sequence[RowImages | None] | None = None,
    ) -> tuple[float, int, int]:
        """``evaluate``, with what a token accuracy needs, from the same forward.

        Returns:
            The mean loss (as ``evaluate`` returns it), the label tokens whose logits' argmax is
            the label, and the label tokens.
        """
        self._check_open()
        m = min(self.config.num_microbatches, int(input_ids.shape[0])) if input_ids.dim() == 2 else 1
        mbs, total = split_batch(
            input_ids, labels, attention_mask, m or self.config.num_microbatches, pin=self.host.pinned
        )
        self._attach_images(mbs, images)
        it = self._launch(mbs, total, train=False)
        self.board.wait_for(lambda: it.remaining == 0, it)
        return it.loss_sum() / total, it.correct_tokens() or 0, total

    def _launch(
        self,
        mbs: list[MicroBatch],
        total: int,
        *,
        train: bool,
        objective: Objective | None = None,
        first: int = 0,
    ) -> Iteration:
        """Schedule one iteration on the workers (and its gradient fold, when training)."""
        if self.plan is None or (train and self._replan_due()):
            self.plan = self._make_plan(mbs)
        plan = self.plan
        slots = plan.slots if train else (*plan.forward, plan.fused)
        runs, self._rotation = build_schedule(
            num_slots=len(slots),
            num_workers=len(self.workers),
            num_microbatches=len(mbs),
            round_size=self.config.round_size,
            iteration=self._serial,
            start_worker=self._rotation,
        )
        rounds = sorted({r.round for r in runs})
        serial = self._serial if train else -1 - self._evaluations
        it = Iteration(
            serial=serial,
            version=self.next_version(),
            plan=plan,
            runs=runs,
            microbatches=mbs,
            total_tokens=total,
            rounds=[next(r.microbatches for r in runs if r.round == k) for k in rounds],
            seed=self.config.seed,
            checkpoints=frozenset(s.start for s in slots if s.start > 0),
            profile=train and not self._manual and self._serial < self.config.calibration_steps,
            train=train,
            objective=objective or TOKEN_LOSS,
            first=first,
        )
        if train:
            self._serial += 1
        else:
            self._evaluations += 1
        if it.profile:
            self._calibration.append(it)
        for mb in range(len(mbs)):
            for b in it.checkpoints:
                it.act_uses[(mb, b)] = sum(1 for s in slots if s.start == b)
        it.remaining = len(runs)
        it.started = time.perf_counter()
        for run in runs:
            stage = plan.slots[run.slot]
            self.board.register_uploads(
                set().union(*(self.host.layer_owners[i] for i in stage.layers)), it.version
            )
        if train:
            self.optimizer.submit_fold(it)
            self._pending.append(it)
            self._unsettled = True
        for run in runs:
            self.workers[run.worker].enqueue(it, run)
        self._inflight = [i for i in self._inflight if i.remaining > 0]
        self._inflight.append(it)
        return it

    def next_version(self) -> int:
        """The weights' version the next iteration computes with: the latest step's, or with the
        async optimizer the one before it (staleness 1); ``HostTensor.source`` holds it."""
        return max(self.steps - (1 if self.config.async_optimizer else 0), 0)

    def step(self, *, lr: float | None = None) -> None:
        """Apply the optimizer to the gradients accumulated since the last step.

        Returns at once: the CPU optimizer thread applies it while the next iteration starts
        (each layer's upload waits only for that layer's update).

        Args:
            lr: learning rate for this step (default: the config's, or the last one set).
        """
        self._check_open()
        if not self._pending:
            raise RuntimeError("step() without a forward_backward() since the last step")
        if lr is not None:
            if not (math.isfinite(lr) and lr >= 0):
                raise ValueError(f"step(lr={lr!r}): must be a finite number >= 0")
            self.config.lr = lr
        self.steps += 1
        job = StepJob(index=self.steps, lr=self.config.lr, iterations=self._pending)
        self._pending = []
        self._unsettled = False  # the step reads every buffer, then counts them all empty
        self.optimizer.submit_step(job)

    def synchronize(self) -> None:
        """Wait for every queued iteration and optimizer step; raise a failure if one occurred.

        After the last ``step()`` this is the rest of that iteration and of that step, and
        nothing more: the gradient buffers the step consumed are not zeroed (the next
        contributions overwrite them).
        """
        self._check_open()
        for it in self._inflight:
            self.board.wait_for(_finished(it))
        self._inflight = []
        self.optimizer.drain()
        with self.board.cv:
            self.board.check()
            uploads = [e for events in self.board.upload_events.values() for e in events]
            self.board.upload_events.clear()
        for event in uploads:  # the host copies are free to rewrite (a resume) or read
            event.synchronize()
        if self._unsettled:
            # gradient buffers no contribution reached since the last step read zero, as they mean
            self.host.settle_grads()
            self._unsettled = False

    # -- state ---------------------------------------------------------------------------------
    def master_state_dict(self, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """fp32 weights keyed exactly like ``hf_model.state_dict()``.

        Trainable parameters come from the fp32 masters (copies); frozen ones and persistent
        buffers from the compute copy, cast to fp32 (shared, not copied, when already fp32).

        Args:
            trainable_only: only the trained tensors (a LoRA adapter without its base).
        """
        self.synchronize()
        wanted = set(self.adapted.hf_model.state_dict().keys())
        out: dict[str, torch.Tensor] = {}
        for t in self.host.tensors:
            if trainable_only and not t.trainable:
                continue
            value = t.master.detach().clone() if t.master is not None else t.dense().float()
            for name in t.names:
                if name in wanted:
                    out[name] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise-exact resume needs (after ``synchronize``)."""
        self.synchronize()
        if self._pending:
            raise RuntimeError(
                "state_dict() with gradients accumulated since the last step; call step() first"
            )
        masters = {t.names[0]: t.master.detach().clone() for t in self.host.trainable if t.master is not None}
        previous = {}
        if self.config.async_optimizer:
            # the next iteration runs on the weights one step behind the masters
            version = max(self.steps - 1, 0)
            previous = {t.names[0]: t.source(version).clone() for t in self.host.trainable}
        return {
            "format": 1,
            "steps": self.steps,
            "serial": self._serial,
            "rotation": self._rotation,
            "lr": self.config.lr,
            "loss_scaling": self.optimizer.scaling_state(self.steps),
            "async_optimizer": self.config.async_optimizer,
            "masters": masters,
            "previous": previous,
            "optimizer": self.optimizer.state_dict(),
            "plan": None if self.plan is None else self.plan.to_counts(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: masters, moments, step count, rotation and RNG position.

        Raises:
            ValueError: the state belongs to a different model or optimizer mode.
        """
        self.synchronize()
        if state.get("format") != 1:
            raise ValueError(f"state format {state.get('format')!r} is not 1")
        if bool(state["async_optimizer"]) != self.config.async_optimizer:
            raise ValueError(
                f"state was saved with async_optimizer={state['async_optimizer']}, "
                f"the engine has {self.config.async_optimizer}"
            )
        masters = state["masters"]
        names = {t.names[0] for t in self.host.trainable}
        if set(masters) != names:
            missing, extra = sorted(names - set(masters)), sorted(set(masters) - names)
            raise ValueError(
                f"state masters do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        steps = int(state["steps"])
        with torch.no_grad():
            for t in self.host.trainable:
                src = masters[t.names[0]]
                if t.master is None or src.shape != t.master.shape:
                    raise ValueError(f"state master {t.names[0]} has shape {tuple(src.shape)}")
                t.master.copy_(src)
                t.source(steps).copy_(src)
                if self.config.async_optimizer:
                    t.source(max(steps - 1, 0)).copy_(state["previous"][t.names[0]])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_scaling_state(state.get("loss_scaling"), steps)
        self.steps = steps
        self._serial = int(state["serial"])
        self._rotation = int(state["rotation"]) % len(self.workers)
        self.config.lr = float(state["lr"])
        if state.get("plan") is not None and self._manual is False:
            self.plan = Plan.from_counts(self.host.num_layers, **state["plan"])
        with self.board.cv:
            self.board.version = [steps] * len(self.board.version)
            self.board.cv.notify_all()

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the threads and free host and device memory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.board.fail(EngineError("the engine was closed"))
        for w in self.workers:
            w.stop()
        self.optimizer.stop()
        self.workers = []
        self._pending, self._inflight, self._calibration = [], [], []
        for d in self.devices:
            if d.type == "cuda":  # no copy from or to host memory is still in flight
                torch.cuda.synchronize(d)
        self.host.release()
        if any(d.type == "cuda" for d in self.devices):
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_before
            torch.cuda.empty_cache()

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        with self.board.cv:
            self.board.check()

    # -- planning ------------------------------------------------------------------------------
    def _replan_due(self) -> bool:
        steps = self.config.calibration_steps
        # after a resume the measured plan comes from the state, with nothing measured here
        return not self._manual and bool(self._calibration) and self._serial == steps

    def _make_plan(self, mbs: list[MicroBatch]) -> Plan:
        costs = memory_costs(
            self.host,
            microbatch_tokens=max(int(mb.input_ids.numel()) for mb in mbs),
            hidden_size=int(self.adapted.config.hidden_size),
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
            vocab_size=int(self.adapted.config.vocab_size),
            loss_chunk_tokens=self.config.loss_chunk_tokens,
            # a block's activations as measured for its family (engine.planner.activation_table)
            shape=model_shape(self.adapted.config, self.adapted.architecture),
        )
        measured = False
        if self._replan_due():
            # their workers finished, so their layer times are complete; the optimizer's fold
            # and step of them go on meanwhile (a plan reads no weights or gradients)
            for it in self._calibration:
                self.board.wait_for(_finished(it))
            # a cancelled iteration measured only part of the layers
            self._calibration = [it for it in self._calibration if it.aborted is None]
            if not self._calibration and self.plan is not None:
                return self.plan
            measured = bool(self._calibration)
            if measured:
                costs = measured_costs(self._calibration, costs)
        round_size = self.config.round_size
        plan = choose_plan(
            costs,
            measured=measured,
            num_workers=len(self.workers),
            num_microbatches=len(mbs),
            memory_budget=memory_budget(self.devices, self.config.memory_budget_bytes),
            round_size=round_size,
            async_optimizer=self.config.async_optimizer,
            previous=self.plan,
        )
        grid = plan_grid(
            plan, num_workers=len(self.devices), num_microbatches=len(mbs), round_size=round_size
        )
        data: dict[str, Any] = {
            **plan.to_counts(),
            "grid": grid,
            "compute_dtype": self.config.compute_dtype,
            "tf32": self.tf32,
        }
        if measured:
            same = " (unchanged)" if plan == self.plan else ""
            message = f"partition from measured layer times: {plan.describe()}{same}"
            self._event(EngineEvent.REPARTITION, message, data)
            self._calibration = []
        else:
            self._event(EngineEvent.PARTITION, f"partition from parameter bytes: {plan.describe()}", data)
        return plan

    def _event(self, kind: str, message: str, data: dict[str, Any]) -> None:
        with self._sink_lock:
            self.sink.event(kind, message, data)

    def _on_step(self, job: StepJob) -> None:
        """Per-step metrics, called on the optimizer thread when a step finished."""
        metrics = job.metrics(loss_scale=self.optimizer.loss_scale, num_workers=len(self.devices))
        with self._sink_lock:
            self.sink.log(metrics, job.index)
        if job.nonfinite:
            what = " and ".join(job.nonfinite)
            message = (
                f"step {job.index} skipped: its {what} was not finite (no weight changed; "
                f"{job.nonfinite_in_a_row} in a row, the run fails at {self.config.max_nonfinite_steps})"
            )
            data = {"step": job.index, "what": list(job.nonfinite), "in_a_row": job.nonfinite_in_a_row}
            self._event(EngineEvent.SKIPPED, message, data)


def _finished(it: Iteration) -> Callable[[], bool]:
    return lambda: it.remaining == 0
