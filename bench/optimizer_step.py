"""The host optimizer step, every phase, against a bare torch fused AdamW over the same parameters.

The engine trains a randomly initialised Llama (full fine-tuning, AdamW, fp32 masters, bf16
compute copies) on CPU workers; its own metrics split each step's optimizer work into phases:
``fold`` (the iterations' gradients into the fp32 buffers), ``norm`` (the global norm, and the
clipping when it is on), ``update`` (the optimizer's update) and ``copy`` (the new compute
copies). The baseline is what any loop pays at least: ``torch.optim.AdamW(fused=True)`` over
tensors of the same shapes, gradients already in place. Both run in this process on the same
cores (``torch.get_num_threads()``), alternating step by step; the JSON has the medians and the
median over the steps of the ratio ``engine step (all phases) / bare fused AdamW`` (target:
<= 1.3). The per-tensor squared norms for the global norm are computed by the workers as they
send the gradients (on a GPU, by the device), so they are not a phase of the optimizer thread.

``drain`` is how long ``synchronize()`` takes after ``step()``, which follows the last
iteration at once: the wait for that step and nothing more (target: no longer than one
optimizer step with its fold, ``drain_over_step`` <= 1 up to the thread hand-over).

    python bench/optimizer_step.py [--layers 8] [--hidden 1024] [--steps 6] [--clip 1.0]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, RoundPipe  # noqa: E402
from engine.metrics import ListSink  # noqa: E402

PHASES = ("fold", "norm", "update", "copy")


def build(layers: int, hidden: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class BareAdamW:
    """``torch.optim.AdamW(fused=True)`` over tensors of the given shapes, gradients in place."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self.params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        for p in self.params:
            p.grad = torch.randn_like(p) * 1e-3
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01, fused=True)
        self.opt.step()  # allocates its state

    def seconds(self) -> float:
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0


def measure(model: Any, steps: int, clip: float | None) -> tuple[list[dict[str, float]], str]:
    """Engine steps and bare steps alternating: each row pairs one of each, measured back to back
    (the engine drained, its optimizer thread idle, before the bare step runs)."""
    bare = BareAdamW([p.shape for p in model.parameters()])
    config = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        optimizer="adamw",
        lr=1e-5,
        weight_decay=0.01,
        max_grad_norm=clip,
        compute_dtype="bfloat16",
        calibration_steps=0,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (1, 16), generator=g)
    sink = ListSink()
    bare_s: list[float] = []
    drain_s: list[float] = []
    with RoundPipe(model, config, sink=sink) as rp:
        for _ in range(steps + 1):
            rp.forward_backward(input_ids=ids, labels=ids)
            rp.step()
            t0 = time.perf_counter()
            rp.synchronize()
            drain_s.append(time.perf_counter() - t0)
            bare_s.append(bare.seconds())
        plan = rp.plan.describe() if rp.plan is not None else ""
    rows = []
    # the first step allocates the optimizer's state
    for (_, m), b, d in list(zip(sink.records, bare_s, drain_s, strict=True))[1:]:
        row = {p: m.get(f"time/optimizer/{p}_s", float("nan")) for p in PHASES}
        row["step"] = m["time/optimizer_s"]
        row["all"] = row["step"] + row["fold"]
        row["bare"] = b
        row["ratio"] = row["all"] / b
        row["drain"] = d
        row["drain_over_step"] = d / row["all"]
        rows.append(row)
    return rows, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (0: off)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "optimizer_step.json")
    args = parser.parse_args()
    model = build(args.layers, args.hidden)
    numel = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    rows, plan = measure(model, args.steps, args.clip or None)
    medians = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "step", "all", "bare", "drain")}
    report = {
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "parameters": numel,
        "tensors": tensors,
        "plan": plan,
        "clip": args.clip or None,
        # every phase: the step itself (norm, update, copy and its waits) and the fold before it
        "engine_median_s": medians,
        "ratio_engine_over_bare_median": statistics.median(r["ratio"] for r in rows),
        "drain_over_step_median": statistics.median(r["drain_over_step"] for r in rows),
        "seconds_per_1e9_params": {
            "engine": medians["all"] * 1e9 / numel,
            "bare": medians["bare"] * 1e9 / numel,
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
