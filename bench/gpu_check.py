"""The GPU check: is the engine right, race-free, lean and fast on this machine's GPUs?

One command (``make gpu-check``) for a machine with NVIDIA GPUs and the project's ``.venv``. It
runs the CUDA tests (``pytest tests/engine/cuda``), then these checks, each reported as PASS,
WARN, FAIL (or SKIP, with the reason) with its figures:

1. ``equivalence``: fp32 sync mode against the plain single-device loop, and async mode against
   the CPU engine, with 1-3 workers on one GPU; bitwise the same weights for any worker count;
2. ``race_injection``: random ``torch.cuda._sleep`` on the copy and compute streams before every
   copy the engine makes (``DeviceLink.upload``, ``download``, ``copy_pieces``, wrapped at run
   time) plus random host jitter: the numbers must stay bitwise those of a run without;
3. ``adamw_clipping``: AdamW with gradient clipping against the plain loop;
4. ``low_precision``: bfloat16 and float16 against float32, and float16's loss-scale backoff
   (a scale far too large overflows, halves, and the steps that went through match float32);
5. ``dropout``: dropout masks equal between forward and recompute (several workers and a split
   plan bitwise equal to one worker with the fused-only plan);
6. ``cancel_close``: cancel and ``close()`` with work in flight: no hang, no thread left, the
   state unchanged by the cancelled iteration, device memory released;
7. ``memory``: device memory after each step (no growth after warm-up), the peak, allocator
   retries, pinned host bytes against the compute copy's bytes, live CUDA tensors after close;
8. ``host_syncs``: host synchronisations during one steady-state step
   (``torch.cuda.set_sync_debug_mode("warn")``);
9. ``throughput``: tokens/s and bubble ratio of a ~150M-parameter bfloat16 Llama on the engine
   against a GPU-resident plain loop (model on the GPU, fused AdamW, bfloat16 autocast).

A watchdog prints every thread's stack when a check runs past its timeout (and the check FAILs);
the last lines printed are the summary table; the exit code is 1 when a check FAILed. The
figures, the machine and the versions go to ``--out`` (a JSON file).

``--cpu`` runs the same checks on CPU workers with small sizes (under a minute on two cores):
what needs a GPU (the CUDA tests, CUDA sleeps, allocator statistics, the sync debug mode, the
GPU-resident baseline) is skipped with the reason. The test suite runs this mode, so the script
cannot rot without a GPU.

    python bench/gpu_check.py [--cpu] [--quick] [--out PATH] [--timeout S] [--max-syncs N]
                              [--only CHECK ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import functools
import gc
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `tests.engine.tiny` and `engine` from this checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# cuBLAS picks its algorithms per stream unless its workspace is fixed: set, two identical runs
# with several streams give the same bits, so a bitwise difference means a race, not cuBLAS
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from engine import Cancelled, EngineConfig, EngineError, RoundPipe  # noqa: E402
from engine.metrics import ListSink  # noqa: E402
from tests.engine.tiny import (  # noqa: E402
    SPLIT_PLAN,
    bitwise_equal,
    engine_loop,
    max_diff,
    plain_loop,
    tiny_batch,
    tiny_model,
)

RESULTS = ROOT / "bench" / "results"
CHECKS = (
    "cuda_tests",
    "equivalence",
    "race_injection",
    "adamw_clipping",
    "low_precision",
    "dropout",
    "cancel_close",
    "memory",
    "host_syncs",
    "throughput",
)
ORDER = {"FAIL": 3, "WARN": 2, "PASS": 1, "SKIP": 0}
FUSED_ONLY = {"forward": [], "fused": 5, "backward": []}  # the tiny models' 5 layers in one stage
# Tolerances. fp32 on CPU: the engine's contract (tests/engine/test_equivalence.py). On a GPU the
# engine and the plain loop run the same kernels on different shapes (micro-batches, stage by
# stage), so float rounding differs: the CUDA tests' 1e-4.
SGD_TOL = {"cpu": 1e-5, "cuda": 1e-4}
# AdamW turns the rounding of near-zero gradients into steps of up to 2 lr: the engine is held
# to the plain loop's own whole-batch vs split distance plus this (tests/engine/test_equivalence)
ADAMW_SPLIT_TOL = {"cpu": 1e-5, "cuda": 1e-4}
# Low precision against fp32 after 4 SGD steps at lr 0.1 (the fp32 masters are kept, only the
# compute copy and the activations are rounded): the loss (relative) and the weights (absolute,
# entries of order 0.02 to 1) may move by at most one unit of the format's relative precision,
# 2^-8 for bfloat16 (8 significant bits), 2^-11 for float16 (11). The errors of single roundings
# average out over the tokens: measured on CPU, bfloat16 1.2e-5 (loss) and 8.2e-5 (weights),
# float16 3.3e-6 and 1.2e-5, some 50x inside; a wrong scale or a stale copy is far outside.
LOW_PRECISION_TOL = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
# float16 backoff: the logits' gradient is (softmax - one-hot) x scale / label tokens, about
# 2^24 / 90 = 1.9e5 for the first tiny batches: past float16's 65504, so the first step overflows
HUGE_LOSS_SCALE = 2.0**24
MAX_SLEEP_CYCLES_LOG10 = 6.7  # injected GPU sleeps: 1e3 to 5e6 cycles (about 0.5 us to 3 ms)
HOST_JITTER_S = 2e-4
# Pinned host memory against the compute copy (bf16), between steps. The host allocator rounds
# every block up to a power of two, so the compute copy alone may take up to 2x its bytes:
# pinned bytes in use beyond that outlive the step. Its pool also caches the blocks of a step's
# downloads (the fp32 gradients alone are 2x a bf16 copy): beyond 4x it holds more than that.
PINNED_ACTIVE_OVER_COMPUTE_WARN = 2.0
PINNED_POOL_OVER_COMPUTE_WARN = 4.0


# -- results ---------------------------------------------------------------------------------------
@dataclass
class Result:
    """One check's verdict: PASS, WARN, FAIL or SKIP, a one-line message and its figures."""

    status: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the whole process (every thread) during the check


