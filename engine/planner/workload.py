"""The planner's inputs besides the model: the box (``Hardware``) and the job (``Workload``), with
the ranges a plan accepts for each number."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, TrainConfig, resolve_compute_dtype
from engine.errors import ConfigError
from engine.methods import METHODS as METHOD_TABLE
from engine.methods import TUNINGS
from engine.model.families import DEFAULT_LORA_TARGETS
from engine.optimizers import optimizer_spec

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MASTER_AND_GRAD_BYTES_PER_PARAM = 8  # fp32 master 4 + gradient 4; the optimizer state comes on top
LOSS_CHUNK_TOKENS: int = EngineConfig.loss_chunk_tokens  # the engine's default chunk of the loss

# The range of each hardware number a plan accepts: every real box lies well inside (an 8 GB
# consumer card to a 1 TB accelerator, an old PCIe 1.0 x4 link to NVLink-C2C), and anywhere in it
# the arithmetic neither divides by (almost) zero nor overflows. The API documents the same ranges.
HARDWARE_RANGES: dict[str, tuple[float, float]] = {
    "num_gpus": (1, 64),
    "gpu_memory_gb": (1.0, 1024.0),  # a card with less cannot hold the CUDA context and a layer
    "gpu_tflops": (0.001, 100_000.0),  # from one slow CPU core to the largest accelerator
    "efficiency": (0.001, 1.0),
    "link_gb_s": (0.1, 10_000.0),
    "host_ram_gb": (1.0, 1_048_576.0),
}
# the workload's counts, likewise (TrainConfig has the same limits or tighter ones)
WORKLOAD_LIMITS: dict[str, int] = {
    "seq_len": 1 << 20,
    "batch_size": 1 << 20,
    "num_microbatches": 4096,
    "lora_r": 4096,
    "loss_chunk_tokens": 1 << 30,
}
REFERENCE_PAIRS_LIMIT = 1 << 40  # pairs a DPO reference pass may cover
IMAGES_PER_ROW_LIMIT = 1024  # images a VLM's training row may hold, on average
IMAGE_EDGE_LIMIT = 1 << 16  # pixels along an image's edge
# a workload's ``method``: what trains (supervised) or a method of the registry (engine.methods)
METHODS = (*TUNINGS, *(name for name in METHOD_TABLE if name != "sft"))

# A CPU host (no GPU): the engine's ``devices: "auto"`` runs one CPU worker thread (engine/training/run.py
# ``devices_for``), whose matmuls use every core. Its fp32 rate, achieved, per core: measured on a
# 2-core x86-64 host (torch 2.13 CPU wheel), where SmolLM2-135M-Instruct LoRA ran at ~190 tokens/s
# on the demo's data and bench/results/engine_overhead.json's 6-block model (full fine-tune) at
# ~2,100 tokens/s; at 50 GFLOP/s per core the planner predicts ~180 and ~2,300 tokens/s for them.
# Calibrate with a finished job (``calibrate_job_id``).
CPU_GFLOPS_PER_CORE = 50.0
CPU_COPY_GB_S = 10.0  # a CPU worker's stage "upload" is a host memory copy
CPU_DEFAULT_RAM_GB = 16.0  # when the worker reports no RAM figure
# Where GRPO samples its completions (engine.planner.rollouts): a GPU reads the weights at
# GPU_MEMORY_GB_S (an RTX 4090's 1,008 GB/s; a 5090's 1,792); a host CPU (a CPU host's, or a GPU
# box's when the model does not fit one GPU) has its cores as the worker reports them, else
# HOST_CORES_ASSUMED, at CPU_GFLOPS_PER_CORE each, and streams the weights from RAM at
# HOST_MEMORY_GB_S (a desktop's dual-channel DDR4/DDR5 achieves 20-60 GB/s).
GPU_MEMORY_GB_S = 1000.0
HOST_CORES_ASSUMED = 8
HOST_MEMORY_GB_S = 20.0


@dataclass(frozen=True)
class Hardware:
    """The box: GPUs, their memory and rate, the host link and RAM.

    ``device="cpu"`` is a host without a GPU: one CPU worker (``num_gpus`` 1) whose "GPU memory"
    is the host's RAM and whose rate (``gpu_tflops`` at ``efficiency`` 1) is the cores' achieved
    fp32 rate; see :meth:`cpu_host`.
    """

    num_gpus: int = 2
    gpu_memory_gb: float = 24.0
    gpu_tflops: float = 165.0  # dense bf16 tensor rate of an RTX 4090
    link_gb_s: float = 25.0  # host <-> GPU, one direction, PCIe 4.0 x16 in practice
    host_ram_gb: float | None = None
    efficiency: float = 0.4  # achieved fraction of the peak rate
    detected: tuple[str, ...] = ()  # which fields were read off the machine
    device: str = "gpu"  # "gpu", or "cpu": a host whose workers report no GPU
    host_cores: int | None = None  # the host's CPU cores, when a worker reports them (GRPO's sampling)

    @classmethod
    def cpu_host(cls, *, cores: int, ram_gb: float | None, detected: tuple[str, ...] = ()) -> Hardware:
        """A host without GPUs: one CPU worker at ``CPU_GFLOPS_PER_CORE`` per core, in host RAM."""
        ram = ram_gb if ram_gb is not None else CPU_DEFAULT_RAM_GB
        return cls(
            num_gpus=1,
            gpu_memory_gb=ram,
            gpu_tflops=max(1, cores) * CPU_GFLOPS_PER_CORE / 1000,
            link_gb_s=CPU_COPY_GB_S,
            host_ram_gb=ram_gb,
            efficiency=1.0,
            detected=detected,
            device="cpu",
            host_cores=max(1, cores),
        )


@dataclass(frozen=True)
class Workload:
    """The job: sequence length, batch, method and engine settings.

    ``devices`` are the run's GPU workers when it names them (``engine.devices``; a GPU named
    twice holds two workers that share its memory); empty: one worker per GPU of the box.

    A preference job (``method="dpo"`` or ``"orpo"``, ``engine.methods``) trains a LoRA adapter
    or every weight (``dpo_tuning``) on preference pairs: ``batch_size`` counts pairs, and each
    pair's chosen and rejected sequence share a micro-batch, so a step trains ``2 * batch_size``
    sequences (``sequences``). Before the first step a method with a reference (DPO) runs one
    forward-only pass over the ``reference_pairs`` training and validation pairs for the reference
    log-probabilities (``engine.methods.dpo``).

    A GRPO job (``method="grpo"``) trains on prompts: ``batch_size`` counts prompts, and each step
    first samples ``group_size`` completions of each (up to ``completion_tokens`` tokens) on the
    host, then trains on the ``batch_size * group_size`` sequences of prompt and completion
    (``engine.planner.rollouts`` prices the sampling; ``kl_reference``: a forward pass for the
    reference's log-probabilities of the completions, when ``beta`` > 0: the base model's, or a
    full fine-tune's frozen copy of its initial weights, which host RAM holds too). With
    ``num_iterations`` mu > 1 a batch of completions trains mu steps: it is sampled (and its
    log-probabilities measured) once every mu steps, and an epoch is mu times as many steps.

    A vision-language model's job says how its vision tower and projector train
    (``vision_tower``, ``projector``: ``"frozen"``, ``"lora"`` or ``"full"``, as ``method``'s
    options) and what its rows hold: ``images_per_row`` images (on average) of ``image_size``
    (width, height) pixels; the planner prices the tower's patches and the image tokens from
    them (``engine.planner.vision``). A text model ignores them.
    """

    seq_len: int = 2048
    batch_size: int = 16
    method: str = "lora"  # "lora" or "full" (supervised), or a preference method: "dpo", "orpo"
    dpo_tuning: str = "lora"  # a preference job's: "lora" or "full"
    lora_r: int = 16
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    target_parameters: tuple[str, ...] = ()
    optimizer: str = "adamw"
    num_microbatches: int = 16
    compute_dtype: str = "bfloat16"
    async_optimizer: bool = False
    steps: int | None = None
    devices: tuple[str, ...] = ()
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    mean_seq_len: float | None = None  # tokens per sequence as batched (padded) from the data
    reference_pairs: int | None = None  # DPO: the pairs of the reference pass, when known
    base_bits: int = 16  # 4: a LoRA base's frozen block weights kept in NF4 (engine.model.quant)
    group_size: int | None = None  # GRPO: completions sampled per prompt (method.group_size)
    completion_tokens: int = 0  # GRPO: the longest completion sampled (method.max_completion_tokens)
    mean_prompt_len: float | None = None  # GRPO: tokens per prompt from the data, when known
    kl_reference: bool = False  # GRPO with beta > 0: the reference's log-probabilities each batch
    num_iterations: int = 1  # GRPO: optimizer steps on each batch of completions (method.num_iterations)
    # what the run does besides its steps (``engine.planner.overheads``): the training rows it
    # prepares, the held-out rows each validation pass covers, and how often it validates and saves
    rows: int | None = None
    validation_rows: int = 0
    eval_every: int | None = None
    checkpoint_every: int = 100
    vision_tower: str = "frozen"  # a VLM's tower: "frozen", "lora" or "full" (method.vision_tower)
    projector: str = "frozen"  # a VLM's projector, likewise (method.projector)
    images_per_row: float = 0.0  # images a training row holds, on average (from the data, or said)
    image_size: tuple[int, int] = (448, 448)  # (width, height) of an image as the data holds it

    @property
    def objective(self) -> str:
        """The training method (``engine.methods``): ``"sft"`` for ``lora`` and ``full``."""
        return "sft" if self.method in TUNINGS else self.method

    @property
    def tuning(self) -> str:
        """What trains: ``"lora"`` (an adapter) or ``"full"`` (every weight), a preference job's included."""
        return self.method if self.method in TUNINGS else self.dpo_tuning

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example of the batch runs as: 2 for a preference pair, a GRPO prompt's
        group (``group_size``), else 1."""
        if self.samples and self.group_size is not None:
            return self.group_size
        return METHOD_TABLE[self.objective].defaults().sequences_per_example()

    @property
    def samples(self) -> bool:
        """Whether each step samples completions before it trains (GRPO's rollouts)."""
        return METHOD_TABLE[self.objective].data_format == "prompts"

    @property
    def needs_reference(self) -> bool:
        """Whether the method runs a reference pass before the first step (DPO)."""
        return METHOD_TABLE[self.objective].defaults().needs_reference()

    @property
    def sequences(self) -> int:
        """Sequences one step trains: ``batch_size`` examples of ``sequences_per_example``."""
        return self.batch_size * self.sequences_per_example

    @property
    def timed_seq_len(self) -> float:
        """The sequence length times are computed at: the data's when known, else ``seq_len``
        (memory always plans the worst case, ``seq_len``)."""
        return min(self.mean_seq_len, self.seq_len) if self.mean_seq_len else float(self.seq_len)

    @classmethod
    def from_train_config(
        cls,
        config: TrainConfig,
        *,
        on_gpu: bool = True,
        num_sequences: int | None = None,
        token_lengths: Sequence[int] | None = None,
        num_validation: int | None = None,
        image_counts: Sequence[int] | None = None,
        image_sizes: Sequence[tuple[int, int]] | None = None,
    ) -> Workload:
        """The workload of a run: the one place a ``TrainConfig`` becomes the planner's input.

        Args:
            config: the run (the CLI's file, a job's stored config, a job request's sections).
            on_gpu: what ``compute_dtype="auto"`` resolves for (the planner plans GPU workers).
            num_sequences: training rows (a DPO run's: pairs), when known; with ``hyper.epochs``
                and no ``hyper.max_steps`` they give the step count the run will take.
            token_lengths: training rows' tokens through the model's tokenizer (all, or a sample):
                times use the padded batch length they give (``batch_length``), and with packing
                they give the packed sequence count. A DPO run's list each pair's chosen and
                rejected sequence, one after the other.
            num_validation: rows of a separate validation file, when known: a DPO run's reference
                pass covers them too (a held-out fraction is already among ``num_sequences``), and
                each validation pass (``validation_rows``; else the fraction held out).

            image_counts: a VLM run's images per training row (all rows, or a sample): their mean
                is ``images_per_row``.
            image_sizes: the (width, height) of those images (all, or a sample): their mean is
                ``image_size``.

        Returns:
            The workload; ``steps`` is None when neither ``max_steps`` nor ``num_sequences`` is known.
        """
        h, e, m, d = config.hyper, config.engine, config.method, config.data
        mean = prompt_mean = None
        rows = num_sequences  # as given: packing below turns num_sequences into packed sequences
        # the run's config refused what its method cannot train with (``check`` of its options)
        per_example = m.sequences_per_example()
        sampled = m.rollouts()
        prompts = sampled is not None
        completion_tokens = sampled.completion_tokens if sampled is not None else 0
        if token_lengths and prompts:
            # the prompts' lengths: each trains as prompt and completion (at most its budget and
            # max_completion_tokens, the worst case), its group of rows padded as one prompt's
            budget = d.max_length - completion_tokens
            kept = [min(n, budget) for n in token_lengths]
            prompt_mean = batch_length(kept, batch_size=h.batch_size, max_length=budget, packing=False)
            whole = [n + completion_tokens for n in kept]
            mean = batch_length(whole, batch_size=h.batch_size, max_length=d.max_length, packing=False)
        elif token_lengths:
            mean = batch_length(
                token_lengths,
                batch_size=h.batch_size,
                max_length=d.max_length,
                packing=d.packing,
                per_example=per_example,
            )
            if d.packing:  # the packed sequences of the whole dataset (the lengths may be a sample)
                rows = num_sequences if num_sequences is not None else len(token_lengths)
                total = sum(min(n, d.max_length) for n in token_lengths) * rows / len(token_lengths)
                num_sequences = max(1, math.ceil(total / d.max_length))
        steps = h.max_steps
        iterations = m.steps_per_batch()
        if steps is None and num_sequences is not None:
            # the run's own count (engine/training/run.py): whole batches per epoch, each trained
            # num_iterations steps (GRPO), at least one step
            steps = max(1, math.ceil((h.epochs or 1.0) * (num_sequences // h.batch_size) * iterations))
        named = [] if e.devices == "auto" else list(e.devices)
        gpus = tuple("cuda:0" if d == "cuda" else d for d in named if d == "cuda" or _is_gpu(d))
        reference = None
        if m.needs_reference() and num_sequences is not None:
            reference = num_sequences + (num_validation or 0)
        held = num_validation  # a validation file's rows, else the fraction held out (at least one)
        if held is None and d.validation_fraction > 0 and rows is not None:
            held = max(1, round(d.validation_fraction * rows))
        return cls(
            seq_len=config.data.max_length,
            batch_size=h.batch_size,
            method=m.tuning if m.objective == "sft" else m.objective,
            dpo_tuning=m.tuning if m.objective != "sft" else "lora",
            lora_r=m.lora_r,
            target_modules=tuple(m.target_modules),
            target_parameters=tuple(m.target_parameters),
            num_microbatches=e.num_microbatches,
            compute_dtype=resolve_compute_dtype(e.compute_dtype, on_gpu=on_gpu),
            async_optimizer=e.async_optimizer,
            optimizer=h.optimizer,
            steps=steps,
            devices=gpus if len(gpus) == len(named) else (),  # CPU workers: plan the box's GPUs
            mean_seq_len=mean,
            reference_pairs=reference,
            base_bits=m.base_bits,
            group_size=sampled.group_size if sampled is not None else None,
            completion_tokens=completion_tokens,
            mean_prompt_len=prompt_mean,
            kl_reference=sampled is not None and sampled.kl_reference,
            num_iterations=iterations,
            rows=rows,
            validation_rows=held or 0,
            eval_every=config.eval.every_steps,
            checkpoint_every=config.checkpoint.every_steps,
            vision_tower=str(getattr(m, "vision_tower", "frozen")),
            projector=str(getattr(m, "projector", "frozen")),
            **_image_stats(image_counts, image_sizes),
        )

    def num_workers(self, hardware: Hardware) -> int:
        """Pipeline workers: the named devices, else one per GPU."""
        return len(self.devices) or hardware.num_gpus

    def workers_per_gpu(self) -> int:
        """The most workers that share one GPU's memory."""
        return max(Counter(self.devices).values(), default=1)


def batch_length(
    lengths: Sequence[int], *, batch_size: int, max_length: int, packing: bool, per_example: int = 1
) -> float:
    """Mean tokens per sequence as the engine batches them: rows cut at ``max_length``, shuffled,
    cut into batches, each right-padded to its longest row (``engine.data.batches.collate``);
    with packing every sequence is ``max_length`` long but the last. One fixed shuffle.

    ``per_example`` 2: ``lengths`` are pairs' sequences (chosen, rejected, one after the other),
    shuffled as pairs, ``batch_size`` pairs a batch, padded to the longest of its 2B rows
    (``engine.data.batches.collate_pairs``)."""
    cut = [max(1, min(n, max_length)) for n in lengths]
    if packing and per_example == 1:
        return float(min(max_length, sum(cut)))
    examples = [cut[i : i + per_example] for i in range(0, len(cut), per_example)]
    random.Random(0).shuffle(examples)
    batches = [
        [n for ex in examples[i : i + batch_size] for n in ex] for i in range(0, len(examples), batch_size)
    ]
    return sum(max(b) * len(b) for b in batches) / len(cut)


def _image_stats(counts: Sequence[int] | None, sizes: Sequence[tuple[int, int]] | None) -> dict[str, Any]:
    """A workload's ``images_per_row`` and ``image_size`` from the data's images (the defaults
    for what is not given)."""
    stats: dict[str, Any] = {}
    if counts:
        stats["images_per_row"] = sum(counts) / len(counts)
    if sizes:
        stats["image_size"] = (
            max(1, round(sum(w for w, _ in sizes) / len(sizes))),
            max(1, round(sum(h for _, h in sizes) / len(sizes))),
        )
    return stats


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda:") and device[5:].isdigit() and len(device) < 12


def bytes_per_trainable_param(optimizer: str) -> int:
    """Host bytes per trainable parameter: fp32 master and gradient, plus the optimizer's state."""
    return (
        MASTER_AND_GRAD_BYTES_PER_PARAM + optimizer_spec(optimizer, field="optimizer").state_bytes_per_param
    )


def check(workload: Workload, hardware: Hardware) -> None:
    """Every number within its range, every choice one the planner knows.

    Raises:
        ConfigError: naming the field and the value.
    """
    w, h = workload, hardware
    counts = {name: (1, top) for name, top in WORKLOAD_LIMITS.items()}
    counts["num_gpus"] = (1, int(HARDWARE_RANGES["num_gpus"][1]))
    for name, (low, high) in counts.items():
        value = getattr(h if name == "num_gpus" else w, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(name, f"{name}={value!r} must be an integer from {low} to {high}", value=value)
    if w.num_microbatches > w.batch_size:
        raise ConfigError(
            "num_microbatches", f"num_microbatches={w.num_microbatches} exceeds batch_size={w.batch_size}"
        )
    if w.method not in METHODS:
        raise ConfigError("method", f"method={w.method!r} must be one of {list(METHODS)}", value=w.method)
    if w.dpo_tuning not in TUNINGS:
        raise ConfigError(
            "dpo_tuning", f"dpo_tuning={w.dpo_tuning!r} must be 'lora' or 'full'", value=w.dpo_tuning
        )
    pairs = w.reference_pairs
    if pairs is not None and (
        isinstance(pairs, bool) or not isinstance(pairs, int) or not 0 <= pairs <= REFERENCE_PAIRS_LIMIT
    ):
        raise ConfigError(
            "reference_pairs",
            f"reference_pairs={pairs!r} must be an integer from 0 to {REFERENCE_PAIRS_LIMIT}",
            value=pairs,
        )
    if w.samples:
        group, tokens = w.group_size, w.completion_tokens
        if group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= 64
        ):
            raise ConfigError(
                "group_size", f"group_size={group!r} must be an integer from 1 to 64", value=group
            )
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < w.seq_len:
            raise ConfigError(
                "completion_tokens",
                f"completion_tokens={tokens!r} must be an integer from 0 to seq_len - 1 ({w.seq_len - 1})",
                value=tokens,
            )
        mu = w.num_iterations
        if isinstance(mu, bool) or not isinstance(mu, int) or not 1 <= mu <= 16:
            raise ConfigError(
                "num_iterations", f"num_iterations={mu!r} must be an integer from 1 to 16", value=mu
            )
    for label in ("vision_tower", "projector"):
        mode = getattr(w, label)
        if mode not in ("frozen", "lora", "full"):
            raise ConfigError(label, f"{label}={mode!r} must be 'frozen', 'lora' or 'full'", value=mode)
    per_row = w.images_per_row
    if (
        isinstance(per_row, bool)
        or not isinstance(per_row, int | float)
        or not 0 <= per_row <= IMAGES_PER_ROW_LIMIT
    ):
        raise ConfigError(
            "images_per_row",
            f"images_per_row={per_row!r} must be a number from 0 to {IMAGES_PER_ROW_LIMIT}",
            value=per_row,
        )
    size = w.image_size
    if not (
        isinstance(size, tuple)
        and len(size) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= IMAGE_EDGE_LIMIT for n in size)
    ):
        raise ConfigError(
            "image_size",
            f"image_size={size!r} must be (width, height), each an integer from 1 to {IMAGE_EDGE_LIMIT}",
            value=size,
        )
    if isinstance(w.base_bits, bool) or w.base_bits not in (16, 4):
        raise ConfigError("base_bits", f"base_bits={w.base_bits!r} must be 16 or 4", value=w.base_bits)
    if w.base_bits == 4 and w.tuning != "lora":
        raise ConfigError(
            "base_bits",
            f"base_bits=4 with {w.tuning} tuning: a 4-bit base is for LoRA (a full fine-tune trains it)",
            value=w.base_bits,
        )
    if w.compute_dtype not in DTYPE_BYTES:
        raise ConfigError(
            "compute_dtype", f"compute_dtype={w.compute_dtype!r} must be one of {sorted(DTYPE_BYTES)}"
        )
    if len(w.devices) > 4096 or not all(_is_gpu(d) for d in w.devices):
        raise ConfigError("devices", f"devices={list(w.devices)!r} must name GPUs as 'cuda:N'")
    for label in ("gpu_memory_gb", "gpu_tflops", "link_gb_s", "efficiency", "host_ram_gb"):
        rate, (least, most) = getattr(h, label), HARDWARE_RANGES[label]
        if rate is None and label == "host_ram_gb":
            continue
        if isinstance(rate, bool) or not (isinstance(rate, int | float) and least <= rate <= most):
            raise ConfigError(
                label, f"{label}={rate!r} must be a number from {least:g} to {most:g}", value=rate
            )
