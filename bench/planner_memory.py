"""The planner's activations and stage memory against what CPU workers really hold, three families.

For each family (Llama, Qwen3, Qwen3-MoE) a randomly initialised model of a shape the table was
not fitted on (4 blocks x 256 hidden, bf16 compute, full fine-tuning) trains one micro-batch of
2 x 1024 tokens, the whole model one fused stage: the stage that keeps every block's
activations. Two measurements per family:

- **activations**: the fused stage's forward (embeddings, every block, the final norm and the
  chunked loss, ``engine.model.adapter.run_layer`` as the worker calls it) with gradients on
  under ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the unique storages saved for
  backward, less the weights and the micro-batch's context (masks, rotary tables) — the peak of
  activations, reached when the backward starts. The blocks' share is compared with the
  planner's ``activations`` term of the blocks (``engine.planner.memory``), the whole with all
  of the stage's activation and logits terms.
- **stage**: the growth of the process's resident memory during one ``forward_backward`` of
  RoundPipe on one CPU worker (``VmHWM`` reset through ``/proc/self/clear_refs``, minus
  ``VmRSS`` before; each in its own process, ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB so freed
  tensors leave the resident set; as ``bench/long_context.py``), against the planner's terms of
  the same stage (weights, activations, gradients, logits, workspace; no prefetch: one step
  queues no next stage) less the weights: a CPU worker computes on the host's compute copy, it
  uploads nothing (``stage_memory_with_weights`` keeps them, the ratio a GPU worker would see).

"Before" is the planner's per-block estimate before the measured table (its own
tensor-by-tensor count) and the engine's 16 hidden-sized tensors a block.

    python bench/planner_memory.py

Results: ``bench/results/planner_memory.json``; target: every ratio within 10%.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

FAMILIES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SIZES: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
MOE_SIZES = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 176, "mlp_only_layers": [0]}
BATCH, SEQ, CHUNK, DTYPE = 2, 1024, 1024, "bfloat16"
TARGET = 0.10


def config_dict(architecture: str) -> dict[str, Any]:
    sizes = SIZES | (MOE_SIZES if "Moe" in architecture else {})
    return sizes | {"architectures": [architecture], "model_type": _model_type(architecture)}


def _model_type(architecture: str) -> str:
    from engine.model.families import FAMILIES as TABLE

    return TABLE[architecture].model_type


def build(architecture: str) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, architecture)
    config = {k: v for k, v in config_dict(architecture).items() if k != "architectures"}
    model = cls(cls.config_class(**config))
    model.train()
    return model


def batch() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def saved_activations(architecture: str) -> dict[str, int]:
    """Saved-tensor bytes of the fused stage's forward: the blocks' and the whole stage's."""
    import torch

    from engine.model.adapter import AdaptedModel, run_layer

    model = build(architecture).to(torch.bfloat16)
    adapted = AdaptedModel(model, loss_chunk_tokens=CHUNK)
    data = batch()
    skip = {t.untyped_storage().data_ptr() for t in model.parameters()}
    kept: dict[int, int] = {}
    blocks = 0
    with torch.enable_grad():
        x = adapted.layers[0].module(data["input_ids"])
        ctx = adapted.build_context(adapted.rotary, x, torch.ones(BATCH, SEQ, dtype=torch.long))
        shared = [ctx.position_ids, *ctx.masks.values()]
        shared += [t for table in ctx.position_embeddings.values() for t in table]
        skip |= {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for layer in adapted.layers[1:-1]:
                x = run_layer(layer, layer.module, x, ctx)
            blocks = sum(kept.values())
            loss = run_layer(adapted.layers[-1], adapted.layers[-1].module, x, ctx, data["labels"])
    del loss
    return {"blocks": blocks, "stage": sum(kept.values())}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(architecture: str) -> dict[str, Any]:
    """One fused-stage step on one CPU worker in this process: resident growth and time."""
    from engine import EngineConfig, RoundPipe

    layers = SIZES["num_hidden_layers"] + 2
    engine = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        partition={"forward": [], "fused": layers, "backward": []},
        calibration_steps=0,
        loss_chunk_tokens=CHUNK,
        compute_dtype=DTYPE,
    )
    with RoundPipe(build(architecture), engine) as rp:
        data = batch()
        rp.forward_backward(input_ids=data["input_ids"][:1, :64], labels=data["labels"][:1, :64])
        rp.synchronize()  # the host buffers the engine creates lazily
        gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        rp.forward_backward(**data)
        rp.synchronize()
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM")
    return {"peak_bytes": peak - before, "seconds": seconds}


