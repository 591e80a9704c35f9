"""Side by side on one GPU: the engine against the paper authors' own ``roundpipe`` 0.1.1 and
against a GPU-resident plain loop, on the same model and the same batch, in one run.

Workload: a Llama-3.2-1B-shaped model with an untied head (1.498e9 parameters), randomly
initialised from a config (on the GPU, then moved: nothing is downloaded); 32 x 2048 tokens per
step in 8 micro-batches; full fine-tuning with AdamW; bf16 compute with fp32 master weights.

Systems, each in its own process (so its peak memory and host RSS are its own):

- ``engine-sync`` / ``engine-async``: the engine at its automatic plan;
- ``engine-sync-24gb`` / ``engine-async-24gb``: the engine at a 24 GB card's budget (45%: 10.8 GiB);
- ``roundpipe-async`` / ``roundpipe-sync``: roundpipe 0.1.1 at its own automatic plan, run with
  its own ``PYTHONPATH`` (``--peer DIR``: the folder ``make gpu-bundle``'s peer wheels were
  installed into) and ``RPP_DISABLE_TORCH_COMPILE=1``;
- ``resident`` / ``resident-recompute``: the model, its gradients and a fused AdamW on the GPU,
  bf16 autocast, with and without full activation recompute (the fair ceilings).

Protocol: the ceilings first (pinned host-to-device and device-to-host GB/s one way and both at
once, bf16 matmul TFLOP/s, a bare CPU fused AdamW's seconds per 1e9 parameters), then every
system: a warm-up of at least the engine's calibration steps + 2, then ``--steps`` (>= 20 on a
GPU) steps, each timed. A row reports the steady period (the median step), the drain at the end
(``synchronize()``) on its own, tokens/s both ways (steady: tokens per median step; overall: every
timed step and the drain), peak GPU memory (allocated and reserved), and host RSS sampled *while
training* (not after ``close()``, which copies weights back). The ratios engine/roundpipe and
engine/resident come from the same run. The JSON is rewritten after each system, so a run that
is killed keeps what finished; ``--budget`` bounds the whole run (a system that would not fit is
recorded as skipped, with why).

``--cpu`` runs a tiny version of every engine and resident row on CPU workers (roundpipe is
skipped: 0.1.1 cannot even be imported on a machine without a GPU), so the test suite keeps this
script working without a GPU.

    python bench/side_by_side.py [--cpu] [--steps N] [--budget S] [--peer DIR] [--out PATH]
                                 [--systems NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RESULT_LINE = "SIDE_BY_SIDE_RESULT "
GIB = 2**30
CARD_24GB_BUDGET = int(0.45 * 24 * GIB)  # 10.8 GiB: the automatic plan's share of a 24 GB card


@dataclass(frozen=True)
class Workload:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    sequence: int
    batch: int
    microbatches: int
    devices: tuple[str, ...]
    compute_dtype: str

    @property
    def tokens(self) -> int:
        return self.batch * self.sequence


GPU_WORKLOAD = Workload(
    hidden=2048,
    layers=16,
    heads=32,
    kv_heads=8,
    intermediate=8192,
    vocab=128256,
    sequence=2048,
    batch=32,
    microbatches=8,
    devices=("cuda:0",),
    compute_dtype="bfloat16",
)
CPU_WORKLOAD = Workload(
    hidden=64,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=512,
    sequence=32,
    batch=8,
    microbatches=4,
    devices=("cpu", "cpu"),
    compute_dtype="float32",
)

ENGINE_SYSTEMS = ("engine-sync", "engine-async", "engine-sync-24gb", "engine-async-24gb")
PEER_SYSTEMS = ("roundpipe-async", "roundpipe-sync")
RESIDENT_SYSTEMS = ("resident", "resident-recompute")
SYSTEMS = (*ENGINE_SYSTEMS, *PEER_SYSTEMS, *RESIDENT_SYSTEMS)


# -- measuring inside a child --------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size, from /proc (no psutil on a bare GPU box)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples the process's RSS every ``interval`` seconds while training runs."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(rss_bytes())

    def figures(self) -> dict[str, float]:
        return {
            "rss_max_gib": max(self.samples) / GIB,
            "rss_median_gib": statistics.median(self.samples) / GIB,
        }


def build_model(w: Workload, *, dtype: Any, on: str) -> Any:
    """The workload's Llama, randomly initialised on ``on`` (fast on a GPU), in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        intermediate_size=w.intermediate,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads,
        max_position_embeddings=w.sequence,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.device(on):
        model = LlamaForCausalLM(config)
    model.to(dtype=dtype)
    model.train()
    return model