@dataclass
class Context:
    """What every check knows: where it runs and what earlier checks found.

    Attributes:
        cuda: GPU mode (False: ``--cpu``).
        device: the device the workers run on (``"cuda:0"`` or ``"cpu"``).
        quick: smaller sizes and fewer steps.
        max_syncs: host synchronisations allowed per step before ``host_syncs`` WARNs (None:
            the number of micro-batches, one loss read each).
        deterministic: two identical engine runs gave the same bits (set by ``race_injection``;
            None until then). When False, later bitwise checks WARN on tiny differences.
    """

    cuda: bool
    device: str
    quick: bool
    max_syncs: int | None = None
    deterministic: bool | None = None

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def devices(self, n: int) -> list[str]:
        return [self.device] * n


def worst(*statuses: str) -> str:
    return max(statuses, key=lambda s: ORDER[s])


def plain(x: Any) -> Any:
    """Figures as JSON can hold them (no inf or NaN, no tensors)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return plain(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


# -- helpers ---------------------------------------------------------------------------------------
def tiny_batches(n: int = 3, batch: int = 11) -> list[dict[str, torch.Tensor]]:
    # 11 sequences: no micro-batch count used here divides it evenly
    return [tiny_batch(batch=batch, seed=s) for s in range(1, n + 1)]


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in state.items()}


def plain_on(
    ctx: Context, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], make_opt: Any, **kw: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop of ``tests.engine.tiny`` on the check's device (model and batches moved)."""
    moved = copy.deepcopy(model).to(ctx.device)
    dev_batches = [{k: v.to(ctx.device) for k, v in b.items()} for b in batches]
    losses, state = plain_loop(moved, dev_batches, make_opt, **kw)
    return losses, on_cpu(state)


def loss_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def same_bits(
    a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]]
) -> bool:
    return a[0] == b[0] and bitwise_equal(a[1], b[1])


def tf32_flags() -> dict[str, Any]:
    return {
        "matmul_fp32_precision": getattr(torch.backends.cuda.matmul, "fp32_precision", None),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def roundpipe_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("roundpipe-"))


def live_tensors(device_type: str | None = None) -> tuple[int, int]:
    """Tensors Python can still reach (after a collection): how many, and their storages' bytes."""
    gc.collect()
    count, total, seen = 0, 0, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch objects warns
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "meta":
                continue
            if device_type is not None and obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
        except Exception:
            continue
        count += 1
        key = (obj.device.type, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return count, total


def small_llama(hidden: int, layers: int, vocab: int, inter: int, heads: int, kv: int, seq: int) -> Any:
    """A randomly initialised Llama built from a config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.train()
    return model


def token_batches(vocab: int, batch: int, seq: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def device_sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


# -- copy hooks ------------------------------------------------------------------------------------
COPY_ENTRY_POINTS = ("upload", "download", "copy_pieces")


def _streams(name: str, link: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The streams a copy runs on and waits for: its copy stream and the compute stream."""
    compute = getattr(link, "compute", None)
    if name == "upload":
        return [getattr(link, "act_up", None), compute]
    if name == "download":
        stream = args[1] if len(args) > 1 else kwargs.get("stream")
        return [stream or getattr(link, "act_down", None), compute]
    return [getattr(link, "param_up", None), compute]


@contextlib.contextmanager
def copy_hook(hook: Callable[[str, Any, list[Any]], None]) -> Iterator[None]:
    """Call ``hook(kind, link, streams)`` before every copy the engine queues.

    Wraps ``DeviceLink.upload``, ``download`` and ``copy_pieces`` of
    ``engine.parallel.transfer`` for the duration (the engine itself is not edited).

    Raises:
        RuntimeError: an entry point no longer exists (this script needs updating).
    """
    from engine.parallel import transfer

    link_cls = transfer.DeviceLink
    missing = [n for n in COPY_ENTRY_POINTS if not callable(getattr(link_cls, n, None))]
    if missing:
        raise RuntimeError(f"engine.parallel.transfer.DeviceLink has no {missing}: update bench/gpu_check.py")
    originals = {n: link_cls.__dict__[n] for n in COPY_ENTRY_POINTS}

    def wrap(name: str) -> Callable[..., Any]:
        original = originals[name]

        @functools.wraps(original)
        def wrapper(link: Any, *args: Any, **kwargs: Any) -> Any:
            hook(name, link, _streams(name, link, args, kwargs))
            return original(link, *args, **kwargs)

        return wrapper

    for name in COPY_ENTRY_POINTS:
        setattr(link_cls, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(link_cls, name, original)


class RaceInjector:
    """A copy hook that delays a random choice of streams by a random number of GPU cycles
    (``torch.cuda._sleep``, log-uniform) and the calling thread by a random few microseconds.

    A copy stream delayed exposes a consumer that does not wait for the copy; the compute stream
    delayed exposes a copy that does not wait for what it copies; the host jitter shuffles the
    order in which the worker and optimizer threads meet.
    """

    def __init__(self, seed: int, *, gpu_sleeps: bool) -> None:
        self.rng = random.Random(seed)
        self.gpu_sleeps = gpu_sleeps
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.sleeps = 0
        self.cycles = 0
        self.jitter_s = 0.0

    def __call__(self, kind: str, link: Any, streams: list[Any]) -> None:
        cuda = bool(getattr(link, "is_cuda", False)) and self.gpu_sleeps
        with self.lock:
            self.calls[kind] += 1
            draws = [
                (s, int(10 ** self.rng.uniform(3, MAX_SLEEP_CYCLES_LOG10)))
                for s in streams
                if cuda and s is not None and self.rng.random() < 0.5
            ]
            jitter = self.rng.uniform(0, HOST_JITTER_S) if self.rng.random() < 0.5 else 0.0
            self.sleeps += len(draws)
            self.cycles += sum(c for _, c in draws)
            self.jitter_s += jitter
        for stream, cycles in draws:
            with torch.cuda.device(link.device), torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
        if jitter:
            time.sleep(jitter)

    def figures(self) -> dict[str, Any]:
        return {
            "copies": dict(self.calls),
            "gpu_sleeps": self.sleeps,
            "gpu_sleep_cycles": self.cycles,
            "host_jitter_s": round(self.jitter_s, 4),
        }


class UploadTrigger:
    """A copy hook that, at the ``after``-th upload once armed, sets ``event`` and holds the
    uploading worker for ``hold_s`` (so the iteration is certainly still in flight)."""

    def __init__(self, event: threading.Event, after: int, hold_s: float = 0.0) -> None:
        self.event = event
        self.after = after
        self.hold_s = hold_s
        self.armed = False
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self, kind: str, link: Any, streams: list[Any]) -> None:
        if kind != "upload":
            return
        with self.lock:
            if not self.armed:
                return
            self.count += 1
            fire = self.count == self.after
        if fire:
            self.event.set()
            if self.hold_s:
                time.sleep(self.hold_s)


# -- the checks ------------------------------------------------------------------------------------
def check_cuda_tests(ctx: Context, timeout: float) -> Result:
    """``pytest tests/engine/cuda`` in a child process; a hung test dumps its stacks."""
    if not ctx.cuda:
        return Result("SKIP", "no GPU (--cpu): the CUDA tests skip themselves without CUDA")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/engine/cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=120",
    ]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out[-6000:], flush=True)
        return Result("FAIL", f"pytest tests/engine/cuda still running after {timeout:.0f} s", {"cmd": cmd})
    out = res.stdout + res.stderr
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", out)}
    figures = {"returncode": res.returncode, "counts": counts, "seconds": time.perf_counter() - t0}
    if res.returncode != 0:
        print(out[-6000:], flush=True)
        return Result("FAIL", f"pytest exit {res.returncode}: {counts}", figures)
    if counts.get("passed", 0) == 0:
        return Result("FAIL", f"no CUDA test ran: {counts}", figures)
    if counts.get("skipped", 0):
        return Result("WARN", f"{counts.get('skipped')} CUDA tests skipped: {counts}", figures)
    return Result("PASS", f"{counts.get('passed')} passed", figures)