def legacy_block_bytes(shape: Any, block: int, d: int) -> float:
    """The planner's bytes per token of a block before the measured table (tensor by tensor)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = d * (3 * h + q + 2 * kv + q + h + 3 * shape.mlp_width(block))
    if shape.is_moe_block(block):
        per_token += d * shape.moe.active * h + 4 * shape.moe.experts
    return float(per_token)


def predicted(architecture: str) -> dict[str, Any]:
    """The planner's terms of the fused stage (bytes), and the two old per-block estimates."""
    from engine.planner import DTYPE_BYTES, Hardware, Shape, Workload, memory_model
    from engine.planner.activations import block_bytes_per_token
    from engine.scheduling.partition import Plan

    shape = Shape.from_config(config_dict(architecture))
    job = Workload(
        seq_len=SEQ,
        batch_size=BATCH,
        num_microbatches=1,
        method="full",
        compute_dtype=DTYPE,
        loss_chunk_tokens=CHUNK,
    )
    memory = memory_model(shape, job, Hardware(gpu_memory_gb=1024.0), shape.layer_params())
    layers = shape.layers + 2
    terms = memory.stage_terms(Plan.from_counts(layers, forward=[], fused=layers, backward=[]), 0, 1)
    terms["total"] -= terms.pop("prefetch")  # one step: nothing queued to prefetch
    tokens, d = BATCH * SEQ, DTYPE_BYTES[DTYPE]
    per_token = [block_bytes_per_token(shape, b, DTYPE) for b in range(shape.layers)]
    return {
        "terms": terms,
        "blocks": sum(memory.activations[1:-1]),
        "per_token_per_block": per_token,
        "hidden_tensors_per_block": [p / (shape.hidden * d) for p in per_token if p is not None],
        "before": {
            "planner_blocks": tokens * sum(legacy_block_bytes(shape, b, d) for b in range(shape.layers)),
            "engine_16_blocks": tokens * shape.layers * 16 * shape.hidden * d,
        },
    }


def run(architecture: str, env: dict[str, str]) -> dict[str, Any]:
    measured = saved_activations(architecture)
    cmd = [sys.executable, __file__, "--child", architecture]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    stage = json.loads(out.stdout.strip().splitlines()[-1])
    p = predicted(architecture)
    t = p["terms"]
    stage_activations = t["activations"] + t["logits"]
    # a CPU worker computes on the host's compute copy (``DeviceLink.upload`` returns it): no
    # weights term in its growth
    on_cpu = t["total"] - t["weights"]
    return {
        "architecture": architecture,
        "measured": {"block_activations": measured["blocks"], "stage_activations": measured["stage"]}
        | {"stage_resident_growth": stage["peak_bytes"], "step_seconds": stage["seconds"]},
        "predicted": p,
        "ratios": {
            "block_activations": p["blocks"] / measured["blocks"],
            "stage_activations": stage_activations / measured["stage"],
            "stage_memory": on_cpu / stage["peak_bytes"],
        },
        "stage_memory_with_weights": t["total"] / stage["peak_bytes"],
        "ratios_before": {
            "block_activations_planner": p["before"]["planner_blocks"] / measured["blocks"],
            "block_activations_engine_16": p["before"]["engine_16_blocks"] / measured["blocks"],
            "stage_memory_planner": (on_cpu - p["blocks"] + p["before"]["planner_blocks"])
            / stage["peak_bytes"],
            "stage_memory_engine_16": (on_cpu - p["blocks"] + p["before"]["engine_16_blocks"])
            / stage["peak_bytes"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", metavar="ARCHITECTURE")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    import torch
    import transformers

    env = os.environ | {"HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    started = time.perf_counter()
    rows = []
    for architecture in FAMILIES:
        row = run(architecture, env)
        rows.append(row)
        r, b = row["ratios"], row["ratios_before"]
        print(
            f"{architecture:22s} predicted/measured: blocks {r['block_activations']:.3f} "
            f"(before {b['block_activations_planner']:.3f} planner, "
            f"{b['block_activations_engine_16']:.3f} engine 16), stage activations "
            f"{r['stage_activations']:.3f}, stage memory {r['stage_memory']:.3f} "
            f"(before {b['stage_memory_planner']:.3f} planner, {b['stage_memory_engine_16']:.3f} engine 16)",
            flush=True,
        )
    within = all(abs(v - 1) <= TARGET for row in rows for v in row["ratios"].values())
    result = {
        "benchmark": "planner_memory",
        "setup": f"{SIZES['num_hidden_layers']} blocks x {SIZES['hidden_size']} hidden, {DTYPE}, full "
        f"fine-tuning, one micro-batch of {BATCH} x {SEQ} tokens, loss chunk {CHUNK}, the whole model "
        "one fused stage on one CPU worker",
        "sizes": SIZES,
        "moe_sizes": MOE_SIZES,
        "target": f"every ratio within {TARGET:.0%}",
        "within_target": within,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_memory.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
