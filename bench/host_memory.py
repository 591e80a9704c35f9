"""Host memory and PCIe bytes of a LoRA base in 16 and in 4 bits (``method.base_bits``).

Part one: a randomly initialised Llama-shaped model (about 1.45e9 parameters by default) saved
in bfloat16 safetensors shards (500 MB: a model's shards are small against the model, 5 GB of
hundreds for the paper's largest, and a 4-bit load holds one shard's dense pages at a time);
then, each variant in its own process, loaded as a training run loads it (``load_model`` in the
compute dtype), LoRA r16 on the family's default targets, one CPU worker, bfloat16 compute. It
reports the process's RSS before the model exists, once it is loaded, once the engine holds it
and after one iteration (steady state: every weight read, and the C heap's freed memory handed
back), the peak RSS of the load (the model loaded and handed to the engine) and of the whole run
(where a CPU worker's stage copies of the weights, device memory on a GPU, are host memory
too), the bytes of the blocks' base weights as the engine keeps them, and the bytes one training
iteration uploads (``transfer/h2d_bytes``, counted by the transfer layer as it copies). The base
weights' RSS is the steady state's less the adapter's training state (its masters, gradients,
compute copies and optimizer moments, counted exactly; the same in both variants). Targets: the
4-bit variant's base-weight RSS and uploaded bytes <= 0.35x the 16-bit one's; the peak of the
load <= 1.15x the steady state. A third variant loads the same model saved as a bitsandbytes
4-bit folder (NF4, double-quantized scales, written by transformers with bitsandbytes), its
weights kept packed as stored (``engine.model.prequantized``): the same figures, against the
16-bit base (``ratios_bnb4``).

Part two: the demo task (``roundhouse demo``'s model and data), 20 LoRA steps with each base;
the loss on the demo's held-out rows after the last step with a 4-bit base within 5% of the
16-bit one (``relative_difference``, means over ``--seeds`` seeds; the mean training loss of the
last five steps, one batch of 8 each, is reported too). Then, to find where a gap comes from,
control runs (seed 0): a 16-bit base on the demo model with its weights replaced by their
NF4-decoded values (all of them, the attention's only, the MLP's only), and both bases trained
``--long-steps`` steps (does a gap close with more training?).

Part three: packing one tensor to NF4 (``engine.model.quant.pack``), the fused expert weights
of Qwen3-235B-A22B's MoE layers (``[experts, 3072, 4096]`` in bfloat16: gate and up of 128
experts, 3.2 GB), an 8-expert slice and the whole tensor, each in its own process. Steady: the
process's RSS once it holds the source tensor and its packed buffer (heap trimmed); peak: the
most it held, packing included. Target: peak <= 1.15x steady.

    python bench/host_memory.py [--layers 24] [--hidden 2048] [--shard-size 500MB]
                                [--part all|memory|demo|packing] [--seeds 3] [--long-steps 40]
                                [--experts 8 128]

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
PARTS = ("memory", "demo", "packing")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def save_model(args: argparse.Namespace) -> None:
    """A randomly initialised Llama of the given shape, saved in bfloat16 safetensors shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(args.save, max_shard_size=args.shard_size)