def batches(w: Workload, n: int = 4) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, w.vocab, (w.batch, w.sequence), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def gpu_memory(cuda: bool) -> dict[str, float]:
    if not cuda:
        return {}
    import torch

    return {
        "gpu_peak_allocated_gib": max(
            torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())
        )
        / GIB,
        "gpu_peak_reserved_gib": max(
            torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())
        )
        / GIB,
    }


class Clock:
    """The child's time limit: timed steps stop once 85% of it is gone (after at least 3), so the
    process reports what it measured instead of being killed."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + 0.85 * seconds
        self.cut = False

    def more(self, done: int, wanted: int) -> bool:
        if done >= wanted:
            return False
        if done >= 3 and time.monotonic() > self.end:
            self.cut = True
            return False
        return True


CLOCK = Clock(float("inf"))


def timing(w: Workload, step_s: list[float], drain_s: float) -> dict[str, Any]:
    median = statistics.median(step_s)
    total = sum(step_s) + drain_s
    return {
        "timed_steps": len(step_s),
        "step_s": step_s,
        "steady_step_s": median,
        "drain_s": drain_s,
        "tokens_per_s_steady": w.tokens / median,
        "tokens_per_s_overall": w.tokens * len(step_s) / total,
        "cut_short_by_budget": CLOCK.cut,
    }


def run_engine(system: str, w: Workload, *, warmup: int, steps: int, cuda: bool) -> dict[str, Any]:
    import torch

    from engine import EngineConfig, RoundPipe
    from engine.metrics import ListSink

    config = EngineConfig(
        devices=list(w.devices),
        num_microbatches=w.microbatches,
        optimizer="adamw",
        lr=1e-5,
        compute_dtype=w.compute_dtype,
        async_optimizer="async" in system,
        memory_budget_bytes=CARD_24GB_BUDGET if system.endswith("-24gb") else None,
        tf32=False,
    )
    warmup = max(warmup, config.calibration_steps + 2)
    model = build_model(w, dtype=torch.float32, on="cuda" if cuda else "cpu")
    model.to("cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    data = batches(w)
    sink = ListSink()
    step_s: list[float] = []
    with RoundPipe(model, config, sink=sink) as rp:
        for i in range(warmup):
            rp.forward_backward(**data[i % len(data)])
            rp.step()
        with RssSampler() as rss:
            last, i = time.perf_counter(), 0
            while CLOCK.more(len(step_s), steps):
                i += 1
                rp.forward_backward(**data[i % len(data)])
                rp.step()
                now = time.perf_counter()
                step_s.append(now - last)
                last = now
            rp.synchronize()
            drain_s = time.perf_counter() - last
        plan = rp.plan.describe() if rp.plan is not None else None
    timed = [m for _, m in sink.records[warmup:]]
    engine_metrics = {
        key: statistics.median(m[key] for m in timed if key in m)
        for key in sorted({k for m in timed for k in m})
    }
    return {
        **timing(w, step_s, drain_s),
        **gpu_memory(cuda),
        **rss.figures(),
        "warmup_steps": warmup,
        "plan": plan,
        "memory_budget_gib": (config.memory_budget_bytes or 0) / GIB or None,
        "engine_metrics": engine_metrics,
    }


def run_resident(system: str, w: Workload, *, warmup: int, steps: int, cuda: bool) -> dict[str, Any]:
    """The plain loop with everything on one device: fp32 weights, fused AdamW, bf16 autocast on a
    GPU, the batch in ``microbatches`` accumulated micro-batches like the engine's."""
    import torch

    device = torch.device("cuda:0" if cuda else "cpu")
    model = build_model(w, dtype=torch.float32, on=str(device))
    if system == "resident-recompute":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(w)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step(b: dict[str, Any]) -> None:
        for ids, labels in zip(
            b["input_ids"].chunk(w.microbatches), b["labels"].chunk(w.microbatches), strict=True
        ):
            with autocast:
                loss = model(input_ids=ids, labels=labels).loss / w.microbatches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warmup = max(warmup, 2)
    for i in range(warmup):
        step(data[i % len(data)])
    sync()
    step_s: list[float] = []
    with RssSampler() as rss:
        while CLOCK.more(len(step_s), steps):
            t0 = time.perf_counter()
            step(data[len(step_s) % len(data)])
            sync()
            step_s.append(time.perf_counter() - t0)
    return {
        **timing(w, step_s, 0.0),
        **gpu_memory(cuda),
        **rss.figures(),
        "warmup_steps": warmup,
        "recompute": system == "resident-recompute",
    }


