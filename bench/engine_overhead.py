"""Engine overhead: tokens/s and peak RSS of RoundPipe (1 CPU worker, sync, fp32) vs a plain loop.

Both train the same randomly initialised Llama (6 blocks x 256 hidden, sequence 256, batch 16)
with fused AdamW for the same number of steps. The engine runs twice: with 1 micro-batch (the
same tensor shapes as the plain loop: what remains is the engine's own overhead) and with 4
micro-batches (smaller activations). Each measurement runs in its own child process (so peak RSS
is its own), alternating the variants several times in one run; the medians and the ratios are
written to bench/results/engine_overhead.json.

    python bench/engine_overhead.py [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS, HIDDEN, SEQ, BATCH, VOCAB = 6, 256, 256, 16, 8192
VARIANTS = ("plain", "engine-m1", "engine-m4")


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return model, batches


def timed(train_step, batches: list, steps: int, finish=None, *, warmup: int = 2) -> float:
    """Seconds ``steps`` calls of ``train_step`` take after ``warmup`` untimed ones, cycling
    through ``batches``; ``finish`` (the engine's ``synchronize``) ends the work in flight before
    the clock starts and before it stops."""
    for i in range(warmup):
        train_step(batches[i % len(batches)])
    if finish:
        finish()
    t0 = time.perf_counter()
    for i in range(steps):
        train_step(batches[i % len(batches)])
    if finish:
        finish()
    return time.perf_counter() - t0


def child(variant: str, steps: int) -> dict:
    import torch

    model, batches = build()
    warmup = 2
    if variant == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def train_step(batch):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()

        finish = None
        info: dict = {}
    else:
        from engine import EngineConfig, RoundPipe
        from engine.metrics import ListSink

        sink = ListSink()
        microbatches = int(variant.split("-m")[1])
        rp = RoundPipe(
            model, EngineConfig(devices=["cpu"], num_microbatches=microbatches, lr=1e-4), sink=sink
        )

        def train_step(batch):
            rp.forward_backward(**batch)
            rp.step()

        finish = rp.synchronize
        info = {"sink": sink, "rp": rp}
    seconds = timed(train_step, batches, steps, finish, warmup=warmup)
    out = {
        "variant": variant,
        "tokens_per_s": steps * BATCH * SEQ / seconds,
        "seconds_per_step": seconds / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if variant != "plain":
        records = info["sink"].records[warmup:]
        step_s = statistics.mean(m["time/step_s"] for _, m in records)
        stage = {}
        for _, m in records:
            for k, v in m.items():
                if k.startswith("time/stage/"):
                    stage[k] = stage.get(k, 0.0) + v / len(records)
        out["breakdown"] = {
            "step_s": step_s,
            "stage_compute_s": stage,
            "optimizer_s": statistics.mean(m["time/optimizer_s"] for _, m in records),
        }
        out["plan"] = info["rp"].plan.describe()
        info["rp"].close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps)]
            res = subprocess.run(
                cmd, capture_output=True, text=True, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}
            )
            runs[variant].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(
                f"repeat {r}: {variant:9s} {runs[variant][-1]['tokens_per_s']:8.0f} tok/s  "
                f"peak RSS {runs[variant][-1]['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    import torch
    import transformers

    med = {v: statistics.median(x["tokens_per_s"] for x in runs[v]) for v in runs}
    rss = {v: statistics.median(x["peak_rss_mb"] for x in runs[v]) for v in runs}
    result = {
        "benchmark": "engine_overhead",
        "model": f"Llama {BLOCKS} blocks x {HIDDEN} hidden, vocab {VOCAB}",
        "sequence": SEQ,
        "batch": BATCH,
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "tokens_per_s": med,
        "peak_rss_mb": rss,
        "throughput_ratio_over_plain": {v: med[v] / med["plain"] for v in VARIANTS[1:]},
        "rss_ratio_over_plain": {v: rss[v] / rss["plain"] for v in VARIANTS[1:]},
        "engine_plan": {v: runs[v][-1].get("plan") for v in VARIANTS[1:]},
        "engine_breakdown_last_run": {v: runs[v][-1].get("breakdown") for v in VARIANTS[1:]},
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    for v in VARIANTS[1:]:
        print(
            f"{v} / plain: tokens/s ratio {result['throughput_ratio_over_plain'][v]:.3f}, "
            f"peak RSS ratio {result['rss_ratio_over_plain'][v]:.3f}"
        )


if __name__ == "__main__":
    main()