def check_equivalence(ctx: Context) -> Result:
    """fp32 sync against the plain loop and async against the CPU engine, 1-3 workers."""
    tol = SGD_TOL[ctx.kind]
    figures: dict[str, Any] = {"tolerance": tol}
    problems: list[str] = []
    model = tiny_model("llama")
    batches = tiny_batches()
    ref_losses, ref_state = plain_on(ctx, model, batches, sgd)
    runs = {}
    for n in (1, 2, 3):
        config = EngineConfig(
            tf32=False,
            devices=ctx.devices(n),
            num_microbatches=4,
            optimizer="sgd",
            lr=0.1,
            partition=SPLIT_PLAN,
        )
        losses, state, _ = engine_loop(model, batches, config)
        runs[n] = (losses, state)
        figures[f"sync_{n}w_loss_diff"] = loss_gap(losses, ref_losses)
        figures[f"sync_{n}w_weight_diff"] = max_diff(state, ref_state)
        if figures[f"sync_{n}w_loss_diff"] >= tol or figures[f"sync_{n}w_weight_diff"] >= tol:
            problems.append(f"sync with {n} workers differs from the plain loop")
    figures["sync_bitwise_for_1_2_3_workers"] = all(same_bits(runs[n], runs[1]) for n in (2, 3))
    if not figures["sync_bitwise_for_1_2_3_workers"]:
        problems.append("sync results differ between worker counts")
    # async: the same staleness-1 run on CPU workers is the reference
    model = tiny_model("qwen2")
    batches = tiny_batches(5)

    def async_config(devices: list[str]) -> EngineConfig:
        return EngineConfig(
            tf32=False,
            devices=devices,
            num_microbatches=4,
            optimizer="sgd",
            lr=0.1,
            async_optimizer=True,
            partition=SPLIT_PLAN,
        )

    cpu_losses, cpu_state, _ = engine_loop(model, batches, async_config(["cpu"]))
    for n in (1, 2, 3):
        losses, state, _ = engine_loop(model, batches, async_config(ctx.devices(n)))
        figures[f"async_{n}w_loss_diff"] = loss_gap(losses, cpu_losses)
        figures[f"async_{n}w_weight_diff"] = max_diff(state, cpu_state)
        if figures[f"async_{n}w_loss_diff"] >= tol or figures[f"async_{n}w_weight_diff"] >= tol:
            problems.append(f"async with {n} workers differs from the CPU engine")
    _, sync_plain = plain_on(ctx, model, batches, sgd)
    figures["async_vs_sync_weight_diff"] = max_diff(cpu_state, sync_plain)  # async is really async
    if ctx.cuda:
        figures["tf32"] = tf32_flags()
    worst_diff = max(v for k, v in figures.items() if re.fullmatch(r"a?sync_\dw_\w+_diff", k))
    if figures["async_vs_sync_weight_diff"] <= tol:
        problems.append("async gave the sync result (no staleness)")
    if problems:
        tf32 = " (TF32 is on)" if ctx.cuda and figures["tf32"]["matmul_allow_tf32"] else ""
        return Result("FAIL", "; ".join(problems) + tf32, figures)
    return Result("PASS", f"max diff {worst_diff:.2e} < {tol:g}; bitwise for 1-3 workers", figures)


def check_race_injection(ctx: Context) -> Result:
    """Random stream delays before every copy must not change a single bit."""
    figures: dict[str, Any] = {"gpu_sleeps": ctx.cuda}
    model = tiny_model("llama")
    batches = tiny_batches(3 if ctx.quick else 4)
    configs = {
        "sync_fp32_adamw": EngineConfig(
            tf32=False,
            devices=ctx.devices(3),
            num_microbatches=6,
            optimizer="adamw",
            lr=1e-2,
            partition=SPLIT_PLAN,
        ),
        "async_bf16_sgd": EngineConfig(
            tf32=False,
            devices=ctx.devices(3),
            num_microbatches=5,
            optimizer="sgd",
            lr=0.1,
            async_optimizer=True,
            compute_dtype="bfloat16",
            partition=SPLIT_PLAN,
        ),
    }
    if ctx.quick:
        configs.pop("async_bf16_sgd")
    status, notes = "PASS", []
    deterministic = True
    for i, (name, config) in enumerate(configs.items()):
        a = engine_loop(model, batches, config)[:2]
        b = engine_loop(model, batches, config)[:2]
        injector = RaceInjector(seed=1234 + i, gpu_sleeps=ctx.cuda)
        with copy_hook(injector):
            c = engine_loop(model, batches, config)[:2]
        rerun_diff = max(loss_gap(a[0], b[0]), max_diff(a[1], b[1]))
        injected_diff = max(loss_gap(a[0], c[0]), max_diff(a[1], c[1]))
        figures[name] = {
            "rerun_bitwise": same_bits(a, b),
            "rerun_max_diff": rerun_diff,
            "injected_bitwise": same_bits(a, c),
            "injected_max_diff": injected_diff,
            **injector.figures(),
        }
        if sum(injector.calls.values()) == 0:
            status = worst(status, "FAIL")
            notes.append(f"{name}: the hook saw no copy (the engine copies elsewhere now)")
        elif same_bits(a, b):
            if not same_bits(a, c):
                status = worst(status, "FAIL")
                notes.append(f"{name}: injected delays changed the numbers (max diff {injected_diff:.2e})")
        else:
            deterministic = False
            status = worst(status, "WARN")
            notes.append(f"{name}: two identical runs differ ({rerun_diff:.2e}): non-deterministic kernels")
            if injected_diff > max(10 * rerun_diff, 1e-6):
                status = worst(status, "FAIL")
                notes.append(f"{name}: injected delays moved the numbers by {injected_diff:.2e}")
    ctx.deterministic = deterministic
    if not notes:
        total = sum(sum(v["copies"].values()) for v in figures.values() if isinstance(v, dict))
        what = "GPU sleeps and host jitter" if ctx.cuda else "host jitter only (no GPU)"
        notes.append(f"bitwise equal with {what} on {total} copies")
    return Result(status, "; ".join(notes), figures)