def run_roundpipe(system: str, w: Workload, *, warmup: int, steps: int, cuda: bool) -> dict[str, Any]:
    """roundpipe 0.1.1 as its authors' example drives it: a bf16 model wrapped by its sequential
    preset, fp32 optimizer copies, its own (C++) Adam in decoupled-decay mode, its automatic plan."""
    import roundpipe  # type: ignore[import-not-found]
    import torch
    from roundpipe.optim import Adam  # type: ignore[import-not-found]

    model = build_model(w, dtype=torch.bfloat16, on="cuda")
    model.to("cpu")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model,
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=w.microbatches),
        optim_dtype=torch.float32,
    )
    opt = Adam(wrapped.optim_parameters(), lr=1e-5, decoupled_weight_decay=True)
    is_async = system == "roundpipe-async"
    data = batches(w)

    def loss_fn(outputs: Any, labels: Any) -> Any:
        return (
            wrapped.loss_function(logits=outputs.logits, labels=labels, vocab_size=w.vocab) / w.microbatches
        )

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad()

    def step(b: dict[str, Any]) -> None:
        loss = wrapped.forward_backward(
            input_kwargs={"input_ids": b["input_ids"]}, label=b["labels"], loss_fn=loss_fn
        )
        loss.item()  # the engine's forward_backward returns the loss as a number too
        wrapped.step(optimizer_step, is_async=is_async)

    for i in range(warmup):
        step(data[i % len(data)])
    step_s: list[float] = []
    with RssSampler() as rss:
        last = time.perf_counter()
        while CLOCK.more(len(step_s), steps):
            step(data[len(step_s) % len(data)])
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        wrapped.synchronize()
        drain_s = time.perf_counter() - last
    return {
        **timing(w, step_s, drain_s),
        **gpu_memory(cuda),
        **rss.figures(),
        "warmup_steps": warmup,
        "roundpipe": getattr(roundpipe, "__version__", "?"),
    }


def run_ceilings(w: Workload, cuda: bool) -> dict[str, Any]:
    """What the machine can do at best: PCIe each way and both at once, bf16 matmul, CPU AdamW."""
    import torch

    out: dict[str, Any] = {}
    # a bare CPU fused AdamW over flat fp32 parameters, scaled to seconds per 1e9 parameters
    n = 200_000_000 if cuda else 4_000_000
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.full((n,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    opt.step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    out["cpu_fused_adamw_s_per_1e9"] = min(times) * 1e9 / n
    out["cpu_threads"] = torch.get_num_threads()
    del p, opt
    if not cuda:
        out["gpu"] = "skipped: no GPU (--cpu)"
        return out
    size = 1 << 30
    buf = {
        "host": torch.empty(size, dtype=torch.uint8, pin_memory=True),
        "host2": torch.empty(size, dtype=torch.uint8, pin_memory=True),
        "dev": torch.empty(size, dtype=torch.uint8, device="cuda"),
        "dev2": torch.empty(size, dtype=torch.uint8, device="cuda"),
    }
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def gbps(fn: Any, bytes_moved: int) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return bytes_moved / best / 1e9

    def h2d() -> None:
        with torch.cuda.stream(up):
            buf["dev"].copy_(buf["host"], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(down):
            buf["host2"].copy_(buf["dev2"], non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    out["h2d_gbps"] = gbps(h2d, size)
    out["d2h_gbps"] = gbps(d2h, size)
    out["both_ways_gbps"] = gbps(both, 2 * size)
    buf.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = reps * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12
    return out


def child(name: str, args: argparse.Namespace) -> None:
    """Run one system (or the ceilings) and print its figures as one line."""
    global CLOCK
    CLOCK = Clock(args.seconds)
    w = CPU_WORKLOAD if args.cpu else GPU_WORKLOAD
    cuda = not args.cpu
    if name == "ceilings":
        figures = run_ceilings(w, cuda)
    elif name in ENGINE_SYSTEMS:
        figures = run_engine(name, w, warmup=args.warmup, steps=args.steps, cuda=cuda)
    elif name in RESIDENT_SYSTEMS:
        figures = run_resident(name, w, warmup=args.warmup, steps=args.steps, cuda=cuda)
    elif name in PEER_SYSTEMS:
        figures = run_roundpipe(name, w, warmup=args.warmup, steps=args.steps, cuda=cuda)
    else:
        raise SystemExit(f"unknown system {name!r}; known: ceilings, {', '.join(SYSTEMS)}")
    print(RESULT_LINE + json.dumps(figures), flush=True)


# -- the parent: one process per system ------------------------------------------------------------
def machine(cuda: bool) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if cuda and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / GIB, 1)}
    return info


def launch(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One system in a fresh interpreter; its figures, or why there are none."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--seconds", str(timeout)] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ)
    if name in PEER_SYSTEMS:
        # the peer's own packages first (its transformers is older than the engine's)
        env["PYTHONPATH"] = os.pathsep.join([str(args.peer), str(ROOT)])
        env["RPP_DISABLE_TORCH_COMPILE"] = "1"
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    started = time.perf_counter()
    try:
        # the child stops timing at 85% of its share; the rest is for its drain and exit
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"skipped": f"ran past its {timeout:.0f} s share of the budget", "stderr_tail": str(tail)}
    seconds = time.perf_counter() - started
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_LINE):
            figures: dict[str, Any] = json.loads(line[len(RESULT_LINE) :])
            figures["process_s"] = seconds
            return figures
    return {
        "failed": f"exit code {done.returncode}",
        "stderr_tail": done.stderr[-3000:],
        "process_s": seconds,
    }


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """engine/roundpipe and engine/resident, tokens/s both ways, for the rows that ran."""
    out: dict[str, float] = {}

    def tps(name: str, way: str) -> float | None:
        value = rows.get(name, {}).get(f"tokens_per_s_{way}")
        return float(value) if value else None

    pairs = [
        ("engine-async", "roundpipe-async"),
        ("engine-sync", "roundpipe-sync"),
        ("engine-async-24gb", "roundpipe-async"),
        ("engine-sync-24gb", "roundpipe-sync"),
        ("engine-async", "resident-recompute"),
        ("engine-sync", "resident-recompute"),
        ("engine-async", "resident"),
        ("engine-sync", "resident"),
    ]
    for ours, theirs in pairs:
        for way in ("steady", "overall"):
            a, b = tps(ours, way), tps(theirs, way)
            if a and b:
                out[f"{ours}/{theirs} ({way})"] = a / b
    return out