def save_bnb(args: argparse.Namespace) -> None:
    """The saved model quantized as the hub's ``-bnb-4bit`` folders are (transformers with
    bitsandbytes: NF4, double-quantized scales), in shards of the same size."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.folder, quantization_config=quantization, dtype=torch.bfloat16
    )
    model.save_pretrained(args.save_bnb, max_shard_size=args.shard_size)


def one_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Load the saved model as a training run does, wrap it, train one iteration with
    ``args.bits``; the figures as a dict."""
    import ctypes
    import resource

    import psutil
    import torch
    from peft import LoraConfig, get_peft_model

    from engine import EngineConfig, RoundPipe
    from engine.metrics import ListSink
    from engine.model.families import family_for
    from engine.model.loading import load_model

    start = _rss()
    t0 = time.perf_counter()
    # a run's load: in its compute dtype; a quantized folder's weights stay packed in 4 bits
    model = load_model(args.folder, dtype="bfloat16", keep_packed=args.bits == 4)
    targets = list(family_for("LlamaForCausalLM").lora_targets)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    parameters = sum(p.numel() for p in model.parameters())
    loaded = _rss()
    sink = ListSink()
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
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
    # steady state: every weight was read by now (a model loaded from safetensors is memory
    # mapped, and its pages count only once touched); file-backed pages are the mapped files'
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the C heap keeps of freed tensors: not held
    memory = psutil.Process().memory_info()
    steady, file_backed = int(memory.rss), int(memory.shared)
    peak_run = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # what the adapter's training holds besides the base (the same in both variants), counted
    # exactly: its fp32 masters and gradients, its compute copies and the optimizer's moments
    trained = [t for t in host.trainable]
    optimizer = rp.optimizer.state_dict()
    moments = sum(v.nbytes for v in _tensors(optimizer))
    trainable_state = moments + sum(
        (t.master.nbytes if t.master is not None else 0)
        + 4 * t.compute.numel()  # its gradient, fp32
        + t.compute.nbytes
        + (t.compute_alt.nbytes if t.compute_alt is not None else 0)
        for t in trained
    )
    rp.close()
    return {
        "bits": args.bits,
        "parameters": parameters,
        "rss_start": start,
        "rss_model_loaded": loaded,
        "rss_engine_holds_it": held,
        "rss_after_iteration": steady,
        "rss_file_backed_after_iteration": file_backed,
        # what the base costs the process in steady state (the model's own copy gone), and the
        # same without the adapter's training state (``trainable_state_bytes``, exact): the base
        # weights' own share
        "base_rss": steady - start,
        "trainable_state_bytes": trainable_state,
        "base_weights_rss": steady - start - trainable_state,
        # the most the process held while loading and handing the model to the engine (the
        # target's figure), and over the whole run, where a CPU worker's stage copies of the
        # weights (device memory on a GPU) are host memory too
        "peak_rss_loading": peak,
        "peak_rss_run": peak_run,
        "peak_over_steady": peak / steady,
        "block_base_bytes": block_base_bytes,
        "packed_tensors": sum(1 for t in blocks if t.packed is not None),
        "h2d_bytes_per_iteration": metrics.get("transfer/h2d_bytes"),
        "load_s": load_s,
        "iteration_s": step_s,
        "loss": float(loss),
    }


def _tensors(value: Any) -> list[Any]:
    """Every tensor inside a nested state (dicts, lists, tuples)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def demo_losses(bits: int, steps: int, seed: int, model: str = "demo") -> tuple[list[float], float]:
    """The training loss of each of ``steps`` LoRA steps on the demo task with a ``bits`` base,
    and the loss on the demo's held-out rows after the last step."""
    from engine import demo
    from engine.config import TrainConfig
    from engine.metrics import ListSink
    from engine.training.run import train

    sink = ListSink()
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig.parse(
            {
                "model": {"path": model},
                "data": {"train": str(demo.TRAIN), "validation": str(demo.HELDOUT), "max_length": 96},
                "method": {"kind": "lora", "lora_r": 16, "lora_alpha": 32, "base_bits": bits},
                "hyper": {
                    "max_steps": steps,
                    "batch_size": 8,
                    "learning_rate": 2e-3,
                    "warmup_steps": 5,
                    "seed": seed,
                },
                "engine": {"devices": ["cpu"], "num_microbatches": 2},
                "checkpoint": {"every_steps": steps, "keep_last": 1},
                "eval": {"every_steps": steps},
                "output_dir": out,
            }
        )
        train(config, sink, models_dir=ROOT / "data" / "models")
    losses = [m["loss/train"] for _, m in sink.records if "loss/train" in m and "tokens/label" in m]
    held_out = [m["loss/val"] for _, m in sink.records if "loss/val" in m]
    return losses, held_out[-1]


CONTROL_PARTS = {"all": ".layers.", "attention": ".self_attn.", "mlp": ".mlp."}