def check_adamw_clipping(ctx: Context) -> Result:
    """AdamW with gradient clipping against ``torch.optim.AdamW`` in the plain loop."""
    model = tiny_model("llama")
    batches = tiny_batches()

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    ref_losses, ref_state = plain_on(ctx, model, batches, adamw, max_grad_norm=0.5)
    _, split_state = plain_on(ctx, model, batches, adamw, max_grad_norm=0.5, microbatches=4)
    config = EngineConfig(
        tf32=False,
        devices=ctx.devices(3),
        num_microbatches=4,
        optimizer="adamw",
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        max_grad_norm=0.5,
        partition=SPLIT_PLAN,
    )
    sink = ListSink()
    losses, state, _ = engine_loop(model, batches, config, sink=sink)
    tol = ADAMW_SPLIT_TOL[ctx.kind]
    rounding = max_diff(split_state, ref_state)  # the plain loop's own whole-batch vs split distance
    figures: dict[str, Any] = {
        "loss_diff": loss_gap(losses, ref_losses),
        "weight_diff_vs_whole_batch": max_diff(state, ref_state),
        "weight_diff_vs_same_split": max_diff(state, split_state),
        "plain_whole_vs_split": rounding,
        "tolerance": tol,
        "grad_norms": sink.series("optim/grad_norm"),
        "clip": 0.5,
    }
    if ctx.cuda:
        figures["tf32"] = tf32_flags()
    ok = (
        figures["loss_diff"] < tol
        and figures["weight_diff_vs_same_split"] < tol
        and figures["weight_diff_vs_whole_batch"] < rounding + tol
    )
    clipped = any(g > 0.5 for g in figures["grad_norms"])
    if not ok:
        return Result(
            "FAIL", f"engine vs plain AdamW: {figures['weight_diff_vs_same_split']:.2e} >= {tol:g}", figures
        )
    if not clipped:
        return Result("WARN", "no gradient norm exceeded the clip: clipping not exercised", figures)
    return Result(
        "PASS",
        f"vs same split {figures['weight_diff_vs_same_split']:.2e}, loss {figures['loss_diff']:.2e} "
        f"(< {tol:g}); clipped {sum(g > 0.5 for g in figures['grad_norms'])} of {len(batches)} steps",
        figures,
    )


def check_low_precision(ctx: Context) -> Result:
    """bfloat16 and float16 against float32, and float16's loss-scale backoff."""
    model = tiny_model("llama")
    batches = tiny_batches(4)

    def config(dtype: str, **kw: Any) -> EngineConfig:
        return EngineConfig(
            tf32=False,
            devices=ctx.devices(2),
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            compute_dtype=dtype,
            **kw,
        )

    l32, s32, _ = engine_loop(model, batches, config("float32"))
    figures: dict[str, Any] = {"tolerance": LOW_PRECISION_TOL}
    status, notes = "PASS", []
    for dtype, tol in LOW_PRECISION_TOL.items():
        losses, state, _ = engine_loop(model, batches, config(dtype))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, l32, strict=True))
        diff = max_diff(state, s32)
        figures[dtype] = {"loss_rel_diff": rel, "weight_diff": diff}
        if not (rel < tol and diff < tol) or diff == 0:
            status = worst(status, "FAIL")
            notes.append(f"{dtype}: loss {rel:.2e}, weights {diff:.2e} (tolerance {tol:g})")
        else:
            notes.append(f"{dtype} {max(rel, diff):.1e} (< {tol:.1e})")
    # float16 with a loss scale far too large: the first steps overflow, are skipped, the scale
    # halves each time; the steps that went through are the fp32 run on those batches
    long = tiny_batches(6 if ctx.quick else 8)
    sink = ListSink()
    _, s16, _ = engine_loop(model, long, config("float16", initial_loss_scale=HUGE_LOSS_SCALE), sink=sink)
    skipped = [bool(v) for v in sink.series("optim/skipped")]
    scales = sink.series("optim/loss_scale")
    kept = [b for b, s in zip(long, skipped, strict=True) if not s]
    backoff: dict[str, Any] = {"initial_scale": HUGE_LOSS_SCALE, "skipped": skipped, "scales": scales}
    figures["float16_backoff"] = backoff
    rule = all(
        scales[i] == (scales[i - 1] / 2 if skipped[i] else scales[i - 1]) for i in range(1, len(scales))
    ) and scales[0] == (HUGE_LOSS_SCALE / 2 if skipped[0] else HUGE_LOSS_SCALE)
    backoff["halving_rule_held"] = rule
    if not skipped[0] or not rule:
        status = worst(status, "FAIL")
        notes.append(f"float16 backoff: skipped {skipped}, scales {scales}")
    elif not kept:
        status = worst(status, "WARN")
        notes.append(f"float16 backoff: every step overflowed ({len(long)})")
    else:
        _, ref, _ = engine_loop(model, kept, config("float32"))
        diff = max_diff(s16, ref)
        backoff["weight_diff_vs_fp32_on_kept_steps"] = diff
        if diff >= LOW_PRECISION_TOL["float16"]:
            status = worst(status, "FAIL")
            notes.append(f"float16 after backoff differs from fp32 on the kept steps by {diff:.2e}")
        else:
            notes.append(f"backoff {sum(skipped)} skips to scale {scales[-1]:g}, then {diff:.1e}")
    return Result(status, "; ".join(notes), figures)


