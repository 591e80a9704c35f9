"""``train(config, sink, cancel)``: a whole fine-tuning run — the one module that knows them all.

It builds the tokenizer, the model (+ LoRA), the data and the RoundPipe engine, then loops:
one batch, one optimizer step at the scheduled learning rate, metrics to the sink, validation
and checkpoints on their schedules. It always starts by resuming from the latest checkpoint of
its output folder, so a stopped or redelivered run continues exactly where it was; on cancel it
stops at a step boundary and writes a final checkpoint. What it trains on and how (examples or
preference pairs, a reference pass before the first step, the loss and its metrics) is the
method's (``engine.methods``: ``method.objective``), behind one ``MethodRun``.

A job that spans several boxes (``boxes``: ``engine.distributed``) runs this on every box with
the same configuration: the boxes join first, agree that they train the same thing, and each
draws the same batches and trains its share of them; rank 0 alone reads and writes the
checkpoints (sending the resumed state to the others), and reports metrics and checkpoints.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.config import EngineConfig, TrainConfig, resolve_compute_dtype
from engine.data.batches import Batcher
from engine.distributed.boxes import Boxes, BoxLost
from engine.distributed.consent import check_same_job, events_only, required_rows
from engine.errors import Cancelled, ConfigError, EngineError
from engine.kinds import EngineEvent, RunStatus
from engine.methods import method_entry
from engine.metrics import FanoutSink, NullSink, Sink
from engine.model.export import base_model_name, save_export
from engine.model.families import DEFAULT_LORA_TARGETS, family_for
from engine.model.loading import (
    checkpoint_dtype,
    load_model,
    load_processor_for,
    load_tokenizer,
    resolve_model_path,
    vision_architecture,
)
from engine.roundpipe import RoundPipe
from engine.tracking import TrackingOptions, warn_into
from engine.tracking import start as start_trackers
from engine.training.checkpoint import (
    load_method_state,
    load_state,
    save_state,
    tensor_bytes,
    write_checkpoint,
)
from engine.training.checkpoint_layout import (
    CheckpointKind,
    checkpoints_dir,
    folder_bytes,
    latest,
    list_checkpoints,
)
from engine.vision import tuning
from engine.vision.families import vision_spec
from engine.vision.pixels import row_pixels

T = TypeVar("T")

if TYPE_CHECKING:
    from engine.distributed.group import Group


@dataclass
class TrainResult:
    status: RunStatus
    step: int
    total_steps: int
    checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)


def learning_rate(step: int, *, total: int, peak: float, warmup: int, schedule: str) -> float:
    """The learning rate of the step with 0-based index ``step``: linear warmup, then the schedule."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def devices_for(spec: str | list[str]) -> list[str]:
    if spec != "auto":
        return list(spec)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def lora_targets(configured: Sequence[str], architecture: str) -> list[str]:
    """The modules LoRA adapts: those configured, or the family's own when the run kept the
    default (families that fuse projections, e.g. Phi-3's ``qkv_proj``, name them differently;
    the mixture-of-experts families adapt their attention, their experts through
    ``lora_target_parameters``)."""
    if tuple(configured) == tuple(DEFAULT_LORA_TARGETS):
        return list(family_for(architecture).lora_targets)
    return list(configured)


# in ``method.target_parameters``: the expert weights of the model's family
EXPERTS = "experts"