def decoded_demo_model(folder: Path, part: str = "all") -> Path:
    """The demo model with each weight a 4-bit base packs (those of ``part`` of the blocks:
    ``CONTROL_PARTS``) replaced by its NF4-decoded bfloat16 values
    (``engine.model.quant.dequantized``), saved as a plain model: a 16-bit run on it is the 4-bit
    run's arithmetic without the engine's 4-bit path (the control)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model import quant
    from engine.model.loading import prepare_demo_model

    source = prepare_demo_model(ROOT / "data" / "models")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # a block's matrices (quantizable: a floating matrix, so never a norm); the demo model
            # (Llama) has no biases or router, which the engine would leave unpacked
            if ".layers." in name and CONTROL_PARTS[part] in name and quant.quantizable(p):
                p.copy_(quant.dequantized(p.to(torch.bfloat16), torch.bfloat16).float())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


EXPERT_SHAPE = (3072, 4096)  # Qwen3-235B-A22B: gate and up (2 x 1536) of hidden 4096, fused


def pack_variant(experts: int) -> dict[str, Any]:
    """Pack a ``[experts, 3072, 4096]`` bfloat16 tensor to NF4; the figures as a dict."""
    import ctypes
    import resource

    import torch

    from engine.model import quant

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    quant._nf4()  # torchao imported before the first figure
    start = _rss()
    source = torch.empty(experts, *EXPERT_SHAPE, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for expert in source:  # filled in place: no float32 copy of it
        expert.normal_(0, 0.02, generator=g)
    trim(0)
    with_source = _rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    buffer, _ = quant.pack(source, torch.bfloat16)
    pack_s = time.perf_counter() - t0
    trim(0)
    steady = _rss()  # the source and its packed buffer, held
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "shape": list(source.shape),
        "source_bytes": source.nbytes,
        "packed_bytes": buffer.nbytes,
        "rss_start": start,
        "rss_source": with_source,
        "rss_steady": steady,
        "peak_rss_before_packing": peak_before,
        "peak_rss": peak,
        "peak_over_steady": peak / steady,
        # what packing held beyond its result, against what the process keeps of the tensor
        "transient_bytes": peak - steady,
        "transient_over_held": (peak - steady) / (steady - start),
        "pack_s": pack_s,
    }


def packing_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part three: each tensor packed in a child process."""
    variants = {}
    for experts in args.experts:
        child = [sys.executable, __file__, "--pack", str(experts)]
        done = subprocess.run(child, check=True, capture_output=True, text=True)
        variants[str(experts)] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{experts} experts: {json.dumps(variants[str(experts)])}", flush=True)
    from engine.model import quant

    chunk = getattr(quant, "CHUNK", None)  # None: the whole tensor at once (before chunking)
    peaks = {name: v["peak_over_steady"] for name, v in variants.items()}
    return {"chunk_values": chunk, "variants": variants, "peak_over_steady": peaks}