def check_dropout(ctx: Context) -> Result:
    """Dropout masks of the recompute equal the forward's: every plan gives the same bits."""
    model = tiny_model("llama", attention_dropout=0.2)
    batches = tiny_batches()
    runs = {}
    for name, workers, plan in (
        ("1w_fused_only", 1, FUSED_ONLY),
        ("1w_split", 1, SPLIT_PLAN),
        ("2w_split", 2, SPLIT_PLAN),
        ("3w_split", 3, SPLIT_PLAN),
    ):
        config = EngineConfig(
            tf32=False,
            devices=ctx.devices(workers),
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            partition=plan,
        )
        runs[name] = engine_loop(model, batches, config)[:2]
    base = runs["1w_fused_only"]
    figures: dict[str, Any] = {}
    for name, run in runs.items():
        figures[f"{name}_bitwise"] = same_bits(run, base)
        figures[f"{name}_max_diff"] = max(loss_gap(run[0], base[0]), max_diff(run[1], base[1]))
    no_dropout = engine_loop(
        tiny_model("llama"),
        batches,
        EngineConfig(tf32=False, devices=ctx.devices(1), num_microbatches=3, optimizer="sgd", lr=0.1),
    )
    figures["vs_no_dropout_diff"] = max_diff(no_dropout[1], base[1])
    worst_diff = max(v for k, v in figures.items() if k.endswith("_max_diff"))
    if figures["vs_no_dropout_diff"] <= 1e-6:
        return Result("FAIL", "dropout had no effect: the check tested nothing", figures)
    if all(figures[f"{n}_bitwise"] for n in runs):
        return Result("PASS", "fused-only, 1, 2 and 3 workers bitwise equal (dropout 0.2)", figures)
    if ctx.deterministic is False and worst_diff < 1e-5:
        return Result("WARN", f"not bitwise ({worst_diff:.1e}), as two identical runs are not", figures)
    return Result("FAIL", f"recompute drew other masks: max diff {worst_diff:.2e}", figures)