def lora_target_parameters(configured: Sequence[str], model: Any) -> list[str]:
    """The weights LoRA adapts directly (peft ``target_parameters``, e.g. the fused 3-D expert
    weights of a mixture-of-experts block): those configured, ``"experts"`` standing for the
    family's expert weights (``FamilySpec.expert_parameters``).

    A name matches the parameters whose full name is it or ends with ``"." + name``, as in peft.

    Raises:
        ConfigError: (field ``method.target_parameters``) ``"experts"`` for a family without
            experts, or a name that matches no parameter of ``model``, or one that is not a
            matrix or a stack of expert matrices (peft adapts 2-D and 3-D parameters).
    """
    field = "method.target_parameters"
    architecture = type(model).__name__
    experts = family_for(architecture).expert_parameters if configured else ()
    names: list[str] = []
    for name in configured:
        if name == EXPERTS and not experts:
            raise ConfigError(
                field, f"{field}: {EXPERTS!r}: {architecture} has no expert weights", value=list(configured)
            )
        for one in experts if name == EXPERTS else (name,):
            if one not in names:
                names.append(one)
    shapes = {n: p.dim() for n, p in model.named_parameters()}
    hint = f" (its expert weights: {', '.join(experts)})" if experts else ""
    for name in names:
        dims = {d for n, d in shapes.items() if n == name or n.endswith("." + name)}
        if not dims:
            raise ConfigError(
                field, f"{field}: {name!r} names no parameter of {architecture}{hint}", value=list(configured)
            )
        if not dims <= {2, 3}:
            raise ConfigError(
                field,
                f"{field}: {name!r} is not a weight matrix or a stack of expert matrices "
                f"({'/'.join(str(d) for d in sorted(dims))}-D)",
                value=list(configured),
            )
    return names


def tuned(model: Any, m: Any) -> Any:
    """``model`` made ready for what the run's ``method`` section trains: every weight (a full
    fine-tune, a VLM's frozen tower and projector left out), or a LoRA adapter (peft) on the
    target modules, with a VLM's tower and projector frozen, adapted or trained whole as asked
    (``engine.vision.tuning``).

    Raises:
        ConfigError: a target or a tower/projector setting the model cannot take.
    """
    architecture = type(model).__name__
    vision = vision_spec(architecture)
    tuning.check_options(vision, architecture, m)
    if not m.lora:
        if vision is not None:
            tuning.freeze(model, vision, m)
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(m.target_modules, architecture)
    saved: list[str] = []
    if vision is not None:
        # the language model's layers by name, the tower's and projector's as asked
        targets, saved = tuning.lora_modules(model, vision, targets, m)
    parameters = lora_target_parameters(m.target_parameters, model)
    lora = LoraConfig(
        r=m.lora_r,
        lora_alpha=m.lora_alpha,  # type: ignore[arg-type]  # peft accepts floats
        lora_dropout=m.lora_dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        modules_to_save=saved or None,
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, lora)
    except ValueError as exc:
        raise ConfigError(
            "method.target_modules", f"method.target_modules={targets}: {exc}", value=targets
        ) from exc
    if vision is not None and saved:
        tuning.settle_saved(wrapped, vision, m)
    return wrapped


