"""Continuous batching on the CPU: 4 requests at once against the same 4 one after another.

``python bench/inference_batching.py [--tokens 64] [--repeats 3] [--model demo|tiny]``

The inference service's decode loop (``engine.inference.batching``) on the demo model
(SmolLM2-135M-Instruct, fp32, as the service loads it on a CPU host): four chat prompts of
different lengths, each answered greedily with ``--tokens`` new tokens (no stop token, so every
run decodes the same count), on ``--threads`` torch threads (1 by default: on a shared machine
OpenMP's barriers in several threads make single forwards vary tenfold). ``sequential``: each
request submitted after the previous one ended; ``concurrent``: all four submitted together, so
each step is one forward over four rows. The two alternate, ``--repeats`` times; medians.
Target: concurrent / sequential <= 0.4.
Results: ``results/inference_batching.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from engine.inference.batching import Ask, Batcher, End, Model
from engine.inference.chat import Sampling, prompt_ids

OUT = Path(__file__).resolve().parent / "results" / "inference_batching.json"
PROMPTS = [
    "What is two plus three?",
    "Name three colours of the rainbow.",
    "Write one sentence about trains and the stations they stop at on a long journey.",
    "Hi",
]


def load(which: str) -> tuple[Any, Any, str]:
    from engine.model.loading import load_model, load_tokenizer, prepare_demo_model

    if which == "demo":
        folder = prepare_demo_model(Path(tempfile.gettempdir()) / "roundhouse-bench-models")
    else:
        from tests.engine.tiny import tiny_model_folder

        folder = Path(tempfile.mkdtemp()) / "tiny"
        tiny_model_folder(folder)
    return load_model(folder).eval(), load_tokenizer(folder), str(folder.name)


def run(
    batcher: Batcher, model: Model, tokenizer: Any, prompts: list[list[int]], tokens: int, *, together: bool
) -> float:
    """Wall seconds until all prompts are answered."""

    def ask() -> tuple[Ask, threading.Event]:
        done = threading.Event()

        def emit(event: Any) -> None:
            if isinstance(event, End):
                done.set()

        return Ask([], Sampling(0.0, 1.0, tokens), tokenizer, emit), done

    start = time.perf_counter()
    waits = []
    for ids in prompts:
        request, done = ask()
        request.ids = ids
        batcher.submit(model, request)
        if together:
            waits.append(done)
        else:
            assert done.wait(600)
    for done in waits:
        assert done.wait(600)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=["demo", "tiny"], default="demo")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steady on a shared machine; 0: torch's default)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    module, tokenizer, name = load(args.model)
    batcher, model = Batcher().start(), Model(module, name=name)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    run(batcher, model, tokenizer, prompts[:1], 4, together=False)  # warm-up
    times: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    for _ in range(args.repeats):
        for variant in ("sequential", "concurrent"):
            took = run(batcher, model, tokenizer, prompts, args.tokens, together=variant == "concurrent")
            times[variant].append(took)
            print(f"{variant}: {took:.2f} s", flush=True)
    batcher.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["concurrent"] / median["sequential"]
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": name,
        "parameters": sum(p.numel() for p in module.parameters()),
        "dtype": "float32",
        "requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens_each": args.tokens,
        "runs_s": times,
        "median_s": median,
        "tokens_per_s": {k: len(prompts) * args.tokens / v for k, v in median.items()},
        "ratio_concurrent_to_sequential": ratio,
        "target": 0.4,
        "meets_target": ratio <= 0.4,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"concurrent / sequential = {ratio:.3f} (target <= 0.4) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