def check_cancel_close(ctx: Context, timeout: float) -> Result:
    """Cancel mid-iteration and ``close()`` with work in flight: no hang, no leak, same state."""
    figures: dict[str, Any] = {}
    status, notes = "PASS", []
    threads_before = {t.ident for t in threading.enumerate()}
    model = tiny_model("mistral")
    batches = tiny_batches(3)
    config = EngineConfig(
        tf32=False, devices=ctx.devices(3), num_microbatches=6, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    # (a) cancel, fired by the 4th upload of the second iteration
    cancel = threading.Event()
    trigger = UploadTrigger(cancel, after=4)
    with copy_hook(trigger):
        rp = RoundPipe(copy.deepcopy(model), config, cancel=cancel)
        try:
            rp.forward_backward(**batches[0])
            rp.step()
            saved = rp.master_state_dict()
            trigger.armed = True
            t0 = time.perf_counter()
            try:
                rp.forward_backward(**batches[1])
                raised = "nothing"
            except Cancelled:
                raised = "Cancelled"
            figures["cancel_raised"] = raised
            figures["cancel_to_raise_s"] = time.perf_counter() - t0
            trigger.armed = False
            rp.synchronize()
            figures["state_unchanged_by_cancelled_iteration"] = bitwise_equal(rp.master_state_dict(), saved)
            cancel.clear()
            rp.forward_backward(**batches[2])
            rp.step()
            resumed = rp.master_state_dict()
        finally:
            rp.close()
    clean = engine_loop(model, [batches[0], batches[2]], config)[1]
    figures["resumed_equals_clean_run"] = bitwise_equal(resumed, clean)
    figures["resumed_max_diff"] = max_diff(resumed, clean)
    if raised != "Cancelled":
        status = worst(status, "WARN")
        notes.append("the cancel came too late to interrupt the iteration")
    if not figures["state_unchanged_by_cancelled_iteration"]:
        status = worst(status, "FAIL")
        notes.append("the cancelled iteration changed the weights")
    if not figures["resumed_equals_clean_run"]:
        bad = not (ctx.deterministic is False and figures["resumed_max_diff"] < SGD_TOL[ctx.kind])
        status = worst(status, "FAIL" if bad else "WARN")
        notes.append(
            f"after the cancel, training differs from a clean run by {figures['resumed_max_diff']:.2e}"
        )
    # (b) close() while an async iteration is in flight, from another thread
    device_before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    tensors_before = live_tensors("cuda" if ctx.cuda else None)
    in_flight = threading.Event()
    trigger = UploadTrigger(in_flight, after=5, hold_s=0.2)
    outcome: dict[str, str] = {}
    async_config = EngineConfig(
        tf32=False,
        devices=ctx.devices(3),
        num_microbatches=6,
        optimizer="sgd",
        lr=0.1,
        async_optimizer=True,
        partition=SPLIT_PLAN,
    )
    with copy_hook(trigger):
        rp = RoundPipe(copy.deepcopy(model), async_config)
        rp.forward_backward(**batches[0])
        rp.step()

        def train(engine: RoundPipe = rp) -> None:
            try:
                for b in batches[1:]:
                    engine.forward_backward(**b)
                    engine.step()
                outcome["train"] = "finished"
            except (EngineError, RuntimeError) as exc:
                outcome["train"] = type(exc).__name__
            except BaseException as exc:
                outcome["train"] = f"unexpected {type(exc).__name__}: {exc}"

        trigger.armed = True
        trainer = threading.Thread(target=train, name="gpu-check-trainer", daemon=True)
        trainer.start()
        figures["work_in_flight_seen"] = in_flight.wait(timeout=timeout / 4)
        t0 = time.perf_counter()
        rp.close()
        figures["close_s"] = time.perf_counter() - t0
        trainer.join(timeout=timeout / 4)
    figures["trainer_after_close"] = outcome.get("train", "still running (hung)")
    if not figures["work_in_flight_seen"]:
        status = worst(status, "WARN")
        notes.append("no upload seen in the second iteration: close() may have found nothing in flight")
    if trainer.is_alive():
        status = worst(status, "FAIL")
        notes.append("forward_backward did not return after close()")
    del rp, trainer, train  # the engine, and its memory, must now be unreachable
    left = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    figures["threads_left"] = [t.name for t in left]
    if left:
        status = worst(status, "FAIL")
        notes.append(f"threads left after close: {figures['threads_left']}")
    tensors_after = live_tensors("cuda" if ctx.cuda else None)
    figures["live_tensors_before_after"] = [tensors_before[0], tensors_after[0]]
    if ctx.cuda:
        figures["device_bytes_before_after"] = [device_before, torch.cuda.memory_allocated(ctx.device)]
        if figures["device_bytes_before_after"][1] > device_before:
            status = worst(status, "FAIL")
            notes.append(f"device memory not released: {figures['device_bytes_before_after']}")
    if tensors_after[0] > tensors_before[0]:
        status = worst(status, "FAIL")
        notes.append(f"tensors left after close: {tensors_before[0]} -> {tensors_after[0]}")
    if not notes:
        notes.append(
            f"cancel raised in {figures['cancel_to_raise_s']:.2f} s, state kept; close() in flight "
            f"{figures['close_s']:.2f} s, nothing left"
        )
    return Result(status, "; ".join(notes), figures)


def check_memory(ctx: Context) -> Result:
    """Device memory per step, peak, allocator retries, pinned vs compute bytes, leftovers."""
    figures: dict[str, Any] = {}
    status, notes = "PASS", []
    if ctx.cuda:
        size = dict(hidden=512, layers=4, vocab=8192, inter=1376, heads=8, kv=4, seq=256)
        batch, workers = 8, 2
    else:
        size = dict(hidden=64, layers=2, vocab=256, inter=128, heads=4, kv=2, seq=32)
        batch, workers = 8, 2
    # warm-up: the 2 calibration steps and the re-plan after them
    steps, warmup = (5, 3) if ctx.quick or not ctx.cuda else (8, 3)
    model = small_llama(**size)
    batches = token_batches(size["vocab"], batch, size["seq"], steps)
    config = EngineConfig(
        tf32=False, devices=ctx.devices(workers), num_microbatches=4, compute_dtype="bfloat16", lr=1e-4
    )
    if ctx.cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        retries_before = torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0)
        device_before = torch.cuda.memory_allocated(ctx.device)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        figures["host_active_bytes_before"] = stats.get("active_bytes.current", 0)
    tensors_before = live_tensors("cuda" if ctx.cuda else None)
    per_step: list[int] = []
    rp = RoundPipe(model, config)
    try:
        for b in batches:
            rp.forward_backward(**b)
            rp.step()
            rp.synchronize()
            per_step.append(torch.cuda.memory_allocated(ctx.device) if ctx.cuda else live_tensors()[1])
        compute_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        figures["model_compute_bytes"] = compute_bytes
        host = getattr(rp, "host", None)
        host_tensors = getattr(host, "tensors", None)
        if host_tensors is None:
            status = worst(status, "WARN")
            notes.append("the engine exposes no host tensors: pinned bytes unknown")
        else:
            buffers = [
                b for t in host_tensors for b in (t.compute, getattr(t, "compute_alt", None)) if b is not None
            ]
            figures["engine_host_compute_bytes"] = sum(b.numel() * b.element_size() for b in buffers)
            figures["engine_pinned_bytes"] = sum(
                b.numel() * b.element_size() for b in buffers if b.is_pinned()
            )
            # what the engine pinned, as whole blocks (one per dtype): must equal the copies' bytes
            figures["engine_pinned_block_bytes"] = getattr(host, "pinned_bytes", None)
        if ctx.cuda:
            stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            figures["host_pool_bytes"] = stats.get("allocated_bytes.current")
            figures["host_active_bytes"] = stats.get("active_bytes.current")
    finally:
        rp.close()
    name = "device_bytes_per_step" if ctx.cuda else "live_tensor_bytes_per_step"
    figures[name] = per_step
    growth = max(per_step[warmup:]) - per_step[warmup - 1]
    figures["growth_after_warmup_bytes"] = growth
    if growth > 1 << 20:
        status = worst(status, "FAIL")
        notes.append(f"memory grows after warm-up: +{growth} bytes")
    elif growth > 0:
        status = worst(status, "WARN")
        notes.append(f"memory grows slightly after warm-up: +{growth} bytes")
    if ctx.cuda:
        figures["peak_device_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        figures["peak_over_compute_copy"] = figures["peak_device_bytes"] / figures["model_compute_bytes"]
        retries = torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0) - retries_before
        figures["alloc_retries"] = retries
        if retries:
            status = worst(status, "WARN")
            notes.append(f"{retries} allocator retries (cudaMalloc failed and the cache was flushed)")
        pinned, host_compute = figures.get("engine_pinned_bytes"), figures.get("engine_host_compute_bytes")
        if pinned is not None and host_compute and pinned < host_compute:
            status = worst(status, "WARN")
            notes.append(f"only {pinned} of {host_compute} compute-copy bytes pinned (pageable copies block)")
        pool = figures.get("host_pool_bytes")
        if pool is None:
            status = worst(status, "WARN")
            notes.append("no host allocator statistics in this torch: pinned pool unknown")
        elif host_compute:
            # pinned bytes this engine holds between steps (earlier checks' blocks not counted)
            active = (figures.get("host_active_bytes") or 0) - figures["host_active_bytes_before"]
            figures["pinned_active_over_compute"] = active / host_compute
            figures["pinned_pool_over_compute"] = pool / host_compute
            if active > PINNED_ACTIVE_OVER_COMPUTE_WARN * host_compute:
                status = worst(status, "WARN")
                notes.append(
                    f"pinned bytes in use between steps {active / host_compute:.1f}x the compute copy"
                )
            if pool > PINNED_POOL_OVER_COMPUTE_WARN * host_compute:
                status = worst(status, "WARN")
                notes.append(f"pinned pool {pool / host_compute:.1f}x the compute copy")
    else:
        figures["skipped"] = "peak, allocator retries, pinned pool: CUDA allocator statistics (no GPU)"
    del rp, model
    tensors_after = live_tensors("cuda" if ctx.cuda else None)  # CUDA tensors only, in GPU mode
    figures["live_tensors_before_after_close"] = [tensors_before[0], tensors_after[0]]
    if tensors_after[0] > tensors_before[0]:
        status = worst(status, "FAIL")
        notes.append(f"tensors left after close: {tensors_before[0]} -> {tensors_after[0]}")
    if ctx.cuda:
        figures["device_bytes_after_close"] = torch.cuda.memory_allocated(ctx.device) - device_before
    if ctx.cuda and figures["device_bytes_after_close"] > 0:
        status = worst(status, "FAIL")
        notes.append(f"{figures['device_bytes_after_close']} device bytes still allocated after close()")
    if not notes:
        extra = ""
        if ctx.cuda:
            extra = (
                f", peak {figures['peak_device_bytes'] / 2**20:.0f} MiB, 0 retries, pinned in use "
                f"{figures.get('pinned_active_over_compute', float('nan')):.2f}x the compute copy"
            )
        notes.append(f"no growth over {steps} steps after {warmup} warm-up{extra}; nothing left after close")
    return Result(status, "; ".join(notes), figures)


