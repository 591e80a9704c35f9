"""``roundhouse demo``: the demo fine-tunes from the command line.

roundhouse demo [--steps N]                   before/after accuracy of a short LoRA fine-tune
roundhouse demo --dpo [--model M]             answers' log-likelihoods before/after a few DPO steps
roundhouse demo --grpo [--model M]            graded answers' mean reward before/after a few GRPO steps
roundhouse demo --vlm                         pictures' colours named before/after a VLM fine-tune
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_demo_command(
    sub: Any, with_models: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Register ``demo`` on the ``roundhouse`` subcommands."""
    dm = with_models(
        sub.add_parser("demo", help="accuracy before and after a short LoRA fine-tune of the demo")
    )
    dm.add_argument(
        "--steps",
        type=int,
        default=None,
        help="default 30 (12 with --dpo: one pass over its 48 pairs; 12 with --grpo)",
    )
    dm.add_argument("--workers", type=int, default=1, help="CPU workers the pipeline runs over")
    dm.add_argument(
        "--output-dir",
        default="runs/demo",
        help="where the run writes its checkpoint (--dpo, --grpo, --vlm: dpo/, grpo/, vlm/ in the default)",
    )
    dm.add_argument(
        "--dpo", action="store_true", help="preference tuning: answers' log-likelihoods before and after DPO"
    )
    dm.add_argument(
        "--grpo",
        action="store_true",
        help="reinforcement fine-tuning: graded answers' reward before and after GRPO",
    )
    dm.add_argument(
        "--vlm",
        action="store_true",
        help="a vision-language model (the demo model behind a new tower) learns to name pictures' colours",
    )
    dm.add_argument("--dpo-tuning", choices=["lora", "full"], help="--dpo: train an adapter (default) or all")
    dm.add_argument("--beta", type=float, default=None, help="--dpo: the DPO beta (default 0.1)")
    dm.add_argument(
        "--learning-rate", type=float, default=None, help="--dpo: default 5e-4 (full: 1e-5); --grpo: 2e-3"
    )
    dm.add_argument("--model", help="--dpo, --grpo: a model folder instead of the demo model")
    dm.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    chosen = [f"--{name}" for name in ("dpo", "grpo", "vlm") if getattr(args, name)]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)}: choose one demo")
    if args.dpo:
        return cmd_demo_dpo(args)
    if args.grpo:
        return cmd_demo_grpo(args)
    if args.vlm:
        return cmd_demo_vlm(args)
    import time

    from engine import demo
    from engine.commands.common import ProgressSink
    from engine.config import TrainConfig
    from engine.inference.generate import exact_match, load_for_inference
    from engine.model.loading import prepare_demo_model
    from engine.training.run import train

    base = prepare_demo_model(args.models_dir)
    model, tokenizer = load_for_inference(base)
    before = exact_match(model, tokenizer, demo.HELDOUT, max_new_tokens=8)
    print(f"before fine-tuning: exact match {before['correct']}/{before['rows']} = {before['accuracy']:.1%}")
    config = TrainConfig.parse(demo_config(args))
    started = time.perf_counter()
    result = train(config, ProgressSink(), models_dir=args.models_dir)
    seconds = time.perf_counter() - started
    if result.checkpoint is None:
        raise ValueError("the demo run wrote no checkpoint")
    model, tokenizer = load_for_inference(base, adapter=result.checkpoint)
    after = exact_match(model, tokenizer, demo.HELDOUT, max_new_tokens=8)
    for sample in after["samples"]:
        print(f"  {sample['prompt']!r}: expected {sample['expected']!r}, got {sample['got']!r}")
    print(
        f"after {result.step} steps ({seconds:.0f} s): exact match {after['correct']}/{after['rows']} = "
        f"{after['accuracy']:.1%} (before: {before['accuracy']:.1%}); checkpoint: {result.checkpoint}"
    )
    return 0


def cmd_demo_dpo(args: argparse.Namespace) -> int:
    from engine.commands.common import ProgressSink
    from engine.demo.dpo import describe, run_demo
    from engine.model.loading import prepare_demo_model

    folder = Path(args.model) if args.model else prepare_demo_model(args.models_dir)
    steps = args.steps or 12
    print(f"DPO demo: {folder.name}, {steps} steps of 4 preference pairs ({args.dpo_tuning or 'lora'})")
    result = run_demo(
        folder,
        steps=steps,
        workers=args.workers,
        output_dir=Path(args.output_dir) / "dpo" if args.output_dir == "runs/demo" else args.output_dir,
        tuning=args.dpo_tuning or "lora",
        learning_rate=args.learning_rate,
        beta=args.beta or 0.1,
        sink=ProgressSink(),
    )
    print("\n".join(describe(result)))
    return 0


def cmd_demo_grpo(args: argparse.Namespace) -> int:
    from engine.commands.common import ProgressSink
    from engine.demo.grpo import describe, run_demo
    from engine.model.loading import prepare_demo_model

    folder = Path(args.model) if args.model else prepare_demo_model(args.models_dir)
    steps = args.steps or 12
    print(f"GRPO demo: {folder.name}, {steps} steps of 4 prompts x 6 sampled answers (LoRA), graded")
    result = run_demo(
        folder,
        steps=steps,
        workers=args.workers,
        output_dir=Path(args.output_dir) / "grpo" if args.output_dir == "runs/demo" else args.output_dir,
        learning_rate=args.learning_rate or 2e-3,
        sink=ProgressSink(),
    )
    print("\n".join(describe(result)))
    return 0


def cmd_demo_vlm(args: argparse.Namespace) -> int:
    from engine.commands.common import ProgressSink
    from engine.demo.vlm import describe, run_demo

    steps = args.steps or 30
    print(
        f"VLM demo: the demo model behind a new vision tower, {steps} steps of 8 pictures (LoRA, tower full)"
    )
    result = run_demo(
        args.models_dir,
        Path(args.output_dir) / "vlm" if args.output_dir == "runs/demo" else args.output_dir,
        steps=steps,
        workers=args.workers,
        sink=ProgressSink(),
    )
    print("\n".join(describe(result)))
    return 0


def demo_config(args: argparse.Namespace) -> dict[str, Any]:
    from engine import demo

    return {
        "model": {"path": "demo"},
        "data": {"train": str(demo.TRAIN), "validation_fraction": 0.05, "max_length": 96},
        "method": {"kind": "lora", "lora_r": 16, "lora_alpha": 32},
        "hyper": {"max_steps": args.steps or 30, "batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 5},
        "engine": {"devices": ["cpu"] * args.workers, "num_microbatches": 2},
        "checkpoint": {"every_steps": args.steps or 30, "keep_last": 1},
        "output_dir": str(Path(args.output_dir)),
    }
