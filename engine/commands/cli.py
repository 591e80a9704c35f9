"""``roundhouse``: the engine from the command line.

    roundhouse train CONFIG [--method dpo|orpo|kto --beta B --dpo-tuning lora|full]
                                                  fine-tune (resumes from the latest checkpoint)
    roundhouse validate-data FILE [--model M]     check every row; token statistics with a model
    roundhouse export CHECKPOINT --out DIR [--format FORMAT [--variant V] | --merged | --gguf]
                                                  formats and variants: engine.export.formats
    roundhouse generate CHECKPOINT_OR_MODEL --prompt TEXT
    roundhouse eval MODEL [--adapter CHECKPOINT] --data HELDOUT
    roundhouse chat CHECKPOINT [--temperature T --top-p P --max-tokens N --base B]   (reads stdin)
    roundhouse prepare-demo                       convert the packaged demo model once
    roundhouse demo [--steps N]                   before/after accuracy of a short demo fine-tune
    roundhouse demo --dpo [--model M]             answers' log-likelihoods before/after a few DPO steps
    roundhouse demo --grpo [--model M]            graded answers' mean reward before/after a few GRPO steps
    roundhouse plan [--config CONFIG] ...         partition, schedule grid, fit and ETA of a run
    roundhouse synthetic ...                      train a random model on a synthetic task

Bad input ends with exit code 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.commands.chat import add_chat_command
from engine.commands.common import ProgressSink
from engine.commands.demo import add_demo_command
from engine.data.formats import format_names
from engine.errors import ConfigError
from engine.export.formats import FORMATS, VARIANTS, ExportFormat, formats_help, variants_help
from engine.methods import METHODS, TUNINGS

if TYPE_CHECKING:
    from engine.config import TrainConfig
    from engine.planner import Shape


# --method: what trains (supervised), or a preference method of the registry
# --method: what trains (supervised), or a method that trains on rows of a file alone (GRPO also
# needs its grader: a config file)
METHOD_CHOICES = [*TUNINGS, *(n for n, m in METHODS.items() if n != "sft" and m.data_format != "prompts")]


def model_config(args: argparse.Namespace, model_path: str | None) -> dict[str, Any]:
    """The ``config.json`` a plan reads: the demo's, a model folder's (read as the service reads
    it), or a Llama of the flags' sizes. Only shapes: no torch, no transformers.

    Raises:
        ConfigError: (``model.path``) no ``config.json`` in the folder, or an architecture the
            engine cannot train (the message says why).
    """
    from engine.model.families import model_kind
    from engine.model.loading import demo_config

    if model_path == "demo":
        config = demo_config()
    elif model_path:
        file = Path(model_path) / "config.json"
        if not file.is_file():
            raise ConfigError(
                "model.path",
                f"model.path: {model_path!r} is not a Hugging Face model folder (no config.json)",
                value=model_path,
            )
        config = dict(json.loads(file.read_text()))
    else:
        heads = max(1, args.hidden // 64)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": args.vocab,
            "hidden_size": args.hidden,
            "intermediate_size": args.hidden * 8 // 3,
            "num_hidden_layers": args.blocks,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 2048,  # transformers' LlamaConfig default
            "tie_word_embeddings": False,
        }
    kind = model_kind(config)
    if not kind.supported:
        raise ConfigError("model.path", f"model.path: {kind.reason}", value=kind.architecture)
    return config


def layer_bytes(shape: Shape) -> list[float]:
    """Bytes of each engine layer's parameters in 16 bits, as the engine's ``AdaptedModel`` holds
    them: a tied head counts in the output layer too (the stage that computes the logits uploads
    it), where ``Shape.layer_params`` counts it once. The few buffers a layer also holds (Gemma
    3's embedding scale, DeepSeek-V3's router score correction: one element, or one an expert)
    are left out."""
    params = shape.layer_params()
    if shape.tied:
        params[-1] += shape.vocab * shape.hidden
    return [float(2 * p) for p in params]


def plan_config(args: argparse.Namespace) -> tuple[TrainConfig, int | None]:
    """The run to plan: ``--config`` (or the command's defaults) with the flags given on top, and
    its training rows when ``hyper.epochs`` needs them and the file can be read."""
    from engine.config import TrainConfig, override_method
    from engine.data.read import read_records

    if args.config:
        raw = TrainConfig.load(args.config).model_dump()
    else:  # no file to read: a 2048-token LoRA run, batch max(M, 16), in bf16
        microbatches = args.microbatches or 4
        raw = {
            "data": {"train": "(not read: planning only)", "max_length": 2048},
            "hyper": {"batch_size": max(microbatches, 16)},
            "engine": {"num_microbatches": microbatches, "compute_dtype": "bfloat16"},
        }
    raw["method"] = override_method(
        raw.get("method", {}), kind=args.method, dpo_tuning=args.dpo_tuning, lora_r=args.lora_r
    )
    flags = {
        ("data", "max_length"): args.seq_len,
        ("hyper", "batch_size"): args.batch_size,
        ("hyper", "max_steps"): args.steps,
        ("engine", "num_microbatches"): args.microbatches,
        ("engine", "compute_dtype"): args.dtype,
        ("engine", "async_optimizer"): True if args.async_optimizer else None,
    }
    for (section, key), value in flags.items():
        if value is not None:
            raw.setdefault(section, {})[key] = value
    config = TrainConfig.parse(raw)
    rows = None
    # rows give the step count under epochs, and a reference pass (DPO's) in any case
    counted = config.hyper.max_steps is None or config.method.needs_reference()
    if args.config and counted and Path(config.data.train).is_file():
        rows = sum(1 for _, record in read_records(config.data.train) if isinstance(record, dict))
    return config, rows


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.planner import Shape
    from engine.scheduling.partition import LayerCost, auto_partition, objective, proxy_costs
    from engine.scheduling.schedule import build_schedule, render_grid

    config, rows = plan_config(args)
    folder = args.model or (config.model.path if args.config else None)
    model = model_config(args, folder)
    processor = processor_settings(folder)
    shape = Shape.from_config(model, processor=processor)
    costs: list[LayerCost] = proxy_costs(layer_bytes(shape))
    budget = args.memory_budget_gb * 2**30 if args.memory_budget_gb else None
    n, m = args.workers, config.engine.num_microbatches
    plan = auto_partition(costs, num_workers=n, num_microbatches=m, memory_budget=budget)
    s = plan.num_slots
    print(f"{shape.architecture}: {shape.layers + 2} layers (input, {shape.layers} blocks, output)")
    print(f"plan: {plan.describe()}")
    print(f"counts: {plan.to_counts()}")
    print(
        f"objective (M*S + N(N-1)) * t_max = {objective(plan, costs, num_workers=n, num_microbatches=m):.4g}"
    )
    print(f"closed-form bubble N(N-1)/(M*S + N(N-1)) = {n * (n - 1) / (m * s + n * (n - 1)):.3f}")
    runs, _ = build_schedule(
        num_slots=s, num_workers=n, num_microbatches=m, round_size=None, iteration=0, start_worker=0
    )
    names = [st.name for st in plan.slots]
    kinds = [st.kind for st in plan.slots]
    print(render_grid(runs, slot_names=names, kinds=kinds, num_workers=n))
    images = data_images(config) if args.config and shape.tower is not None else None
    print(_fit_report(args, model, config, rows, processor=processor, images=images))
    return 0


def processor_settings(folder: str | None) -> dict[str, Any] | None:
    """A VLM folder's image processor settings (its ``preprocessor_config.json``, what an image
    costs); None without one (a text model, the demo, a Llama of the flags' sizes)."""
    file = Path(folder) / "preprocessor_config.json" if folder and folder != "demo" else None
    if file is None or not file.is_file():
        return None
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model.path", f"model.path: {file} is not readable JSON ({exc})") from exc
    return found if isinstance(found, dict) else None


PLAN_IMAGE_ROWS = 2_000  # a VLM run's first rows whose images a plan reads: they stand for all


def data_images(config: TrainConfig) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Each of a VLM run's first ``PLAN_IMAGE_ROWS`` training rows' image count and each image's
    (width, height), read as the run reads them (``engine.data``, ``data.image_store``); None
    when the training file is not there."""
    from engine.data import read_examples
    from engine.planner import image_stats

    if not Path(config.data.train).is_file():
        return None
    d = config.data
    _, _, examples, _ = read_examples(d.train, d.format, image_store=d.image_store)
    rows = examples[:PLAN_IMAGE_ROWS]
    return image_stats([r.data for r in ex.images if r.data is not None] for ex in rows)


def _fit_report(
    args: argparse.Namespace,
    model_config: dict[str, Any],
    config: TrainConfig,
    rows: int | None,
    *,
    processor: dict[str, Any] | None = None,
    images: tuple[list[int], list[tuple[int, int]]] | None = None,
) -> str:
    """The planner's answer for this model on the given box: memory, fit, tokens/s and ETA (a
    VLM's images as the training rows hold them, when read)."""
    from engine.planner import Hardware, Workload, plan_job

    detected = []
    host_ram = args.host_ram_gb
    if host_ram is None:  # psutil only when this machine is read (a tenth of the command's time)
        import psutil

        host_ram = psutil.virtual_memory().total / 1e9
        detected.append("host RAM")
    hardware = Hardware(
        num_gpus=args.workers,
        gpu_memory_gb=args.gpu_memory_gb,
        gpu_tflops=args.gpu_tflops,
        link_gb_s=args.link_gb_s,
        host_ram_gb=host_ram,
        efficiency=args.efficiency,
        detected=tuple(detected),
    )
    if args.cpu:  # this machine's cores, as ``devices: auto`` runs without a GPU
        import psutil

        cores = psutil.cpu_count() or 1
        hardware = Hardware.cpu_host(cores=cores, ram_gb=host_ram, detected=(*detected, "CPU cores"))
    counts, sizes = images if images else (None, None)
    workload = Workload.from_train_config(
        config, num_sequences=rows, on_gpu=not args.cpu, image_counts=counts, image_sizes=sizes
    )
    from engine.planner import NOMINAL_LINK_GBPS, Hosts

    hosts = Hosts(args.hosts, link_gbps=args.link_gbps or NOMINAL_LINK_GBPS, link_measured=args.link_measured)
    report = plan_job(model_config, hardware, workload, processor=processor, hosts=hosts)
    if report.assumptions["vision"] is not None:
        where = f"from the first {len(counts)} training rows" if counts else "none assumed (no data read)"
        report.assumptions["vision"]["images_from_data"] = bool(counts)
        return f"\n{report.describe()}\nimages a row: {where}"
    return "\n" + report.describe()


def cmd_train(args: argparse.Namespace) -> int:
    from engine.config import TrainConfig
    from engine.training.run import train

    config = with_method_flags(TrainConfig.load(args.config), args)
    cancel = threading.Event()

    def interrupt(signum: int, frame: Any) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        print("\nstopping at the next step boundary (Ctrl-C again to abort)", file=sys.stderr)
        cancel.set()

    boxes = None
    if args.boxes > 1 or args.address:
        from engine.distributed import Boxes

        if not args.address:
            raise ConfigError("--address", "--boxes: give --address HOST:PORT, where rank 0 listens")
        boxes = Boxes(args.boxes, args.rank, args.address, timeout_s=args.timeout_s, interface=args.interface)
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        result = train(config, ProgressSink(), cancel, models_dir=args.models_dir, boxes=boxes)
    finally:
        signal.signal(signal.SIGINT, previous)
    saved = result.checkpoint
    where = f"rank 0's box ({args.address.rpartition(':')[0]})" if boxes and boxes.rank > 0 else saved
    print(f"{result.status} at step {result.step}/{result.total_steps}; checkpoint: {where}")
    return 0 if result.status == "succeeded" else 1


def with_method_flags(config: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """The config with ``--method``, ``--beta`` and ``--dpo-tuning`` applied on top."""
    from engine.config import TrainConfig, override_method

    flags = {"kind": args.method, "beta": args.beta, "dpo_tuning": args.dpo_tuning}
    if all(v is None for v in flags.values()):
        return config
    raw = config.model_dump()
    raw["method"] = override_method(raw["method"], **flags)
    return TrainConfig.parse(raw)


def cmd_validate_data(args: argparse.Namespace) -> int:
    from engine.data.encode import validate

    tokenizer = None
    if args.model:
        from engine.model.loading import load_processor_for, load_tokenizer, resolve_model_path

        folder = resolve_model_path(args.model, args.models_dir)
        # a vision-language model's processor encodes rows with images (its tokenizer inside)
        tokenizer = load_processor_for(folder) or load_tokenizer(folder)
    report = validate(args.file, tokenizer=tokenizer, fmt=args.format, max_length=args.max_length)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"{args.file}: format {report.format}, {report.rows} rows, {len(report.errors)} errors")
        for e in report.errors[:50]:
            print(f"  {e}")
        if report.tokens:
            t = report.tokens
            print(
                f"tokens: min {t['min']:.0f} mean {t['mean']:.1f} p50 {t['p50']:.0f} p95 {t['p95']:.0f} "
                f"max {t['max']:.0f}; truncated at {args.max_length}: {report.truncated_share:.1%}"
            )
    return 0 if report.ok else 2


def export_format(args: argparse.Namespace) -> ExportFormat:
    """The format ``roundhouse export`` asks for: ``--format``, or its shorthands ``--merged`` and
    ``--gguf``; the checkpoint's own files when none.

    Raises:
        ValueError: more than one given.
    """
    from engine.export.formats import CHECKPOINT, format_named

    given = [f"--{name}" for name in ("gguf", "merged") if getattr(args, name)]
    given += [f"--format {args.format}"] if args.format else []
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: choose one (a GGUF of a LoRA checkpoint is merged already)")
    if not given:
        return CHECKPOINT
    return format_named(args.format or given[0].removeprefix("--"))


def cmd_export(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from engine.errors import DiskFull
    from engine.export.formats import CHECKPOINT, BuildOptions, copy_export
    from engine.inference.generate import base_of
    from engine.model.export import model_bytes
    from engine.training.checkpoint_layout import STATE_DIR, CheckpointKind, export_files, kind_of

    src = Path(args.checkpoint)
    kind = kind_of(src)
    model_folder = (src / "config.json").is_file()
    if not (src / STATE_DIR).is_dir() and kind != CheckpointKind.ADAPTER and not model_folder:
        raise ValueError(f"{src} is not a checkpoint folder")
    out = Path(args.out)
    chosen = export_format(args)
    if args.variant is not None and not chosen.variants:
        raise ValueError(f"--variant {args.variant}: the {chosen.name} format has no variants")
    variant = chosen.variant_of(args.variant)
    reason = chosen.refusal(kind=kind)
    if reason is not None:
        raise ValueError(f"{src} is a {kind} checkpoint: {reason}")
    base = Path(args.base) if args.base else base_of(src) if kind == CheckpointKind.ADAPTER else None
    if chosen.needs_base(kind) and base is None:
        raise ValueError(f"{src}: no recorded base model, pass --base")
    if chosen is CHECKPOINT and out.exists():
        raise FileExistsError(f"{out} exists already")
    own = sum(p.stat().st_size for p in export_files(src))
    # what the export writes: a copy of its files, and the model copies of its build
    needed = own + (model_bytes(base or src) * chosen.model_copies if chosen.model_copies else 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_space(out, needed)
    # written into a scratch folder beside it, then moved into place: a failure leaves nothing
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    built, said = work / "out", f"exported {src} -> {out}"
    try:
        try:
            options = BuildOptions(variant=variant, base=base, system=args.system)
            result = chosen.build(src, built, options)
            if result.folder == src:  # the checkpoint's own files
                copy_export(src, built)
            said += f": {result.note}" if result.note else ""
        except Exception as exc:
            if not _no_space(exc, out.parent):
                raise
            free = shutil.disk_usage(out.parent).free
            raise DiskFull(str(out), needed_bytes=max(needed, free + 1), free_bytes=free) from exc
        if chosen.variants and out.is_dir():  # its files replaced, the other variants' stay
            for path in built.iterdir():
                path.replace(out / path.name)
        else:
            if out.exists():  # a merge replaces the folder
                shutil.rmtree(out)
            built.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(said)
    return 0


def check_space(out: Path, needed_bytes: int) -> None:
    """Refuse an export into ``out`` that would not fit beside it, before writing anything.

    Raises:
        DiskFull: fewer than ``needed_bytes`` are free on the disk of its parent folder.
    """
    import shutil

    from engine.errors import DiskFull

    free = shutil.disk_usage(out.parent).free
    if free < needed_bytes:
        raise DiskFull(str(out), needed_bytes=needed_bytes, free_bytes=free)


def _no_space(exc: BaseException, folder: Path) -> bool:
    """Whether ``exc`` is a write that found no space: an ``OSError`` saying so (or one it was
    raised from), or another error (torch's and safetensors' writers raise their own) while less
    than a MiB stays free on the disk of ``folder``."""
    import errno
    import shutil

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return not isinstance(exc, ValueError) and shutil.disk_usage(folder).free < 1 << 20


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.inference.generate import generate, load_for_inference
    from engine.model.loading import resolve_model_path

    model_path = resolve_model_path(args.model, args.models_dir) if args.model == "demo" else Path(args.model)
    model, tokenizer = load_for_inference(model_path, adapter=args.adapter)
    print(generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from engine.inference.generate import exact_match, load_for_inference
    from engine.model.loading import resolve_model_path

    model_path = resolve_model_path(args.model, args.models_dir) if args.model == "demo" else Path(args.model)
    model, tokenizer = load_for_inference(model_path, adapter=args.adapter)
    result = exact_match(model, tokenizer, args.data, max_new_tokens=args.max_new_tokens)
    for sample in result["samples"]:
        print(f"  {sample['prompt']!r}: expected {sample['expected']!r}, got {sample['got']!r}")
    print(f"exact match: {result['correct']}/{result['rows']} = {result['accuracy']:.1%}")
    return 0


def cmd_prepare_demo(args: argparse.Namespace) -> int:
    from engine.model.loading import prepare_demo_model

    print(f"demo model ready: {prepare_demo_model(args.models_dir)}")
    return 0


def cmd_synthetic(args: argparse.Namespace) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig, RoundPipe
    from engine.metrics import StdoutSink

    torch.manual_seed(0)
    vocab, seq, batch = 64, 32, 16
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
        )
    )
    config = EngineConfig(
        devices=["cpu"] * args.workers,
        num_microbatches=max(args.workers, 4),
        lr=3e-3,
        async_optimizer=args.async_optimizer,
        max_grad_norm=1.0,
    )
    print(
        f"demo: a 4-block Llama learns to repeat the first half of each sequence, {args.workers} CPU workers"
    )
    with RoundPipe(model, config, sink=StdoutSink()) as rp:
        for _ in range(args.steps):
            half = torch.randint(0, vocab, (batch, seq // 2))
            ids = torch.cat([half, half], dim=1)
            labels = ids.clone()
            labels[:, : seq // 2] = -100
            rp.forward_backward(input_ids=ids, labels=labels)
            rp.step()
        rp.synchronize()
        assert rp.plan is not None
        print(f"final plan: {rp.plan.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roundhouse", description="Roundhouse fine-tuning engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="partition, schedule grid, fit and ETA of a run (a TrainConfig or flags)")
    p.add_argument("--config", help="a TrainConfig (JSON/YAML): the run to plan; the flags below override it")
    p.add_argument("--model", help="a local Hugging Face model folder (only its config is read)")
    p.add_argument(
        "--blocks",
        type=int,
        default=8,
        help="without --model or a config's model: the Llama's decoder blocks",
    )
    p.add_argument("--hidden", type=int, default=512, help="that Llama's hidden size (a head per 64)")
    p.add_argument("--vocab", type=int, default=32000, help="that Llama's vocabulary size")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers of the partition and schedule (and, without --cpu, the fit report's GPUs)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="default 4")
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="GiB a stage of the partition may hold: its 16-bit weights, twice over in a fused or "
        "backward stage (default: no limit)",
    )
    p.add_argument("--gpu-memory-gb", type=float, default=24.0, help="memory of each GPU (fit report)")
    p.add_argument("--gpu-tflops", type=float, default=165.0, help="peak bf16 rate of each GPU")
    p.add_argument("--efficiency", type=float, default=0.4, help="achieved fraction of the peak rate")
    p.add_argument("--link-gb-s", type=float, default=25.0, help="host <-> GPU bandwidth, GB/s")
    p.add_argument("--host-ram-gb", type=float, default=None, help="default: this machine's RAM")
    p.add_argument(
        "--cpu", action="store_true", help="plan this machine's CPU as the one worker (no GPU; fit report)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="default 2048")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default max(M, 16))")
    p.add_argument("--method", choices=METHOD_CHOICES, default=None, help="default lora")
    p.add_argument(
        "--dpo-tuning",
        choices=["lora", "full"],
        default=None,
        help="dpo/orpo/kto: what trains (default lora)",
    )
    p.add_argument("--lora-r", type=int, default=None, help="default 16")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="default bfloat16 (or the config's)",
    )
    p.add_argument(
        "--async",
        dest="async_optimizer",
        action="store_true",
        help="the optimizer step overlaps the next step (engine.async_optimizer)",
    )
    p.add_argument("--steps", type=int, default=None, help="steps of the job, for an ETA")
    p.add_argument("--hosts", type=int, default=1, help="boxes the job spans, each its share of the batch")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="the network between the boxes, Gbit/s (default nominal 10)",
    )
    p.add_argument("--link-measured", action="store_true", help="--link-gbps was measured, not nominal")
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("synthetic", help="train a small random model on a synthetic task over CPU workers")
    d.add_argument("--workers", type=int, default=2, help="CPU workers the pipeline runs over")
    d.add_argument("--steps", type=int, default=30, help="optimizer steps (16 sequences each)")
    d.add_argument(
        "--async",
        dest="async_optimizer",
        action="store_true",
        help="the optimizer step overlaps the next step (its weights one step behind)",
    )
    d.set_defaults(func=cmd_synthetic)

    def with_models(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--models-dir", default="data/models", help="where the demo model is prepared")
        return p

    t = with_models(sub.add_parser("train", help="fine-tune from a JSON/YAML TrainConfig"))
    t.add_argument("config", help="the run's TrainConfig file (.json, .yaml or .yml)")
    t.add_argument(
        "--method",
        choices=METHOD_CHOICES,
        help="override the method: lora or full (sft, tuned so), or the objective dpo, orpo or kto",
    )
    t.add_argument("--beta", type=float, help="override method.beta (DPO's and KTO's beta, ORPO's lambda)")
    t.add_argument(
        "--dpo-tuning",
        choices=["lora", "full"],
        help="override method.tuning of dpo, orpo or kto: what trains",
    )
    t.add_argument(
        "--boxes", type=int, default=1, help="the boxes of a job that spans several (each runs this command)"
    )
    t.add_argument("--rank", type=int, default=0, help="with --boxes: this box's rank, 0 to boxes - 1")
    t.add_argument(
        "--address",
        help="with --boxes: HOST:PORT where rank 0 listens for the others (rank 0 binds the port)",
    )
    t.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="with --boxes: seconds without a heartbeat before another box counts as lost",
    )
    t.add_argument("--interface", help="with --boxes: the network interface the exchange uses")
    t.set_defaults(func=cmd_train)
    v = with_models(sub.add_parser("validate-data", help="check a dataset file row by row"))
    v.add_argument("file", help="the dataset file (.jsonl, .csv or .parquet)")
    v.add_argument("--model", help='a model folder or "demo" (for chat templates and token counts)')
    v.add_argument(
        "--format",
        default="auto",
        choices=["auto", *format_names()],
        help="the rows' format (auto: told from the first row's fields)",
    )
    v.add_argument(
        "--max-length",
        type=int,
        default=1024,
        help="with --model: tokens a sequence is cut to (the share cut is reported)",
    )
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=cmd_validate_data)
    e = sub.add_parser("export", help="copy a checkpoint's export, or merge a LoRA adapter into its base")
    e.add_argument("checkpoint", help="a checkpoint folder (or a model folder)")
    e.add_argument(
        "--out",
        required=True,
        help="the folder written: a new one for checkpoint; merged replaces it; gguf replaces its "
        "variant's files",
    )
    e.add_argument(
        "--format",
        choices=list(FORMATS),
        help=formats_help(),
    )
    e.add_argument(
        "--variant",
        "--quant",
        dest="variant",
        choices=list(VARIANTS),
        help=variants_help(),
    )
    e.add_argument("--merged", action="store_true", help="the same as --format merged")
    e.add_argument("--gguf", action="store_true", help="the same as --format gguf")
    e.add_argument("--system", help="gguf: the Modelfile's system prompt (default: the data's)")
    e.add_argument("--base", help="the base model folder (default: the one the run recorded)")
    e.set_defaults(func=cmd_export)
    g = with_models(sub.add_parser("generate", help="greedy completion of a prompt"))
    g.add_argument("model", help='a checkpoint, a model folder, or "demo"')
    g.add_argument("--adapter", help="a LoRA checkpoint to apply on the model")
    g.add_argument("--prompt", required=True, help="the user message (in the model's chat template)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="the most tokens generated")
    g.set_defaults(func=cmd_generate)
    ev = with_models(sub.add_parser("eval", help="exact-match accuracy on a held-out file"))
    ev.add_argument("model", help='a checkpoint, a model folder, or "demo"')
    ev.add_argument("--adapter", help="a LoRA checkpoint to apply on the model")
    ev.add_argument(
        "--data",
        required=True,
        help="a dataset file with answers: each row's last assistant turn is the reference, the "
        "turns before it the prompt",
    )
    ev.add_argument("--max-new-tokens", type=int, default=16, help="the most tokens of each answer")
    ev.set_defaults(func=cmd_eval)
    pd = with_models(
        sub.add_parser("prepare-demo", help="convert the packaged demo model into a model folder")
    )
    pd.set_defaults(func=cmd_prepare_demo)
    add_demo_command(sub, with_models)  # engine/commands/demo.py
    add_chat_command(sub, with_models)  # engine/commands/chat.py
    return parser


def main(argv: Sequence[str] | None = None, *, parser: argparse.ArgumentParser | None = None) -> int:
    """Run one command; a bad input ends with exit code 2 and a one-line reason."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:
        print(f"roundhouse {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
