"""Long sequences: peak memory of one worker's training step against sequence length, with the
chunked loss and with whole-micro-batch logits, next to the planner's prediction.

The model is a randomly initialised Llama (2 blocks x 128 hidden, 2 heads of 64, vocabulary
32000, so the logits matter; so small that the quadratic attention of 32k tokens takes minutes,
not tens of minutes, on two cores), trained in full in fp32 by RoundPipe on one CPU worker, one sequence per
micro-batch, the whole model one fused stage (forward, loss and backward of every layer on the
worker: the stage that holds the most). Two variants per length:

- ``chunked``: the engine's loss, ``loss_chunk_tokens=4096`` (``engine.model.loss``);
- ``full_logits``: ``loss_chunk_tokens`` = the sequence, so the output layer computes the logits
  of the whole micro-batch at once (the baseline without chunking).

What is measured: the growth of the process's resident memory during one ``forward_backward``
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` before the
step). The CPU worker shares the process with the host state, so this is everything the step
allocates: the worker's copy of the stage's weights, activations, logits, gradient buffers, and
the host's side of the step. torch's profiler does not see allocations on the worker's thread,
and ``tracemalloc`` does not see torch's, so resident memory is the honest count here; each
measurement runs in its own process with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB, so every
tensor but the smallest is its own mapping, returned on free, and the peak follows the live
tensors. A short step first allocates what the engine creates lazily (host gradient buffers).

The planner's prediction is the same stage's terms from ``engine.planner.memory`` (weights,
activations, gradients, logits, workspace; no prefetch: one step queues no next stage). Attention
on the CPU is quadratic in time, so lengths stop at 32k (whole-micro-batch logits at 16k: at 32k
they alone are 4 GB a copy).

    python bench/long_context.py [--lengths 1024,2048,4096,8192,16384,32768] [--full-max 16384]

Results: ``bench/results/long_context.json`` and ``long_context.md``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS, HIDDEN, HEADS, INTERMEDIATE, VOCAB = 2, 128, 2, 344, 32000
CHUNK = 4096
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
MIB = 2**20


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": BLOCKS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": max(LENGTHS),
        "tie_word_embeddings": False,
    }


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(seq: int, chunk: int) -> dict:
    """One step at ``seq`` tokens in this process: its peak resident growth and time."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig, RoundPipe

    torch.manual_seed(0)
    config = {k: v for k, v in model_config().items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**config))
    layers = BLOCKS + 2
    engine = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        partition={"forward": [], "fused": layers, "backward": []},
        calibration_steps=0,
        loss_chunk_tokens=chunk,
    )
    g = torch.Generator().manual_seed(1)
    with RoundPipe(model, engine) as rp:
        ids = torch.randint(0, VOCAB, (1, 64), generator=g)
        rp.forward_backward(input_ids=ids, labels=ids.clone())  # lazily created host buffers
        rp.synchronize()
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        labels = ids.clone()
        gc.collect()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        loss = rp.forward_backward(input_ids=ids, labels=labels)
        rp.synchronize()
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM")
    return {"seq": seq, "chunk": chunk, "peak_bytes": peak - before, "seconds": seconds, "loss": loss}