class Run:
    """The objects of one run; ``train()`` drives it."""

    def __init__(
        self,
        config: TrainConfig,
        sink: Sink,
        cancel: threading.Event | None,
        models_dir: Path,
        *,
        reserve_bytes: int = 0,
        group: Group | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.reserve_bytes = reserve_bytes
        self.sink = sink
        self.cancel = cancel
        self.folder = resolve_model_path(config.model.path, models_dir)
        self.base_name = base_model_name(config.model.name, self.folder)  # a hub id, never a path
        # a vision-language model's processor (its tokenizer and image processor) encodes the data
        self.processor = load_processor_for(self.folder)
        self.tokenizer = load_tokenizer(self.folder) if self.processor is None else self.processor.tokenizer
        # the method's examples (or pairs), steps and validation
        self.method = method_entry(config.method.objective).run_class()(
            config, self.processor or self.tokenizer
        )
        pixels = None
        if self.processor is not None:
            pixels = row_pixels(self.processor, str(vision_architecture(self.folder)))
            self.method.pixels = pixels
        self.method.group = group
        train = self.method.train
        devices = devices_for(config.engine.devices)
        dtype = resolve_compute_dtype(config.engine.compute_dtype, on_gpu=devices[0].startswith("cuda"))
        self.compute_dtype = dtype
        torch.manual_seed(config.hyper.seed)  # LoRA initialisation
        self.model = self._model()
        h = config.hyper
        self.engine = RoundPipe(
            self.model,
            EngineConfig(
                devices=devices,
                num_microbatches=config.engine.num_microbatches,
                optimizer=h.optimizer,
                lr=h.learning_rate,
                weight_decay=h.weight_decay,
                max_grad_norm=h.max_grad_norm,
                max_nonfinite_steps=h.max_nonfinite_steps,
                async_optimizer=config.engine.async_optimizer,
                compute_dtype=dtype,
                partition=config.engine.partition,
                seed=h.seed,
                router_aux_loss=h.router_aux_loss,
                tf32=config.engine.tf32,
                router_aux_loss_coef=h.router_aux_loss_coef,
                base_bits=config.method.base_bits,
            ),
            sink=sink,
            # on several boxes a stop is voted at step boundaries (``loop``), never mid-batch
            cancel=None if group is not None else cancel,
            group=group,
        )
        self.pad_id = int(self.tokenizer.pad_token_id)
        # a method that trains each batch several steps (GRPO's num_iterations) is served it as often
        self.batcher = Batcher(
            train, h.batch_size, h.seed, self.pad_id, repeat=self.method.steps_per_batch, pixels=pixels
        )
        if h.max_steps is not None:
            self.total = h.max_steps
        else:
            self.total = max(1, math.ceil((h.epochs or 1.0) * self.batcher.steps_per_epoch))
        self.checkpoints = checkpoints_dir(config.output_dir)
        self.step = 0

    def _model(self) -> Any:
        m = self.config.method
        # loaded in the compute dtype: those tensors become the engine's compute copies (no
        # second copy while loading); a full fine-tune of a float32 checkpoint computing in less
        # loads float32, so its fp32 masters start from the stored values
        stored = checkpoint_dtype(self.folder)
        full_precision = not m.lora and stored in (None, "float32") and self.compute_dtype != "float32"
        # a 4-bit base keeps a quantized checkpoint's weights packed as stored (no dense copy)
        model = load_model(
            self.folder,
            dtype="float32" if full_precision else self.compute_dtype,
            keep_packed=m.lora and m.base_bits == 4,
        )
        return tuned(model, m)

    def prepare(self) -> None:
        """The method's work before the first step (DPO's reference log-probabilities), on the
        initial weights, so before ``resume``."""
        self.method.prepare(
            self.engine,
            Path(self.config.output_dir),
            base=str(self.folder),
            compute_dtype=self.compute_dtype,
            batch_size=self.config.hyper.batch_size,
            pad_id=self.pad_id,
            sink=self.sink,
        )

    def resume(self) -> None:
        """Continue from the latest checkpoint; on several boxes rank 0's, sent to the others."""
        group = self.group
        found = latest(self.checkpoints) if group is None or group.writer else None
        saved = None
        if found is not None:
            saved = (found[1].name, *load_state(found[1]), load_method_state(found[1]))
        if group is not None:
            saved = group.broadcast(saved)
        if saved is None:
            return
        name, engine_state, trainer_state, method_state = saved
        self.engine.load_state_dict(engine_state)
        self.batcher.load_state_dict(trainer_state["batcher"])
        self.method.load_state_dict(method_state)
        self.step = int(trainer_state["step"])
        self.sink.event(EngineEvent.RESUME, f"resumed from {name}", {"step": self.step})

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (on several boxes rank 0 does; the others
        only finish the step: None)."""
        engine = self.engine
        engine.synchronize()
        if self.group is not None and not self.group.writer:
            return None
        lora = self.config.method.lora
        weights = engine.master_state_dict(trainable_only=lora)
        if lora:
            weights = tuning.with_saved_modules(self.model, weights)
        state = engine.state_dict()
        method_state = self.method.state_dict()  # e.g. a GRPO batch the next steps train on

        def fill(tmp: Path) -> None:
            save_export(
                self.model, weights, self.tokenizer, tmp, base_name=self.base_name, base_folder=self.folder
            )
            trainer_state = {
                "step": self.step,
                "total_steps": self.total,
                "batcher": self.batcher.state_dict(),
                "base_model": str(self.folder),
                "base_name": self.base_name,
                "method": self.config.method.kind,
                "config": self.config.model_dump(mode="json"),
            }
            save_state(tmp, state, trainer_state, method_state)

        path = write_checkpoint(
            self.checkpoints,
            self.step,
            fill,
            keep_last=self.config.checkpoint.keep_last,
            needed_bytes=tensor_bytes(weights) + tensor_bytes(state) + tensor_bytes(method_state),
            reserve_bytes=self.reserve_bytes,
        )
        kind = CheckpointKind.ADAPTER if lora else CheckpointKind.FULL
        self.sink.checkpoint_saved(self.step, path, kind, folder_bytes(path))
        return path

    def validate(self) -> float | None:
        batch_size = self.config.hyper.batch_size
        try:
            metrics = self.method.validate(self.engine, batch_size, self.pad_id)
        except Cancelled:
            return None  # the loop stops at its next check
        if metrics is None:
            return None
        self.sink.log(metrics, self.step)
        return metrics["loss/val"]

    def loop(self) -> TrainResult:
        h, every_eval = self.config.hyper, self.config.eval.every_steps
        started, first = time.perf_counter(), self.step
        status, last_saved, metrics = RunStatus.SUCCEEDED, None, {}
        while self.step < self.total:
            stop = self.cancel is not None and self.cancel.is_set()
            if self.group is not None:  # every box stops at the same step when any is asked to
                stop = self.group.any(stop)
            if stop:
                status = RunStatus.CANCELLED
                break
            position = self.batcher.state_dict()
            batch = self.batcher.next()
            lr = learning_rate(
                self.step, total=self.total, peak=h.learning_rate, warmup=h.warmup_steps, schedule=h.schedule
            )
            try:  # the engine logs a method's own metrics (e.g. DPO's rewards) with the step
                loss, extra = self.method.forward_backward(self.engine, batch)
            except Cancelled:
                self.batcher.load_state_dict(position)  # the batch was not trained on
                status = RunStatus.CANCELLED
                break
            self.engine.step(lr=lr)
            self.step += 1
            rate = (time.perf_counter() - started) / (self.step - first)
            # loss/train and optim/lr reach the sink from the engine with the same step
            metrics = {
                "progress/step": float(self.step),
                "progress/total_steps": float(self.total),
                "progress/epoch": self.batcher.epoch
                + self.batcher.position / max(self.batcher.steps_per_epoch, 1),
                "time/eta_s": rate * (self.total - self.step),
                "tokens/batch": float(int(batch["attention_mask"].sum())),
            }
            self.sink.log(metrics, self.step)
            metrics.update({"loss/train": loss, "optim/lr": lr, **extra})
            if every_eval and self.step % every_eval == 0 and self.step < self.total:
                self.validate()
            if self.step % self.config.checkpoint.every_steps == 0 or self.step == self.total:
                if self.step == self.total:
                    val = self.validate()
                    if val is not None:
                        metrics["loss/val"] = val
                last_saved = self.save()
        found = latest(self.checkpoints)
        if status == RunStatus.CANCELLED and (found is None or found[0] != self.step):
            last_saved = self.save()
        self.engine.synchronize()
        return TrainResult(
            status, self.step, self.total, last_saved or (found[1] if found else None), metrics
        )


def train(
    config: TrainConfig,
    sink: Sink | None = None,
    cancel: threading.Event | None = None,
    *,
    models_dir: str | Path = "data/models",
    reserve_bytes: int = 0,
    tracking: TrackingOptions | None = None,
    boxes: Boxes | None = None,
) -> TrainResult:
    """Run (or resume) a fine-tune to the end, or until ``cancel`` is set.

    Args:
        config: the run's configuration (paths absolute or relative to the working folder).
        sink: receives metrics and events (engine metrics and ``progress/*``, ``loss/val``).
        cancel: set it to stop at the next step boundary (or between micro-batches).
        models_dir: where the demo model is prepared.
        reserve_bytes: the disk space a checkpoint must leave free beside it.
        tracking: names, hashes and credentials for the trackers ``config.tracking`` asks for
            (``engine.tracking``); they get every metric and event the sink gets (on several
            boxes, rank 0's).
        boxes: this box's place in a job that spans several (``engine.distributed.Boxes``):
            every box runs ``train`` with the same configuration and data; rank 0 writes the
            checkpoints and reports metrics, the others' sinks get events only and their result
            has no checkpoint. None: this box alone.

    Returns:
        The final status, step and checkpoint.

    Raises:
        ConfigError: bad data (every invalid row named by line), model folder or settings; its
            ``field`` names the configuration field at fault.
        DiskFull: a checkpoint did not fit (or would leave less than ``reserve_bytes``); the
            checkpoints before it are intact, and a run started again resumes from the latest.
        BoxLost: on several boxes, another box died, left or lost its network (the message
            and ``host`` name it); this box stopped at its next exchange.
    """
    sink, lock = sink or NullSink(), threading.Lock()
    several = boxes is not None and boxes.world_size > 1
    if several:
        assert boxes is not None
        required_rows(config, boxes.world_size)  # before joining: a batch too small for the boxes
        if boxes.rank > 0:
            sink = events_only(sink)
    writer = not several or (boxes is not None and boxes.rank == 0)
    tracked = start_trackers(config, warn=warn_into(sink, lock), options=tracking) if writer else None
    if tracked is None:
        return _joined(config, sink, cancel, Path(models_dir), reserve_bytes, boxes if several else None)
    outcome = "failed"
    try:
        result = _joined(
            config,
            FanoutSink(sink, tracked, lock=lock),
            cancel,
            Path(models_dir),
            reserve_bytes,
            boxes if several else None,
        )
        outcome = str(result.status)
        return result
    finally:
        tracked.finish(outcome)


def _joined(
    config: TrainConfig,
    sink: Sink,
    cancel: threading.Event | None,
    models_dir: Path,
    reserve_bytes: int,
    boxes: Boxes | None,
) -> TrainResult:
    """``_train`` on this box alone, or after joining the job's other boxes (and leaving them
    at the end: on an error they are told why, and stop at their next exchange)."""
    if boxes is None:
        return _train(config, sink, cancel, models_dir, reserve_bytes, None)
    from engine.distributed.group import join

    group = join(boxes)
    try:
        check_same_job(group, config, models_dir)
        return _train(config, sink, cancel, models_dir, reserve_bytes, group)
    except BoxLost:
        raise
    except BaseException as exc:
        group.leave(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__)
        raise
    finally:
        group.close()


def _train(
    config: TrainConfig,
    sink: Sink,
    cancel: threading.Event | None,
    models_dir: Path,
    reserve_bytes: int,
    group: Group | None,
) -> TrainResult:
    run = Run(config, sink, cancel, models_dir, reserve_bytes=reserve_bytes, group=group)
    if group is not None:
        gradients = sum(t.master.numel() * 4 for t in run.engine.host.trainable if t.master is not None)
        sink.event(
            EngineEvent.BOXES,
            f"{group.world_size} boxes ({', '.join(group.hosts)}), their exchange measured at "
            f"{group.link_gbps:.2f} Gbit/s; {gradients / 2**20:.1f} MiB of gradients summed each step",
            {"hosts": list(group.hosts), "link_gbps": group.link_gbps, "gradient_bytes": int(gradients)},
        )
    try:
        try:
            run.prepare()
        except Cancelled:  # while computing a reference pass (DPO's log-probabilities)
            last = latest(run.checkpoints)
            return TrainResult(
                RunStatus.CANCELLED, last[0] if last else 0, run.total, last[1] if last else None
            )
        run.resume()
        if run.step >= run.total:
            found = list_checkpoints(run.checkpoints)
            return TrainResult(RunStatus.SUCCEEDED, run.step, run.total, found[-1][1] if found else None)
        try:
            return run.loop()
        except EngineError as exc:  # the step it failed at: the one being trained
            exc.step = run.step + 1 if exc.step is None else exc.step
            raise
    finally:
        try:
            run.method.close()
        finally:
            run.engine.close()