def memory_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part one: both variants, each in a child process, on one saved model."""
    variants = {}
    shape = [
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
    ]
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, __file__, "--save", folder, "--shard-size", args.shard_size, *shape], check=True
        )
        bnb = str(Path(folder) / "bnb-4bit")
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--folder",
                folder,
                "--save-bnb",
                bnb,
                "--shard-size",
                args.shard_size,
            ],
            check=True,
        )
        for name, bits, source in (("16", 16, folder), ("4", 4, folder), ("bnb4", 4, bnb)):
            child = [sys.executable, __file__, "--bits", str(bits), "--folder", source, *shape]
            done = subprocess.run(child, check=True, capture_output=True, text=True)
            variants[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name} base: {json.dumps(variants[name])}", flush=True)
    dense, packed, bnb4 = variants["16"], variants["4"], variants["bnb4"]
    return {
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": 32000,
            "shard_size": args.shard_size,
        },
        "variants": variants,
        "ratios": {
            "base_rss": packed["base_rss"] / dense["base_rss"],
            "base_weights_rss": packed["base_weights_rss"] / dense["base_weights_rss"],
            "block_base_bytes": packed["block_base_bytes"] / dense["block_base_bytes"],
            "h2d_bytes_per_iteration": packed["h2d_bytes_per_iteration"] / dense["h2d_bytes_per_iteration"],
        },
        # the same model as a bitsandbytes 4-bit folder, its weights kept packed as stored
        "ratios_bnb4": {
            "base_weights_rss": bnb4["base_weights_rss"] / dense["base_weights_rss"],
            "block_base_bytes": bnb4["block_base_bytes"] / dense["block_base_bytes"],
            "h2d_bytes_per_iteration": bnb4["h2d_bytes_per_iteration"] / dense["h2d_bytes_per_iteration"],
        },
        "peak_over_steady_loading": {name: v["peak_over_steady"] for name, v in variants.items()},
    }


def demo_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part two: the demo task's loss with each base, over ``args.seeds`` seeds (the data order
    and dropout; a step's loss is one batch of 8 and 20 steps of bfloat16 training amplify small
    differences, so one seed's figures are noisy), and the controls (seed 0): a 16-bit base on the
    demo model whose weights (all, the attention's, the MLP's) were replaced by their NF4-decoded
    values, and both bases trained ``args.long_steps`` steps."""
    seeds = list(range(args.seeds))
    runs = {(bits, seed): demo_losses(bits, args.steps, seed) for seed in seeds for bits in (16, 4)}
    controls = {}
    for part in CONTROL_PARTS:
        with tempfile.TemporaryDirectory() as folder:
            decoded = decoded_demo_model(Path(folder) / "decoded", part)
            controls[part] = demo_losses(16, args.steps, 0, model=str(decoded))
    longer = {bits: demo_losses(bits, args.long_steps, 0) for bits in (16, 4)} if args.long_steps else {}
    held = {bits: statistics.mean(runs[bits, seed][1] for seed in seeds) for bits in (16, 4)}
    tail = {
        bits: statistics.mean(statistics.mean(runs[bits, seed][0][-5:]) for seed in seeds) for bits in (16, 4)
    }
    return {
        "steps": args.steps,
        "seeds": seeds,
        "losses": {f"{bits}/seed{seed}": v[0] for (bits, seed), v in runs.items()},
        "held_out_loss": {f"{bits}/seed{seed}": v[1] for (bits, seed), v in runs.items()},
        "held_out_loss_mean": {str(b): v for b, v in held.items()},
        "relative_difference": abs(held[4] - held[16]) / held[16],
        "last5_train_loss_mean": {str(b): v for b, v in tail.items()},
        "last5_relative_difference": abs(tail[4] - tail[16]) / tail[16],
        # the controls: the 4-bit arithmetic through the 16-bit path (seed 0), with every packed
        # weight of the blocks NF4-decoded, or the attention's only, or the MLP's only
        "control_16bit_on_decoded_weights": {
            part: {"held_out_loss": held_out, "losses": losses}
            for part, (losses, held_out) in controls.items()
        },
        "longer_run": {
            "steps": args.long_steps,
            **{
                f"{bits}": {"held_out_loss": held_out, "last5_train_loss_mean": statistics.mean(losses[-5:])}
                for bits, (losses, held_out) in longer.items()
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=6912)
    parser.add_argument("--shard-size", default="500MB", help="the saved model's safetensors shards")
    parser.add_argument("--steps", type=int, default=20, help="demo-task steps per variant")
    parser.add_argument("--seeds", type=int, default=3, help="demo-task runs per variant")
    parser.add_argument(
        "--long-steps", type=int, default=40, help="the demo task's longer run per base (0: none)"
    )
    parser.add_argument(
        "--part",
        choices=("all", *PARTS),
        default="all",
        help="one part only: the other part's figures already in --out are kept, with their time",
    )
    parser.add_argument(
        "--experts", type=int, nargs="+", default=[8, 128], help="part three's tensors: experts in each"
    )
    parser.add_argument("--pack", type=int, help=argparse.SUPPRESS)  # a child: pack one tensor
    parser.add_argument("--bits", type=int, help=argparse.SUPPRESS)  # a child: one variant
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # ... of this saved model
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)  # a child: save the model
    parser.add_argument("--save-bnb", type=Path, help=argparse.SUPPRESS)  # ... or a bnb copy of it
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_memory.json")
    args = parser.parse_args()
    if args.save is not None:
        save_model(args)
        return
    if args.save_bnb is not None:
        save_bnb(args)
        return
    if args.pack is not None:
        print(json.dumps(pack_variant(args.pack)))
        return
    if args.bits is not None:
        print(json.dumps(one_variant(args)))
        return
    import torch

    report: dict[str, Any] = {}
    if args.part != "all" and args.out.exists():
        kept = json.loads(args.out.read_text())
        report = {part: kept[part] for part in PARTS if part in kept}
    report.update(
        {
            "benchmark": "host_memory",
            "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "targets": {
                "base_weights_rss": 0.35,
                "h2d_bytes_per_iteration": 0.35,
                "demo_loss_relative": 0.05,
                "peak_over_steady_loading": 1.15,
                "peak_over_steady_packing": 1.15,
            },
        }
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.part in ("all", "memory"):
        report["memory"] = {"measured_at": now, **memory_part(args)}
    if args.part in ("all", "demo"):
        report["demo"] = {"measured_at": now, **demo_part(args)}
    if args.part in ("all", "packing"):
        report["packing"] = {"measured_at": now, **packing_part(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: v for k, v in report.get("memory", {}).items() if k != "variants"}
    packing = report.get("packing", {}).get("peak_over_steady")
    demo = report.get("demo", {}).get("relative_difference")
    print(json.dumps({"memory": summary, "demo": demo, "packing": packing}, indent=2))


if __name__ == "__main__":
    main()