def predicted(seq: int, chunk: int) -> dict[str, float]:
    """The planner's terms (bytes) of the same stage: the whole model fused, one step."""
    from engine.planner import Hardware, Shape, Workload, memory_model
    from engine.scheduling.partition import Plan

    shape = Shape.from_config(model_config())
    job = Workload(
        seq_len=seq,
        batch_size=1,
        num_microbatches=1,
        method="full",
        compute_dtype="float32",
        loss_chunk_tokens=chunk,
    )
    memory = memory_model(shape, job, Hardware(gpu_memory_gb=1024.0), shape.layer_params())
    layers = BLOCKS + 2
    plan = Plan.from_counts(layers, forward=[], fused=layers, backward=[])
    terms = memory.stage_terms(plan, 0, num_workers=1)
    terms["total"] -= terms.pop("prefetch")  # one step: nothing queued to prefetch
    return terms


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def table(rows: list[dict]) -> str:
    """The markdown table of the results."""
    lines = [
        "| tokens | chunked MiB | planner MiB | full logits MiB | planner MiB | chunked − logits term MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        full = r.get("full_logits")
        lines.append(
            f"| {r['seq']:,} | {r['chunked']['peak_bytes'] / MIB:,.0f} | "
            f"{r['chunked']['predicted']['total'] / MIB:,.0f} | "
            + (
                f"{full['peak_bytes'] / MIB:,.0f} | {full['predicted']['total'] / MIB:,.0f} | "
                if full
                else "– | – | "
            )
            + f"{r['chunked']['without_logits'] / MIB:,.0f} |"
        )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """``long_context.md``: the table, the slope and where it ran."""
    m, v = result["machine"], result["versions"]
    return "\n".join(
        [
            "# long_context",
            "",
            f"{result['model']}; {result['setup']}; {result['measure']}. "
            f"Chunked loss: {result['loss_chunk_tokens']} tokens a chunk. Planner: the "
            "`engine.planner.memory` terms of the same stage (no prefetch).",
            "",
            table(result["rows"]),
            "",
            "Marginal bytes per token of the chunked step without its logits term, between "
            f"consecutive lengths from {result['loss_chunk_tokens']}: "
            + ", ".join(f"{s:,.0f}" for s in result["bytes_per_token_without_logits"]),
            "",
            f"{m['cpu_count']} CPUs ({m['processor']}, {m['torch_threads']} torch threads), "
            f"{m['platform']}; Python {v['python']}, torch {v['torch']}, transformers "
            f"{v['transformers']}; {result['seconds']:.0f} s in all.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default=",".join(str(n) for n in LENGTHS))
    parser.add_argument("--full-max", type=int, default=16384, help="longest run with whole logits")
    parser.add_argument("--child", nargs=2, type=int, metavar=("SEQ", "CHUNK"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    env = os.environ | {"HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    rows = []
    started = time.perf_counter()
    for seq in (int(n) for n in args.lengths.split(",")):
        row: dict = {"seq": seq}
        for name, chunk in (("chunked", CHUNK), ("full_logits", seq)):
            if name == "full_logits" and seq > args.full_max:
                continue
            cmd = [sys.executable, __file__, "--child", str(seq), str(chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run["predicted"] = predicted(seq, chunk)
            run["without_logits"] = run["peak_bytes"] - run["predicted"]["logits"]
            row[name] = run
            print(
                f"{seq:6d} tokens {name:11s} peak {run['peak_bytes'] / MIB:8.0f} MiB, planner "
                f"{run['predicted']['total'] / MIB:8.0f} MiB ({run['seconds']:.1f} s)",
                flush=True,
            )
        rows.append(row)
    # marginal bytes per token between consecutive lengths, once the chunk no longer grows
    slopes = [
        (b["chunked"]["without_logits"] - a["chunked"]["without_logits"]) / (b["seq"] - a["seq"])
        for a, b in itertools.pairwise(rows)
        if a["seq"] >= CHUNK
    ]
    import torch

    result = {
        "benchmark": "long_context",
        "model": f"Llama {BLOCKS} blocks x {HIDDEN} hidden, {HEADS} heads, vocab {VOCAB}, fp32, full",
        "setup": "one CPU worker, one sequence per micro-batch, the whole model one fused stage",
        "measure": "resident memory growth during one forward_backward (VmHWM - VmRSS before)",
        "loss_chunk_tokens": CHUNK,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": versions(),
        "seconds": time.perf_counter() - started,
        "bytes_per_token_without_logits": slopes,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "long_context.md").write_text(markdown(result))
    print(table(rows))


if __name__ == "__main__":
    main()