def table(report: dict[str, Any]) -> str:
    lines = [
        "| system | steady step s | drain s | tok/s steady | tok/s overall | GPU peak GiB | RSS max GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["systems"].items():
        if "steady_step_s" not in row:
            why = row.get("skipped") or row.get("failed") or "?"
            lines.append(f"| {name} | {why} | | | | | |")
            continue
        gpu = row.get("gpu_peak_allocated_gib")
        lines.append(
            f"| {name} | {row['steady_step_s']:.3f} | {row['drain_s']:.3f} | {row['tokens_per_s_steady']:.0f}"
            f" | {row['tokens_per_s_overall']:.0f} | {'-' if gpu is None else f'{gpu:.1f}'}"
            f" | {row['rss_max_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny version on CPU workers")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 3 with --cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (at least calibration + 2)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    parser.add_argument("--peer", type=Path, default=None, help="folder with roundpipe 0.1.1 installed")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None, help="a subset")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 3 if args.cpu else 20
    if args.child:
        child(args.child, args)
        return
    deadline = time.monotonic() + args.budget
    out = args.out or RESULTS / ("side_by_side_cpu.json" if args.cpu else "side_by_side.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = CPU_WORKLOAD if args.cpu else GPU_WORKLOAD
    report: dict[str, Any] = {
        "machine": machine(not args.cpu),
        "workload": asdict(w),
        "protocol": {"timed_steps": args.steps, "warmup_at_least": args.warmup, "budget_s": args.budget},
        "ceilings": {},
        "systems": {},
        "ratios": {},
    }

    def save() -> None:
        report["ratios"] = ratios(report["systems"])
        out.write_text(json.dumps(report, indent=2) + "\n")

    report["ceilings"] = launch("ceilings", args, max(deadline - time.monotonic(), 1.0))
    save()
    chosen = args.systems or list(SYSTEMS)
    for i, name in enumerate(chosen):
        if name in PEER_SYSTEMS and args.cpu:
            row: dict[str, Any] = {"skipped": "roundpipe 0.1.1 needs a CUDA device even to import (--cpu)"}
        elif name in PEER_SYSTEMS and args.peer is None:
            row = {"skipped": "no --peer folder with roundpipe 0.1.1 (make gpu-bundle builds one)"}
        else:
            left = deadline - time.monotonic()
            # an even share of what is left, so one slow system cannot starve the rest
            share = left / (len(chosen) - i)
            row = launch(name, args, share) if left > 5 else {"skipped": "no time left in --budget"}
        report["systems"][name] = row
        save()
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))})}")
    print(table(report))
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