def check_host_syncs(ctx: Context) -> Result:
    """Host synchronisations in one steady-state step, counted by the CUDA sync debug mode."""
    if not ctx.cuda:
        return Result("SKIP", "no GPU (--cpu): torch.cuda.set_sync_debug_mode needs CUDA")
    microbatches = 4
    threshold = ctx.max_syncs if ctx.max_syncs is not None else microbatches
    batches = tiny_batches(6)
    config = EngineConfig(
        tf32=False, devices=ctx.devices(2), num_microbatches=microbatches, optimizer="sgd", lr=0.1
    )
    caught: list[warnings.WarningMessage] = []
    with RoundPipe(tiny_model("llama"), config) as rp:
        for b in batches[:5]:  # past the calibration steps and the re-plan
            rp.forward_backward(**b)
            rp.step()
        rp.synchronize()
        # warnings.catch_warnings swaps the module's hooks: worker threads' warnings land here too
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rp.forward_backward(**batches[5])
                rp.step()
                rp.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = Counter(
        f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:80]}" for w in syncs
    )
    figures = {
        "syncs_per_step": len(syncs),
        "threshold": threshold,
        "microbatches": microbatches,
        "by_location": dict(where.most_common()),
    }
    message = f"{len(syncs)} host syncs in one step (threshold {threshold})"
    return Result("WARN" if len(syncs) > threshold else "PASS", message, figures)


