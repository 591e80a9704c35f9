"""Host memory and PCIe bytes of a LoRA base in 16 and in 4 bits (``method.base_bits``).

Part one, each variant in its own process: a randomly initialised Llama-shaped model (about
1.45e9 parameters by default, bfloat16), LoRA r16 on the family's default targets, one CPU
worker, bfloat16 compute. It reports the process's RSS before the model exists, once the model
is built and once the engine holds it (the base's host copy), the bytes of the blocks' base
weights as the engine keeps them, and the bytes one training iteration uploads
(``transfer/h2d_bytes``, counted by the transfer layer as it copies). Targets: the 4-bit
variant's base RSS and uploaded bytes <= 0.35x the 16-bit one's.

Part two: the demo task (``roundhouse demo``'s model and data), 20 LoRA steps with each base;
the mean training loss of the last five steps with a 4-bit base within 5% of the 16-bit one.

    python bench/host_memory.py [--layers 24] [--hidden 2048] [--skip-loss]

Writes ``bench/results/host_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def one_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Build, wrap and train one iteration with ``args.bits``; the figures as a dict."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig, RoundPipe
    from engine.metrics import ListSink
    from engine.model.families import family_for

    torch.manual_seed(0)
    start = _rss()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    targets = list(family_for("LlamaForCausalLM").lora_targets)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    parameters = sum(p.numel() for p in model.parameters())
    built = _rss()
    sink = ListSink()
    t0 = time.perf_counter()
    rp = RoundPipe(
        model,
        EngineConfig(
            devices=["cpu"],
            num_microbatches=1,
            compute_dtype="bfloat16",
            base_bits=args.bits,
            calibration_steps=0,
        ),
        sink=sink,
    )
    load_s = time.perf_counter() - t0
    held = _rss()
    host = rp.host
    blocks = [t for t in host.tensors if not t.trainable and 0 < t.owner < host.num_layers - 1]
    block_base_bytes = sum(t.compute.nbytes for t in blocks if t.compute.dim() != 1 or t.packed is not None)
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    loss = rp.forward_backward(input_ids=ids, labels=ids)
    rp.step()
    rp.synchronize()
    step_s = time.perf_counter() - t0
    metrics = sink.records[-1][1]
    rp.close()
    return {
        "bits": args.bits,
        "parameters": parameters,
        "rss_start": start,
        "rss_model_built": built,
        "rss_engine_holds_it": held,
        # what the base costs the process once the engine holds it (the model's own copy gone)
        "base_rss": held - start,
        "block_base_bytes": block_base_bytes,
        "packed_tensors": sum(1 for t in blocks if t.packed is not None),
        "h2d_bytes_per_iteration": metrics.get("transfer/h2d_bytes"),
        "engine_load_s": load_s,
        "iteration_s": step_s,
        "loss": float(loss),
    }


def demo_losses(bits: int, steps: int) -> list[float]:
    """The training loss of each of ``steps`` LoRA steps on the demo task with a ``bits`` base."""
    from engine import demo
    from engine.config import TrainConfig
    from engine.metrics import ListSink
    from engine.training.run import train

    sink = ListSink()
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig.parse(
            {
                "model": {"path": "demo"},
                "data": {"train": str(demo.TRAIN), "max_length": 96},
                "method": {"kind": "lora", "lora_r": 16, "lora_alpha": 32, "base_bits": bits},
                "hyper": {"max_steps": steps, "batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 5},
                "engine": {"devices": ["cpu"], "num_microbatches": 2},
                "checkpoint": {"every_steps": steps, "keep_last": 1},
                "output_dir": out,
            }
        )
        train(config, sink, models_dir=ROOT / "data" / "models")
    return [m["loss/train"] for _, m in sink.records if "loss/train" in m and "tokens/label" in m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=6912)
    parser.add_argument("--steps", type=int, default=20, help="demo-task steps per variant")
    parser.add_argument("--skip-loss", action="store_true", help="only the memory and bytes part")
    parser.add_argument("--bits", type=int, help=argparse.SUPPRESS)  # a child: one variant
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_memory.json")
    args = parser.parse_args()
    if args.bits is not None:
        print(json.dumps(one_variant(args)))
        return
    import torch

    variants = {}
    for bits in (16, 4):
        child = [sys.executable, __file__, "--bits", str(bits), "--layers", str(args.layers)]
        child += ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
        done = subprocess.run(child, check=True, capture_output=True, text=True)
        variants[bits] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{bits}-bit base: {json.dumps(variants[bits])}", flush=True)
    dense, packed = variants[16], variants[4]
    report: dict[str, Any] = {
        "benchmark": "host_memory",
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": 32000,
        },
        "variants": {"16": dense, "4": packed},
        "ratios": {
            "base_rss": packed["base_rss"] / dense["base_rss"],
            "block_base_bytes": packed["block_base_bytes"] / dense["block_base_bytes"],
            "h2d_bytes_per_iteration": packed["h2d_bytes_per_iteration"] / dense["h2d_bytes_per_iteration"],
        },
        "targets": {"base_rss": 0.35, "h2d_bytes_per_iteration": 0.35, "demo_loss_relative": 0.05},
    }
    if not args.skip_loss:
        losses = {bits: demo_losses(bits, args.steps) for bits in (16, 4)}
        tail = {bits: statistics.mean(v[-5:]) for bits, v in losses.items()}
        report["demo"] = {
            "steps": args.steps,
            "losses": {str(b): v for b, v in losses.items()},
            "last5_mean": {str(b): v for b, v in tail.items()},
            "relative_difference": abs(tail[4] - tail[16]) / tail[16],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("variants",)}, indent=2))


if __name__ == "__main__":
    main()
