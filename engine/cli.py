"""``roundhouse``: the engine from the command line.

    roundhouse plan  [--model DIR | --blocks B --hidden H --vocab V] --workers N --microbatches M
    roundhouse demo  [--workers N] [--steps S] [--async]

``plan`` prints the automatic partition of a model (built on the meta device: no memory, no
weights needed) and one iteration's step x worker grid. ``demo`` trains a small randomly
initialised Llama on a synthetic copy task over CPU workers and prints every step's metrics.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _meta_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if args.model:
        config = AutoConfig.from_pretrained(args.model)
    else:
        heads = max(1, args.hidden // 64)
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.blocks,
            num_attention_heads=heads,
            num_key_value_heads=heads,
        )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.model.adapter import AdaptedModel
    from engine.parallel.partition import LayerCost, auto_partition, objective, proxy_costs
    from engine.parallel.schedule import build_schedule, render_grid

    adapted = AdaptedModel(_meta_model(args))
    param_bytes = [
        float(sum(t.numel() * 2 for t in {id(t): t for t in layer.tensors.values()}.values()))
        for layer in adapted.layers
    ]
    costs: list[LayerCost] = proxy_costs(param_bytes)
    budget = args.memory_budget_gb * 2**30 if args.memory_budget_gb else None
    plan = auto_partition(
        costs, num_workers=args.workers, num_microbatches=args.microbatches, memory_budget=budget
    )
    n, m, s = args.workers, args.microbatches, plan.num_slots
    print(
        f"{adapted.architecture}: {adapted.num_layers} layers "
        f"(input, {adapted.num_layers - 2} blocks, output)"
    )
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
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
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
    p = sub.add_parser("plan", help="print the automatic partition and schedule grid of a model")
    p.add_argument("--model", help="a local Hugging Face model folder (only its config is read)")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--memory-budget-gb", type=float, default=None)
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", help="train a small model on a synthetic task over CPU workers")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--async", dest="async_optimizer", action="store_true")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:
        print(f"roundhouse {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