def check_throughput(ctx: Context) -> Result:
    """Tokens/s and bubble ratio of the engine against a GPU-resident plain loop."""
    if ctx.cuda:
        # ~150M parameters: 16 blocks x 768 hidden (6.3M each) + 2 x 32000 x 768 embeddings/head
        size = dict(hidden=768, layers=16, vocab=32000, inter=2048, heads=12, kv=4, seq=1024)
        workers = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        batch = max(16, 4 * len(workers))  # a sequence for each of the 4 x N micro-batches
        warmup, steps = (3, 3) if ctx.quick else (3, 6)
    else:
        size = dict(hidden=64, layers=2, vocab=512, inter=128, heads=4, kv=2, seq=32)
        batch, workers = 8, ["cpu", "cpu"]
        warmup, steps = 3, 2
    model = small_llama(**size)
    params = sum(p.numel() for p in model.parameters())
    batches = token_batches(size["vocab"], batch, size["seq"], 4)
    tokens = batch * size["seq"]
    figures: dict[str, Any] = {
        "model": f"Llama {size['layers']} blocks x {size['hidden']} hidden, vocab {size['vocab']}",
        "parameters": params,
        "batch": batch,
        "sequence": size["seq"],
        "workers": workers,
        "measured_steps": steps,
    }
    for mode in ("sync", "async"):
        config = EngineConfig(
            tf32=False,
            devices=workers,
            num_microbatches=4 * len(workers),
            compute_dtype="bfloat16",
            lr=1e-4,
            async_optimizer=mode == "async",
        )
        sink = ListSink()
        with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
            for i in range(warmup):
                rp.forward_backward(**batches[i % len(batches)])
                rp.step()
            rp.synchronize()
            t0 = time.perf_counter()
            for i in range(steps):
                rp.forward_backward(**batches[i % len(batches)])
                rp.step()
            rp.synchronize()
            seconds = time.perf_counter() - t0
            plan = rp.plan.describe() if rp.plan is not None else None
        records = [m for _, m in sink.records[warmup:]]
        figures[f"engine_{mode}"] = {
            "tokens_per_s": steps * tokens / seconds,
            "bubble_ratio": statistics.mean(m["pipeline/bubble_ratio"] for m in records),
            "optimizer_s": statistics.mean(m["time/optimizer_s"] for m in records),
            "plan": plan,
        }
    best = max(figures["engine_sync"]["tokens_per_s"], figures["engine_async"]["tokens_per_s"])
    if not ctx.cuda:
        figures["gpu_resident"] = "skipped: no GPU (--cpu)"
        return Result(
            "PASS",
            f"engine {best:.0f} tok/s (bubble {figures['engine_sync']['bubble_ratio']:.2f}); "
            "GPU-resident baseline skipped (no GPU)",
            figures,
        )
    dev = torch.device("cuda:0")
    resident = copy.deepcopy(model).to(dev)
    del model
    opt = torch.optim.AdamW(resident.parameters(), lr=1e-4, fused=True)
    dev_batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]

    def plain_step(net: torch.nn.Module, opt: torch.optim.Optimizer, b: dict[str, torch.Tensor]) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        plain_step(resident, opt, dev_batches[i % len(dev_batches)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        plain_step(resident, opt, dev_batches[i % len(dev_batches)])
    torch.cuda.synchronize()
    plain_tps = steps * tokens / (time.perf_counter() - t0)
    del resident, opt, dev_batches
    gc.collect()
    torch.cuda.empty_cache()
    figures["gpu_resident"] = {
        "tokens_per_s": plain_tps,
        "precision": "fp32 weights, bf16 autocast, fused AdamW",
    }
    figures["engine_over_resident"] = {
        m: figures[f"engine_{m}"]["tokens_per_s"] / plain_tps for m in ("sync", "async")
    }
    ratio = best / plain_tps
    message = (
        f"engine {best:.0f} tok/s vs GPU-resident {plain_tps:.0f} tok/s: ratio {ratio:.2f}, "
        f"bubble sync {figures['engine_sync']['bubble_ratio']:.2f} "
        f"async {figures['engine_async']['bubble_ratio']:.2f}"
    )
    # informational: a single GPU with a 150M model is the engine's hardest case (weights cross
    # PCIe every step, the CPU optimizer is on the critical path in sync mode)
    return Result("WARN" if ratio < 0.5 else "PASS", message, figures)


# -- running -----------------------------------------------------------------------------------------
def dump_stacks(reason: str) -> None:
    """Print every thread's stack, with the thread names."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"=== {reason}: stacks of every thread ==="]
    for ident, frame in sys._current_frames().items():
        lines.append(f"--- thread {names.get(ident, '?')} ({ident}) ---")
        lines.extend(line.rstrip() for line in traceback.format_stack(frame))
    print("\n".join(lines), file=sys.stderr, flush=True)


def run_check(name: str, fn: Callable[[], Result], timeout: float) -> tuple[Result, bool]:
    """Run one check in its own thread under the watchdog; returns its result and whether it hung.

    Past ``timeout`` the watchdog prints every thread's stack and the check FAILs (its thread is
    left behind). Should even the watchdog not get to run (a call holding the interpreter lock),
    ``faulthandler`` dumps the stacks 60 s later and ends the process.
    """
    box: list[Result] = []

    def target() -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            result = fn()
        except Exception as exc:
            traceback.print_exc()
            result = Result("FAIL", f"{type(exc).__name__}: {exc}")
        result.seconds = time.perf_counter() - t0
        result.cpu_seconds = time.process_time() - c0
        box.append(result)

    thread = threading.Thread(target=target, name=f"gpu-check-{name}", daemon=True)
    # the process's own stderr: faulthandler writes to a file descriptor, from its own thread
    faulthandler.dump_traceback_later(timeout + 60, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            dump_stacks(f"check {name} still running after {timeout:.0f} s")
            return Result("FAIL", f"hung: still running after {timeout:.0f} s", seconds=timeout), True
    finally:
        faulthandler.cancel_dump_traceback_later()
    return box[0], False


def machine_info(cuda: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    import transformers

    machine: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if cuda:
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                    "multiprocessors": p.multi_processor_count,
                }
            )
        machine["gpus"] = gpus
        versions["cudnn"] = torch.backends.cudnn.version()
        smi = shutil.which("nvidia-smi")
        if smi:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                out = subprocess.run(
                    [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                versions["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return machine, versions


def summary_table(results: dict[str, Result]) -> list[str]:
    width = max(len(n) for n in results)
    lines = [f"{'check':<{width}}  status  seconds  detail"]
    for name, r in results.items():
        lines.append(f"{name:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {r.message}")
    counts = Counter(r.status for r in results.values())
    verdict = "FAIL" if counts["FAIL"] else "ok"
    lines.append(
        f"gpu-check: {counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL, "
        f"{counts['SKIP']} SKIP -> {verdict}"
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU workers; the GPU-only checks SKIP")
    parser.add_argument("--quick", action="store_true", help="fewer steps and configurations")
    parser.add_argument("--out", type=Path, help="JSON results (default bench/results/gpu_check[_cpu].json)")
    parser.add_argument(
        "--timeout", type=float, help="seconds per check before the watchdog (default 150, --cpu 60)"
    )
    parser.add_argument("--max-syncs", type=int, help="host syncs per step before host_syncs WARNs")
    parser.add_argument("--only", nargs="*", choices=CHECKS, help="run only these checks")
    args = parser.parse_args()
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print(
            "gpu-check: CUDA is not available here; `--cpu` runs the checks on CPU workers", file=sys.stderr
        )
        return 2
    ctx = Context(cuda=cuda, device="cuda:0" if cuda else "cpu", quick=args.quick, max_syncs=args.max_syncs)
    timeout = args.timeout or (150.0 if cuda else 60.0)
    out = args.out or RESULTS / ("gpu_check.json" if cuda else "gpu_check_cpu.json")
    machine, versions = machine_info(cuda)
    print(
        f"gpu-check ({'GPU' if cuda else 'CPU workers'}): {machine.get('gpus', machine['processor'])}",
        flush=True,
    )
    checks: dict[str, tuple[Callable[[], Result], float]] = {
        "cuda_tests": (lambda: check_cuda_tests(ctx, 300.0), 330.0),
        "equivalence": (lambda: check_equivalence(ctx), timeout),
        "race_injection": (lambda: check_race_injection(ctx), timeout),
        "adamw_clipping": (lambda: check_adamw_clipping(ctx), timeout),
        "low_precision": (lambda: check_low_precision(ctx), timeout),
        "dropout": (lambda: check_dropout(ctx), timeout),
        "cancel_close": (lambda: check_cancel_close(ctx, timeout), timeout),
        "memory": (lambda: check_memory(ctx), timeout),
        "host_syncs": (lambda: check_host_syncs(ctx), timeout),
        "throughput": (lambda: check_throughput(ctx), 2 * timeout),
    }
    assert tuple(checks) == CHECKS
    results: dict[str, Result] = {}
    hung = False
    started = time.perf_counter()
    for i, (name, (fn, limit)) in enumerate(checks.items(), start=1):
        if args.only and name not in args.only:
            results[name] = Result("SKIP", "not selected (--only)")
            continue
        print(f"[{i}/{len(checks)}] {name} ...", flush=True)
        result, stuck = run_check(name, fn, limit)
        hung = hung or stuck
        results[name] = result
        print(
            f"[{i}/{len(checks)}] {name}: {result.status} ({result.seconds:.1f} s) {result.message}",
            flush=True,
        )
    failed = any(r.status == "FAIL" for r in results.values())
    report = {
        "benchmark": "gpu_check",
        "mode": "cuda" if cuda else "cpu",
        "quick": args.quick,
        "seconds": time.perf_counter() - started,
        "machine": machine,
        "versions": versions,
        "environment": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES")},
        "checks": {
            name: {
                "status": r.status,
                "message": r.message,
                "seconds": r.seconds,
                "cpu_seconds": r.cpu_seconds,
                "figures": plain(r.figures),
            }
            for name, r in results.items()
        },
        "summary": dict(Counter(r.status for r in results.values())),
        "exit_code": 1 if failed else 0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nfigures: {out}\n")
    print("\n".join(summary_table(results)), flush=True)
    if hung:  # a hung check's threads may never end: do not wait for them at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
