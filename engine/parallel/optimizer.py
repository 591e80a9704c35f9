"""The optimizer worker: one CPU thread that owns the fp32 copy.

It runs a queue of jobs in order. A *fold* job adds an iteration's gradient contributions into
the fp32 gradient buffers in a canonical order (round by round, top layer first), whatever order
the workers produced them in, which is what makes results independent of the number of workers
and of the partition. A *step* job clips by the global norm and updates the masters unit by unit
(bottom layer first, so the next iteration's first stage can start early), then publishes each
unit's new compute copy once every upload of the old one has finished.

sync mode: the iteration after step t runs on the weights after step t.
async mode (staleness 1): the iteration after step t runs on the weights after step t-1, which
step t-1 published into the second of two compute buffers, so it starts while step t is still
being applied in the background.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.errors import Cancelled, EngineError
from engine.optimizers import optimizer_spec
from engine.parallel.activity import activity_metrics
from engine.parallel.board import Board, Iteration
from engine.parallel.gradients import add_gradients
from engine.parallel.host import HostState
from engine.parallel.objective import objective_metrics
from engine.parallel.transfer import DeviceLink
from engine.parallel.units import build_units, global_norm
from engine.scheduling.exchange import GBIT, ring_bytes

if TYPE_CHECKING:
    from engine.distributed.group import Group

GROWTH_INTERVAL = 1000  # good float16 steps before the loss scale doubles


@dataclass
class StepJob:
    index: int  # 1-based number of this step
    lr: float
    iterations: list[Iteration]
    grad_norm: float = float("nan")
    seconds: float = 0.0
    skipped: bool = False
    # what was not finite when the step was skipped for it ("loss", "gradient norm"); empty for a
    # step applied, or skipped by float16's loss scaling
    nonfinite: list[str] = field(default_factory=list)
    nonfinite_in_a_row: int = 0
    # the optimizer thread's seconds per phase: fold (adding the iterations' gradients into the
    # fp32 buffers, during the iterations), norm (the global norm and the clipping), update (the
    # optimizer's update and zeroing the gradients), copy (writing the compute copies)
    phases: dict[str, float] = field(default_factory=dict)
    period: float = 0.0  # seconds since the previous step finished (0: the first step here)
    # on several boxes: the gradient exchange's seconds, the bytes this box sent, and the job's
    # input tokens of the step (every box's share)
    exchange: dict[str, float] = field(default_factory=dict)

    def metrics(self, *, loss_scale: float, num_workers: int) -> dict[str, float]:
        """The step's metrics for the sink, once it finished (``loss/train``, ``accuracy/train``: the
        share of label tokens whose argmax was the label, ``time/*``, ...; and the objective's own,
        e.g. ``dpo/*``, whose ``loss/train`` is the mean over pairs, without ``accuracy/train``).

        ``time/optimizer_s`` is the step itself (norm, update and copy, and the waits for the
        uploads of the old compute copies); ``time/optimizer/<phase>_s`` the phases (``fold``
        runs before it, while the iterations run); ``time/period_s`` the time since the
        previous step finished (``time/step_s`` for the first); the waits, idle time, transfers
        and prefetch hit rate are ``engine.parallel.activity``'s."""
        its = self.iterations
        wall = max(time.perf_counter() - its[0].started, 1e-9)
        span = max(max(it.finished for it in its) - its[0].started, 1e-9)
        for it in its:
            it.settle_times()
        busy = sum(sum(it.busy_s.values()) for it in its)
        tokens = sum(it.total_tokens for it in its)
        loss = sum(it.loss_sum() for it in its) / tokens
        inputs = self.exchange.get("tokens") or sum(
            sum(int(mb.input_ids.numel()) for mb in it.microbatches) for it in its
        )
        metrics = {
            "loss/train": loss,
            "tokens/label": float(tokens),
            "throughput/tokens_per_s": inputs / wall,
            "optim/grad_norm": self.grad_norm,
            "optim/skipped": float(self.skipped),
            "optim/loss_scale": loss_scale,
            "optim/lr": self.lr,
            "time/step_s": wall,
            "time/optimizer_s": self.seconds,
            "pipeline/bubble_ratio": max(0.0, 1.0 - busy / (num_workers * span)),
        }
        metrics.update({f"time/optimizer/{name}_s": s for name, s in self.phases.items()})
        if self.exchange:
            seconds, sent = self.exchange["s"], self.exchange["bytes"]
            metrics.update(
                {
                    "exchange/s": seconds,
                    "exchange/bytes": sent,
                    "exchange/gbps": sent / max(seconds, 1e-9) / GBIT,
                }
            )
        period = self.period or wall
        metrics["time/period_s"] = period
        metrics.update(activity_metrics([it.activity for it in its], num_workers=num_workers, period=period))
        for it in its:
            for name, s in it.stage_s.items():
                metrics[f"time/stage/{name}_s"] = metrics.get(f"time/stage/{name}_s", 0.0) + s
        correct = [it.correct_tokens() for it in its]  # None: the objective scores sequences (DPO)
        if all(c is not None for c in correct):
            metrics["accuracy/train"] = sum(c or 0 for c in correct) / tokens
        metrics.update(objective_metrics(its))  # e.g. a DPO step's rewards (and its answers' tokens)
        return metrics


def optimizer_threads(cfg: EngineConfig) -> int:
    """The threads of the optimizer's kernels: ``cfg.optimizer_threads``, or every core torch
    uses less one per GPU worker (its thread launches kernels while the optimizer runs)."""
    if cfg.optimizer_threads is not None:
        return cfg.optimizer_threads
    gpus = sum(1 for d in cfg.devices if d != "cpu")
    return max(1, torch.get_num_threads() - gpus)


class OptimizerWorker:
    """The CPU thread that folds gradients and applies optimizer steps.

    Args:
        host: the host state it updates.
        board: the engine's blackboard.
        cfg: the engine config (optimizer, its hyperparameters, max_grad_norm, async_optimizer,
            compute_dtype, initial_loss_scale).
        on_step: called (on this thread) after every step with the finished job.
        group: the boxes of a job on several (``engine.distributed``): each step first sums every
            box's gradients (and the step's input tokens) over them.
    """

    def __init__(
        self,
        host: HostState,
        board: Board,
        cfg: EngineConfig,
        on_step: Callable[[StepJob], None],
        *,
        group: Group | None = None,
    ) -> None:
        self.host = host
        self.group = group
        self.board = board
        self.cfg = cfg
        self.on_step = on_step
        # one optimizer per unit, over the unit's flat master block (engine.parallel.units)
        self.units = build_units(host, optimizer_spec(cfg.optimizer, field="EngineConfig.optimizer"), cfg)
        self.threads = optimizer_threads(cfg)
        # float16 compute: the loss is scaled so small gradients survive; a step whose
        # gradients overflowed is skipped (the weights stay, the step still counts)
        self.dynamic_scaling = cfg.compute_dtype == "float16"
        self.loss_scale = float(cfg.initial_loss_scale) if self.dynamic_scaling else 1.0
        self._good_steps = 0
        self._skipped_in_a_row = 0
        self._nonfinite_in_a_row = 0
        self._last_step_end: float | None = None
        board.loss_scales[0] = self.loss_scale
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="roundpipe-optimizer", daemon=True)
        self.thread.start()

    @property
    def optimizers(self) -> dict[int, torch.optim.Optimizer]:
        """Each unit's torch optimizer (over the unit's flat block), by unit."""
        return {owner: unit.optimizer for owner, unit in self.units.items()}

    # -- public ------------------------------------------------------------------------------
    def submit_fold(self, it: Iteration) -> None:
        self.jobs.put(("fold", it))

    def submit_step(self, job: StepJob) -> None:
        self.jobs.put(("step", job))

    def drain(self) -> None:
        """Block until every submitted job ran (or the engine failed)."""
        while self.jobs.unfinished_tasks:
            with self.board.cv:
                self.board.check()
            time.sleep(0.001)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                kind, payload = job
                if self.board.error is not None:
                    continue
                if kind == "fold":
                    self._fold(payload)
                else:
                    self._step(payload)
            except BaseException as exc:  # surfaces in the caller's next engine call
                if isinstance(exc, EngineError):
                    exc.stage = exc.stage or "optimizer"
                    self.board.fail(exc)
                else:
                    error = EngineError(f"optimizer worker: {type(exc).__name__}: {exc}", stage="optimizer")
                    self.board.fail(error)
            finally:
                self.jobs.task_done()

    def _fold(self, it: Iteration) -> None:
        layers = [
            i
            for i in reversed(range(self.host.num_layers))
            if any(self.host.tensors[k].trainable for k in self.host.layer_keys[i].values())
        ]
        try:
            unscale = 1.0 / self.board.scale_for(it)
            for r in range(len(it.rounds)):
                for layer in layers:
                    key = (it.serial, r, layer)
                    self.board.wait_for(self._arrived(key), it)
                    with self.board.cv:
                        contribution = self.board.deposits.pop(key)
                    DeviceLink.host_wait(contribution[1])  # its download: not the fold's own time
                    t0 = time.perf_counter()
                    add_gradients(self.host, self.board, contribution, unscale, threads=self.threads)
                    it.fold_s += time.perf_counter() - t0
        except Cancelled:
            pass
        # every worker left the iteration: its bookkeeping is complete (metrics read it), and a
        # stage that deposits nothing (a frozen input layer) can no longer cancel it
        self.board.wait_for(lambda: it.remaining == 0)
        if it.aborted is not None:
            with self.board.cv:
                for key in [k for k in self.board.deposits if k[0] == it.serial]:
                    del self.board.deposits[key]
            self.host.zero_grads()

    def _arrived(self, key: tuple[int, int, int]) -> Callable[[], bool]:
        return lambda: key in self.board.deposits

    def _step(self, job: StepJob) -> None:
        t0 = time.perf_counter()
        self.host.settle_grads()  # a tensor no contribution reached this step has a zero gradient
        if self.group is not None:
            self._exchange(job)
        known = self.host.grad_norm_sq()  # measured by the fold as it wrote the gradients
        job.grad_norm = math.sqrt(known) if known is not None else float(global_norm(self.units))
        # clipping as torch.nn.utils.clip_grad_norm_ does it, applied as the update reads the gradients
        divisor = 1.0
        if self.cfg.max_grad_norm is not None and math.isfinite(job.grad_norm):
            coef = self.cfg.max_grad_norm / (job.grad_norm + 1e-6)
            divisor = 1.0 / coef if coef < 1.0 else 1.0
        norm_s = time.perf_counter() - t0
        # never apply a non-finite update: a step whose loss or gradient norm is not finite changes
        # no weight, moment or optimizer step count. float16's overflowing gradients (a finite
        # loss) are the loss scale's to answer; anything else counts towards max_nonfinite_steps.
        loss_finite = all(math.isfinite(it.loss_sum()) for it in job.iterations)
        grad_finite = math.isfinite(job.grad_norm)
        overflow = self.dynamic_scaling and loss_finite and not grad_finite
        if not loss_finite:
            job.nonfinite.append("loss")
        if not grad_finite and not overflow:
            job.nonfinite.append("gradient norm")
        skip = overflow or bool(job.nonfinite)
        if self.dynamic_scaling and not job.nonfinite:
            self._rescale(overflow=overflow)
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if job.nonfinite else 0
        job.nonfinite_in_a_row = self._nonfinite_in_a_row
        job.skipped = skip
        with self.board.cv:
            self.board.loss_scales[job.index] = self.loss_scale
            for old in [v for v in self.board.loss_scales if v < job.index - 4]:
                del self.board.loss_scales[old]
            self.board.cv.notify_all()
        update_s = copy_s = 0.0
        for owner, unit in self.units.items():
            if unit.writes_copies and not skip:
                # one pass: the update writes the compute copy (once its old uploads finished)
                self._wait_for_uploads(owner, job.index)
                t1 = time.perf_counter()
                targets = self.host.compute_targets(owner, job.index)
                unit.step_writing(job.lr, targets, grad_divisor=divisor, threads=self.threads)
                update_s += time.perf_counter() - t1
                self.board.set_version(owner, job.index)
                continue
            t1 = time.perf_counter()
            if not skip:
                unit.step(job.lr, grad_divisor=divisor)
            update_s += time.perf_counter() - t1
            copy_s += self._publish(owner, job.index)
        self.host.zero_grads()  # the next step's first contributions overwrite the buffers
        end = time.perf_counter()
        job.seconds = end - t0
        fold_s = sum(it.fold_s for it in job.iterations)
        job.phases = {"fold": fold_s, "norm": norm_s, "update": update_s, "copy": copy_s}
        if self._last_step_end is not None:
            job.period = end - self._last_step_end
        self._last_step_end = end
        self.on_step(job)
        if self._nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise EngineError(
                f"{self._nonfinite_in_a_row} steps in a row (the last: step {job.index}) had a "
                f"non-finite {' and '.join(job.nonfinite)} and were skipped, changing no weight: the "
                "training diverged or a reward or input is not finite; lower the learning rate, check "
                "the data and rewards, and resume from the last checkpoint",
                stage="optimizer",
            )

    def _exchange(self, job: StepJob) -> None:
        """Sum every box's gradients (each unit's fp32 block) and the step's input tokens over
        the boxes: afterwards every box holds the whole batch's gradients, so the norm, the
        clipping and the update are the same everywhere."""
        assert self.group is not None
        t0 = time.perf_counter()
        grads = [unit.grad for unit in self.units.values()]
        self.group.sum_(grads)
        self.host.grad_sq.clear()  # the fold measured this box's share: measure the sum instead
        seconds = time.perf_counter() - t0
        inputs = sum(sum(int(mb.input_ids.numel()) for mb in it.microbatches) for it in job.iterations)
        (tokens,) = self.group.sum_values([float(inputs)])
        size = sum(int(g.numel()) * g.element_size() for g in grads)
        job.exchange = {"s": seconds, "bytes": ring_bytes(size, self.group.world_size), "tokens": tokens}

    def _rescale(self, *, overflow: bool) -> None:
        """float16 dynamic loss scaling: halve on overflow, double after a run of good steps."""
        if overflow:
            self._skipped_in_a_row += 1
            if self._skipped_in_a_row >= self.cfg.max_skipped_steps:
                raise EngineError(
                    f"float16: {self._skipped_in_a_row} steps in a row had non-finite gradients "
                    f"(loss scale now {self.loss_scale:g}) and were skipped: the model diverged or "
                    "overflows float16 even unscaled; lower the learning rate or train in bfloat16"
                )
            self.loss_scale = max(self.loss_scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._skipped_in_a_row = 0
        self._good_steps += 1
        if self._good_steps >= GROWTH_INTERVAL:
            self.loss_scale *= 2.0
            self._good_steps = 0

    def _publish(self, owner: int, version: int) -> float:
        """Write unit ``owner``'s masters into the compute buffer of ``version``.

        sync mode has one buffer: it waits until no upload of version - 1 is outstanding.
        async mode alternates two buffers: it waits for the uploads of version - 2, so the
        iteration still running on version - 1 is never held up.

        Returns:
            The seconds the copy itself took (not the waits before it).
        """
        self._wait_for_uploads(owner, version)
        t0 = time.perf_counter()
        self.host.refresh_compute(owner, version)
        took = time.perf_counter() - t0
        self.board.set_version(owner, version)
        return took

    def _wait_for_uploads(self, owner: int, version: int) -> None:
        """Until the compute buffer ``version`` of unit ``owner`` may be rewritten (``_publish``)."""
        board = self.board
        lag = 2 if self.cfg.async_optimizer else 1
        board.wait_for(lambda: board.outstanding.get((owner, version - lag), 0) == 0)
        with board.cv:
            uploads = board.upload_events.pop((owner, version - lag), [])
        for event in uploads:
            DeviceLink.host_wait(event)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[int, Any]:
        """Each unit's optimizer state in the per-tensor layout of ``torch.optim``."""
        return {owner: unit.state_dict() for owner, unit in self.units.items()}

    def scaling_state(self, steps: int) -> dict[str, Any]:
        """The dynamic loss scale and the scales of the weights versions a resume may run on."""
        with self.board.cv:
            recent = {str(v): s for v, s in self.board.loss_scales.items() if v >= steps - 1}
        return {"scale": self.loss_scale, "good_steps": self._good_steps, "versions": recent}

    def load_scaling_state(self, state: dict[str, Any] | None, steps: int) -> None:
        """After a resume: continue with the saved scale (the config's when there is none)."""
        if state is not None:
            self.loss_scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        with self.board.cv:
            self.board.loss_scales.clear()
            for v in (steps - 1, steps):
                self.board.loss_scales[max(v, 0)] = self.loss_scale
            if state is not None:
                self.board.loss_scales.update({int(v): float(s) for v, s in state["versions"].items()})

    def load_state_dict(self, state: dict[int, Any]) -> None:
        if set(state) != set(self.units):
            raise ValueError(
                f"optimizer state covers units {sorted(state)}, the engine has {sorted(self.units)}"
            )
        for owner, sd in state.items():
            self.units[owner].load_state_dict(sd)
