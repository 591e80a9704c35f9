"""The plan of one job on one box, or on several (``engine.planner.boxes``): fit, memory by term,
time, and the longest sequence that fits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.errors import ConfigError
from engine.methods import METHODS
from engine.methods.reference import reference_seconds
from engine.planner.boxes import Hosts, OnHosts, check_hosts, exchange_words, price, share
from engine.planner.fit import assess, base_variants, longest_sequence, pcie_traffic
from engine.planner.memory import CUDA_OVERHEAD_BYTES
from engine.planner.overheads import overheads
from engine.planner.rollouts import rollout_time
from engine.planner.shapes import Shape
from engine.planner.workload import DTYPE_BYTES, GB, Hardware, Workload, check
from engine.scheduling.simulate import closed_form_bubble, simulate

OPTIMIZER_PARAMS_PER_S = 1.5e9  # fused CPU AdamW (memory-bound, ~28 bytes moved per parameter)


@dataclass
class PlanReport:
    """What :func:`plan_job` answers; every size in GB (1e9 bytes).

    ``stages`` list each stage's layers and GPU memory on its worker, with the terms of
    ``engine.planner.memory`` (``memory_gb``). ``max_seq_len`` is the longest sequence (tokens
    per sequence, at the job's sequences per micro-batch) whose plan fits, a multiple of
    ``SEQ_LEN_STEP``; ``max_seq_len_limit`` says what stops it: ``"gpu_memory"``,
    ``"host_ram"``, ``"context"`` (the model's ``max_position_embeddings``) or ``"planner"``
    (the largest ``seq_len`` a plan takes).

    A DPO job's step trains 2 sequences a pair (``tokens_per_s`` counts both); ``reference_s`` is
    its reference pass (a forward over every training and validation pair, once, before the first
    step), part of ``eta_s``; None for a supervised job or when the pair count is unknown.

    A GRPO job's step first samples its completions (on the first GPU when the model fits there,
    else on the host's CPU: ``rollout``, by term, ``engine.planner.rollouts``) and trains on
    ``batch_size * group_size`` sequences: ``step_s`` is ``iteration_s`` plus ``rollout_s`` (the
    sampling, the model's copy to the GPU and, with beta > 0, the reference log-probabilities;
    with ``num_iterations`` mu > 1, the policy's too, the whole over the mu steps that train on
    a batch), ``rollout_share`` the part of a step they take; the ETA counts both.
    ``tokens_per_s`` is the training iteration's. For every other method ``step_s`` is
    ``iteration_s`` and ``rollout_s`` None.

    ``eta_s`` is the steps (and a DPO job's reference pass); ``total_s`` the run end to end: that
    plus ``overheads``, what it costs besides its steps by term (``engine.planner.overheads``: the
    trainer's start, the model's load, the data's preparation, the first step's warm-up, the
    validation passes, the checkpoints; empty when nothing fits). ``estimate`` says where
    ``total_s`` comes from: ``"planner"`` (the assumptions), ``"calibrated"`` (the rate scaled by a
    measured job, the overheads assumed) or ``"measured"`` (the rate and the overheads of a job
    that ran on the box; the service sets these two).

    ``pcie`` is what one iteration moves between host and GPUs, by term (None when nothing fits
    the GPUs). ``base_variants`` puts a LoRA job with a 16-bit and with a 4-bit base side by side
    (``engine.planner.fit.base_variants``; empty for a full fine-tune); ``base_bits`` is the
    job's own.

    A job on several boxes (``hosts`` > 1, ``engine.planner.boxes``) is planned as one box's
    share of each batch: ``stages``, memory, ``max_seq_len`` and ``rollout`` are a box's;
    ``iteration_s`` and ``step_s`` add the gradient exchange's exposed time (``exchange``: its
    ``bytes_per_step`` each box sends, ``seconds``, the ``link_gbps`` it was priced at and
    whether it was ``link_measured``, whether the asynchronous optimizer ``hidden`` it and its
    ``exposed_s``); ``tokens_per_s`` and the ETA are the whole job's. ``one_box`` is the plan of
    the whole batch on one box (its fit, step and rate) and ``scaling`` the job's rate over it
    (None when either does not fit). On one box ``exchange``, ``one_box`` and ``scaling`` are None.
    """

    fits: bool
    problems: list[str]
    suggestions: list[str]
    parameters: int
    trainable: int
    host_ram: dict[str, float]
    stages: list[dict[str, Any]]
    partition: str
    gpu_memory_needed_gb: float
    gpu_memory_gb: float
    iteration_s: float
    tokens_per_s: float
    bubble: float
    closed_form_bubble: float
    eta_s: float | None
    max_seq_len: int = 0
    max_seq_len_limit: str = "gpu_memory"
    workers_per_gpu: int = 1
    reference_s: float | None = None
    assumptions: dict[str, Any] = field(default_factory=dict)
    base_bits: int = 16
    pcie: dict[str, float] | None = None
    base_variants: list[dict[str, Any]] = field(default_factory=list)
    step_s: float = 0.0
    rollout_s: float | None = None
    rollout_share: float | None = None
    rollout: dict[str, Any] | None = None
    overheads: dict[str, float] = field(default_factory=dict)
    total_s: float | None = None
    estimate: str = "planner"
    hosts: int = 1
    exchange: dict[str, Any] | None = None
    one_box: dict[str, Any] | None = None
    scaling: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The report as text, for the command line."""
        lines = [
            f"fits: {'yes' if self.fits else 'no'}",
            *[f"  problem: {p}" for p in self.problems],
            *[f"  try: {s}" for s in self.suggestions],
            f"parameters: {self.parameters / 1e6:,.1f}M, trainable {self.trainable / 1e6:,.2f}M",
            "host RAM: "
            + ", ".join(
                f"{k.removesuffix('_gb').replace('_', ' ')} {v:.2f} GB" for k, v in self.host_ram.items()
            ),
            (
                f"worker memory (host RAM): {self.gpu_memory_needed_gb:.2f} GB of {self.gpu_memory_gb:.1f} GB"
                if self.assumptions.get("device") == "cpu"
                else f"GPU memory: {self.gpu_memory_needed_gb:.2f} GB of {self.gpu_memory_gb:g} GB per GPU"
            )
            + (f" ({self.workers_per_gpu} workers per GPU)" if self.workers_per_gpu > 1 else ""),
            f"longest sequence that fits: {self.max_seq_len:,} tokens (limited by "
            f"{self.max_seq_len_limit.replace('_', ' ')})",
        ]
        if self.pcie is not None:
            lines.append(
                f"PCIe per iteration: {self.pcie['total_gb']:.1f} GB (weights {self.pcie['weights_gb']:.1f}, "
                f"gradients {self.pcie['gradients_gb']:.2f}, activations {self.pcie['activations_gb']:.1f})"
            )
        for v in self.base_variants:
            pcie = v["pcie_gb_per_iteration"]
            lines.append(
                f"  {v['base_bits']}-bit base: host RAM {v['host_ram_gb']:.1f} GB"
                + (f", PCIe {pcie:.1f} GB an iteration" if pcie is not None else "")
                + (", fits" if v["fits"] else f", does not fit ({v['limit'].replace('_', ' ')})")
                + f", longest sequence {v['max_seq_len']:,}"
            )
        if self.stages:
            lines.append(f"partition: {self.partition}")
            for s in self.stages:
                terms = ", ".join(f"{k} {v:.2f}" for k, v in s["memory_gb"].items() if v and k != "total")
                lines.append(
                    f"  {s['name']:>4} {s['kind']:<8} layers {s['layers'][0]}-{s['layers'][1]}: "
                    f"{s['gpu_memory_gb']:.2f} GB ({terms})"
                )
            lines.append(
                f"iteration: {self.iteration_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, bubble "
                f"{100 * self.bubble:.1f}% (closed form {100 * self.closed_form_bubble:.1f}%)"
            )
        a = self.assumptions
        if a.get("objective", "sft") != "sft" and a.get("sequences_per_example") == 2:  # pairs, rows
            pairs, example = a.get("reference_pairs"), a.get("example", "pair")
            lines.append(
                f"{a['objective'].upper()}: 2 sequences a {example} ({a['sequences_per_step']:,} a step); "
                + (
                    "no reference pass"
                    if not a.get("needs_reference")
                    else f"reference pass over {pairs:,} {example}s: {self.reference_s:.1f} s (in the ETA)"
                    if pairs is not None and self.reference_s is not None
                    else f"reference pass not counted (the {example} count is unknown)"
                )
            )
        if self.rollout is not None and self.rollout_s is not None:
            r = self.rollout
            lines.append(
                f"GRPO: {r['rows']:,} completions of up to {r['completion_tokens']:,} tokens "
                + ("a batch, " if r["iterations"] > 1 else "a step, ")
                + f"sampled in {r['generation_s']:.2f} s (~{r['tokens_per_s']:,.0f} tokens/s, "
                f"{r['bound']}-bound) on {r['reason']}"
                + (f", the model copied there {r['upload_s']:.2f} s" if r["upload_s"] else "")
                + (f", reference log-probabilities {r['reference_s']:.2f} s" if r["reference_s"] else "")
                + (
                    f", the policy's {r['old_s']:.2f} s; each batch trains {r['iterations']} steps"
                    if r["iterations"] > 1
                    else ""
                )
                + f"; a step {self.step_s:.2f} s, {100 * (self.rollout_share or 0):.0f}% of it rollouts"
            )
        vision = a.get("vision")
        if vision:
            size = "x".join(str(n) for n in vision["image_size"])
            per_row = vision["images_per_row"]
            lines.append(
                f"vision: tower {vision['tower_params'] / 1e6:,.1f}M ({vision['vision_tower']}), projector "
                f"{vision['projector_params'] / 1e6:,.1f}M ({vision['projector']}) parameters in the input "
                f"layer; {per_row:g} image{'' if per_row == 1 else 's'} a row "
                f"of {size} pixels, each "
                f"{vision['patches_per_image']:,} patches and "
                f"{vision['image_tokens_per_image']:,} image tokens "
                f"({vision['image_tokens_per_row']:,.0f} a row)"
            )
        if self.exchange is not None:
            lines.append(exchange_words(self.to_dict()))
        if self.eta_s is not None:
            lines.append(f"ETA: {self.eta_s / 3600:.2f} h")
        if self.total_s is not None:
            besides = self.overheads.get("total_s", 0.0)
            lines.append(
                f"end to end: {self.total_s / 3600:.2f} h ({self.estimate}): the steps and {besides:.1f} s "
                "besides them (start, model load, data, warm-up, validation, checkpoints)"
            )
        rate = (
            f"{1000 * a['gpu_tflops']:g} GFLOP/s fp32 achieved on the CPU"
            if a["device"] == "cpu"
            else f"{a['gpu_tflops']:g} TFLOPS per GPU at {100 * a['efficiency']:.0f}% efficiency, "
            f"{a['link_gb_s']:g} GB/s host link"
        )
        lines.append(
            f"assumed: {a['hardware']}; {rate}; {a['tokens_per_sequence']:,.0f} tokens per sequence"
            + (" (from the data)" if a["tokens_from_data"] else " (max_length)")
            + (f"; detected: {', '.join(a['detected'])}" if a["detected"] else "")
        )
        return "\n".join(lines)


def plan_job(
    config: dict[str, Any],
    hardware: Hardware,
    workload: Workload,
    *,
    processor: dict[str, Any] | None = None,
    hosts: Hosts | None = None,
) -> PlanReport:
    """Memory, fit and speed of a fine-tune on a box, and the longest sequence that fits.

    Args:
        config: the base model's ``config.json`` as a dict.
        hardware: the GPUs, link and host RAM.
        workload: sequence length, batch, method, engine settings and (optionally) steps.
        processor: a vision-language model's image processor settings (its
            ``preprocessor_config.json``), for what an image costs; the family's defaults when
            None.
        hosts: the boxes the job spans and the link between them (``engine.planner.boxes``);
            None: one box.

    Returns:
        A :class:`PlanReport`; ``fits`` is False with ``problems`` and ``suggestions`` when it does not.

    Raises:
        ConfigError: a bad config.json size or setting; ``field`` names it (a ``ValueError``);
            a batch too small for the boxes' micro-batches names ``hyper.batch_size``.
    """
    check(workload, hardware)
    spread = hosts or Hosts()
    check_hosts(spread, workload)
    shape = Shape.from_config(config, processor=processor)
    try:
        whole = _report(shape, hardware, workload)
        if spread.count == 1:
            return whole
        return _on_hosts(_report(shape, hardware, share(workload, spread.count)), whole, workload, spread)
    except (ZeroDivisionError, OverflowError) as exc:  # the ranges above should make this unreachable
        raise ConfigError("config", f"these sizes and this hardware give no finite plan ({exc})") from exc


def _report(shape: Shape, hardware: Hardware, workload: Workload) -> PlanReport:
    w, h = workload, hardware
    dtype = DTYPE_BYTES[w.compute_dtype]
    a = assess(shape, w, h)
    memory, plan, host = a.memory, a.plan, a.host
    share = w.workers_per_gpu()
    problems: list[str] = []
    suggestions: list[str] = []
    n, m = w.num_workers(h), w.num_microbatches
    longest, stop = longest_sequence(shape, w, h, at_job=a)
    variants = base_variants(shape, w, h, job=a, longest=(longest, stop))
    four = next((v for v in variants if v["base_bits"] == 4), None)
    if plan is None:
        per = f"{h.gpu_memory_gb:g} GB GPUs leave {memory.capacity / GB:.1f} GB" + (
            f" per worker ({share} share a GPU)" if share > 1 else ""
        )
        problems.append(
            f"one layer needs {memory.largest_layer() / GB:.1f} GB on a GPU (with the next stage's "
            f"weights) at {w.sequences * w.seq_len // m} tokens per micro-batch; {per}"
        )
        if longest:
            suggestions.append(f"seq_len {longest} or shorter (the longest that fits)")
        if m < w.batch_size:
            suggestions.append(f"more micro-batches (num_microbatches up to {w.batch_size})")
        else:
            suggestions.append("a shorter seq_len or a smaller batch_size")
    vision = vision_facts(shape, w)
    if vision is not None and vision["image_tokens_per_row"] > w.seq_len:
        problems.append(
            f"a row's {w.images_per_row:g} images of {w.image_size[0]}x{w.image_size[1]} pixels are "
            f"{vision['image_tokens_per_row']:,.0f} image tokens, more than seq_len={w.seq_len}"
        )
        suggestions.append("fewer or smaller images a row, or a longer max_length")
    if a.limit(h) == "host_ram":
        problems.append(f"host RAM: needs {host['total_gb']:.1f} GB, the host has {h.host_ram_gb:g} GB")
        if stop == "host_ram" and longest:
            suggestions.append(f"seq_len {longest} or shorter (the longest whose stage inputs fit)")
        if w.tuning == "full":
            suggestions.append("LoRA instead of a full fine-tune (no fp32 copy and moments of every weight)")
        elif w.base_bits == 16 and four is not None and four["limit"] != "host_ram":
            need = four["host_ram_gb"]
            suggestions.append(f"a 4-bit base (method.base_bits: 4): {need:.1f} GB of host RAM")
        suggestions.append("a host with more RAM, or a smaller model")
    stages: list[dict[str, Any]] = []
    iteration = bubble = closed = 0.0
    overhead = CUDA_OVERHEAD_BYTES / share
    if plan is not None:
        for i, stage in enumerate(plan.slots):
            terms = memory.stage_terms(plan, i, n)
            stages.append(
                {
                    "name": stage.name,
                    "kind": stage.kind,
                    "layers": [stage.start, stage.stop],
                    "gpu_memory_gb": (terms["total"] + overhead) / GB,
                    "memory_gb": {k: v / GB for k, v in terms.items()},
                }
            )
        tokens = w.sequences * w.timed_seq_len
        # async: the period of iterations chained without a flush; sync: one iteration, then the flush
        result = simulate(
            "roundpipe-async-steady" if w.async_optimizer else "roundpipe-sync",
            a.costs,
            num_workers=n,
            num_microbatches=m,
            hop=2 * (tokens / m) * shape.hidden * dtype / (h.link_gb_s * GB),  # down, then up
            plan=plan,
            mode="physical",
            param_bytes=memory.weights,
            bandwidth=h.link_gb_s * GB,
            round_size=m,  # the engine's default: one round of every micro-batch
            rotation="fixed",
        )
        iteration = max(result.makespan, a.trainable / OPTIMIZER_PARAMS_PER_S)
        bubble = result.bubble
        closed = closed_form_bubble(num_workers=n, num_microbatches=m, num_slots=plan.num_slots)
    worker = max((s["gpu_memory_gb"] for s in stages), default=(memory.largest_layer() + overhead) / GB)
    reference = reference_seconds(shape, w, h, plan, memory.weights) if plan is not None else None
    rollout = rollout_time(shape, w, h, plan, memory.weights, a.trainable)
    step = iteration + (rollout.per_step_s if rollout is not None and iteration else 0.0)
    eta = step * w.steps + (reference or 0.0) if (w.steps and iteration) else None
    besides = (
        overheads(w, step_s=step, weights_bytes=host["weights_gb"] * GB, trainable=a.trainable)
        if iteration
        else None
    )
    return PlanReport(
        fits=not problems,
        problems=problems,
        suggestions=suggestions,
        parameters=sum(shape.layer_params()),
        trainable=a.trainable,
        host_ram=host,
        stages=stages,
        partition=plan.describe() if plan is not None else "",
        gpu_memory_needed_gb=worker * share,
        gpu_memory_gb=h.gpu_memory_gb,
        iteration_s=iteration,
        tokens_per_s=w.sequences * w.timed_seq_len / iteration if iteration > 0 else 0.0,
        bubble=bubble,
        closed_form_bubble=closed,
        eta_s=eta,
        max_seq_len=longest,
        max_seq_len_limit=stop,
        workers_per_gpu=share,
        reference_s=reference,
        base_bits=w.base_bits,
        pcie=pcie_traffic(shape, w, a),
        base_variants=variants,
        step_s=step,
        rollout_s=rollout.per_step_s if rollout is not None else None,
        rollout_share=rollout.per_step_s / step if rollout is not None and step > 0 else None,
        rollout=rollout.to_dict() if rollout is not None else None,
        overheads=besides.to_dict() if besides is not None else {},
        total_s=eta + besides.total_s if eta is not None and besides is not None else None,
        assumptions={
            "device": h.device,
            "hardware": hardware_label(h),
            "tokens_per_sequence": w.timed_seq_len,
            "tokens_from_data": w.mean_seq_len is not None,
            "gpu_tflops": h.gpu_tflops,
            "efficiency": h.efficiency,
            "link_gb_s": h.link_gb_s,
            "host_ram_gb": h.host_ram_gb,
            "detected": list(h.detected),
            "optimizer_params_per_s": OPTIMIZER_PARAMS_PER_S,
            "loss_chunk_tokens": w.loss_chunk_tokens,
            "method": w.method,
            "objective": w.objective,
            "tuning": w.tuning,
            "needs_reference": w.needs_reference,
            "sequences_per_step": w.sequences,
            "sequences_per_example": w.sequences_per_example,
            "reference_pairs": w.reference_pairs if w.needs_reference else None,
            "example": METHODS[w.objective].example,
            "example_sequences": METHODS[w.objective].example_sequences,
            "vision": vision,
        },
    )


def _on_hosts(box: PlanReport, whole: PlanReport, workload: Workload, hosts: Hosts) -> PlanReport:
    """``box`` (one box's share of the batch) as the job on ``hosts``: the exchange priced in, the
    job's rate, ETA and overheads, and its scaling over one box with the whole batch (``whole``)."""
    p: OnHosts = price(
        workload,
        hosts=hosts,
        trainable=box.trainable,
        box_iteration_s=box.iteration_s,
        box_step_s=box.step_s,
        reference_s=box.reference_s,
        weights_bytes=box.host_ram["weights_gb"] * GB,
        update_s=box.trainable / OPTIMIZER_PARAMS_PER_S,
        one_box_step_s=whole.step_s if whole.fits else 0.0,
    )
    fitted = p.step_s > 0
    return replace(
        box,
        hosts=hosts.count,
        exchange=asdict(p.exchange),
        one_box={"fits": whole.fits, "step_s": whole.step_s, "tokens_per_s": whole.tokens_per_s},
        scaling=p.scaling if box.fits else None,
        iteration_s=p.iteration_s if fitted else box.iteration_s,
        step_s=p.step_s if fitted else box.step_s,
        tokens_per_s=p.tokens_per_s if fitted else box.tokens_per_s,
        rollout_share=box.rollout_s / p.step_s if fitted and box.rollout_s is not None else box.rollout_share,
        eta_s=p.eta_s if fitted else box.eta_s,
        overheads=p.overheads.to_dict() if p.overheads is not None else box.overheads,
        total_s=p.eta_s + p.overheads.total_s if p.eta_s is not None and p.overheads is not None else None,
        assumptions=box.assumptions
        | {
            "hosts": hosts.count,
            "batch_size": workload.batch_size,
            "rows_per_host": box.assumptions["sequences_per_step"] // workload.sequences_per_example,
            "sequences_per_step": workload.sequences,
            "sequences_per_host": box.assumptions["sequences_per_step"],
        },
    )


def vision_facts(shape: Shape, workload: Workload) -> dict[str, Any] | None:
    """What a VLM plan assumed of its tower and its images (None for a text model): the tower's
    and the projector's weights, how they train, the images a row holds and their size, and
    what one image is to the tower (patches) and to the language model (image tokens)."""
    tower, w = shape.tower, workload
    if tower is None:
        return None
    cost = tower.image(*w.image_size)
    return {
        "tower_params": tower.tower_params,
        "projector_params": tower.projector_params,
        "vision_tower": w.vision_tower,
        "projector": w.projector,
        "images_per_row": w.images_per_row,
        "image_size": list(w.image_size),
        "patches_per_image": cost.patches,
        "image_tokens_per_image": cost.tokens,
        "image_tokens_per_row": w.images_per_row * cost.tokens,
    }


def hardware_label(hardware: Hardware) -> str:
    """The box a plan is for, in words (the web's plan card shows it)."""
    h = hardware
    if h.device == "cpu":
        return "CPU host (no GPU reported)"
    return f"{h.num_gpus} GPU{'s' if h.num_gpus != 1 else ''} of {h.gpu_memory_gb:g} GB"
