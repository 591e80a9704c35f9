"""The GPU check: is the engine right, race-free, lean and fast on this machine's GPUs?

One command (``make gpu-check``) for a machine with NVIDIA GPUs and the project's ``.venv``. It
runs the CUDA tests (``pytest tests/engine/cuda``), then these checks, each reported as PASS,
WARN, FAIL (or SKIP, with the reason) with its figures:

1. ``equivalence``: fp32 sync mode against the plain single-device loop, and async mode against
   the CPU engine, with 1-3 workers on one GPU; bitwise the same weights for any worker count;
2. ``race_injection``: random ``torch.cuda._sleep`` on the copy and compute streams before every
   copy the engine makes (``DeviceLink.upload``, ``download``, ``copy_pieces``, wrapped at run
   time), random delays before the optimizer rewrites a compute copy, plus random host jitter:
   the numbers must stay bitwise those of a run without. Its self-test removes one wait on
   purpose (the worker's wait for the optimizer's new weights; on a GPU also the copy stream's
   wait for an activation's download) and must see the numbers change;
3. ``adamw_clipping``: AdamW with gradient clipping against the plain loop;
4. ``low_precision``: bfloat16 and float16 against float32, and float16's loss-scale backoff
   (a scale far too large overflows, halves, and the steps that went through match float32);
5. ``dropout``: dropout masks equal between forward and recompute (several workers and a split
   plan bitwise equal to one worker with the fused-only plan);
6. ``lora_frozen_base``, ``dpo``, ``evaluation``, ``round_size``, ``router_loss``: LoRA on a
   frozen base, DPO (``engine.methods.dpo``), ``evaluate`` between steps, rounds smaller than
   the iteration, and an MoE model's router loss, each with 1, 2 and 3 workers sharing one
   device, against the plain loop and bitwise the same for every worker count;
7. ``cancel_close``: cancel and ``close()`` with work in flight: no hang, no thread left, the
   state unchanged by the cancelled iteration, device memory released;
8. ``memory``: device memory after each step (no growth after warm-up), the peak, allocator
   retries, pinned host bytes against the compute copy's bytes, live CUDA tensors after close;
   a stage's weights held on purpose must show in the reading after close;
9. ``host_syncs``: host synchronisations per steady-state step of a split plan (forward, fused
   and backward stages, prefetch, activation hand-off), dense and MoE models, counted from
   every thread by the CUDA sync debug mode; an ``.item()`` injected on a worker must be counted;
10. ``throughput``: tokens/s and bubble ratio of a ~150M-parameter bfloat16 Llama on the engine
   against a GPU-resident plain loop (model on the GPU, fused AdamW, bfloat16 autocast);
11. ``inference``: the inference service's decoder (``engine.inference.batching``) in bfloat16
   with its KV cache: each prompt's greedy answer alone equal to ``model.generate``, four prompts
   of different lengths batched together, and decode tokens/s alone and batched.

Device memory is read once the GPU is idle, unreachable objects are collected, cuBLAS's
per-stream workspaces are freed and the allocator's cache is emptied: what remains is held by
tensors.

A watchdog prints every thread's stack when a check runs past its timeout (and the check FAILs);
the last lines printed are the summary table; the exit code is 1 when a check FAILed. The
figures, the machine and the versions go to ``--out`` (a JSON file).

``--cpu`` runs the same checks on CPU workers with small sizes (under a minute on two cores):
what needs a GPU (the CUDA tests, CUDA sleeps and the stream-wait mutant, allocator statistics,
the sync count, the GPU-resident baseline) is skipped with the reason; ``host_syncs`` still runs
its plans and its injected ``.item()`` so that its hooks cannot rot. The test suite runs this
mode, so the script cannot rot without a GPU.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

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
from engine.parallel.executor import Worker  # noqa: E402
from tests.engine.tiny import (  # noqa: E402
    MOE_FAMILIES,
    SPECS,
    SPLIT_PLAN,
    VOCAB,
    bitwise_equal,
    engine_loop,
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
    "lora_frozen_base",
    "base_4bit",
    "dpo",
    "evaluation",
    "round_size",
    "router_loss",
    "cancel_close",
    "memory",
    "host_syncs",
    "throughput",
    "inference",
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
PUBLISH_JITTER_S = 1e-3  # before the optimizer rewrites a unit's compute copy, half the time
# the self-test's delay before every rewrite: long enough that a worker which no longer waits for
# the new weights certainly copies the old ones (a step of the tiny models takes ~1 ms)
MUTANT_PUBLISH_DELAY_S = 5e-3
# Host syncs a steady step may make from the engine's own code: the first H200 run counted 1 per
# step (2 workers, the automatic plan); a split plan, prefetch and activation hand-offs add none.
ENGINE_SYNCS_PER_STEP = 1
WORKER_COUNTS = (1, 2, 3)  # workers sharing the one device in the correctness rows
# a plan whose backward stage starts right above the frozen input layer of a LoRA model
LORA_PLAN = {"forward": [1, 2], "fused": 2, "backward": [2, 1]}
DPO_BETA = 0.5  # larger than the usual 0.1: the tiny models' rewards move visibly in 2 steps
DPO_LR = 0.5
# the router loss's weight: far above the usual 0.001, so a wrong router gradient shows
ROUTER_COEF = 0.5
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
        max_syncs: host synchronisations from the engine's own code allowed per steady step
            before ``host_syncs`` FAILs (None: ``ENGINE_SYNCS_PER_STEP``).
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


def nanmax(values: Iterable[float]) -> float:
    """The largest value, NaN if any is NaN (``max`` keeps whichever of a NaN and a number came
    first, so a NaN could hide behind a small difference)."""
    values = list(values)
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def loss_gap(a: list[float], b: list[float]) -> float:
    return nanmax(abs(x - y) for x, y in zip(a, b, strict=True))


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two state dicts (inf when their keys differ; NaN shows)."""
    if set(a) != set(b):
        return float("inf")
    return nanmax((a[k].float() - b[k].float()).abs().max().item() for k in a)


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


def settled_device_bytes(ctx: Context) -> dict[str, int]:
    """Device bytes held by tensors, read once the GPU is idle.

    Waits for the device, collects unreachable objects, frees cuBLAS's workspaces and empties the
    allocator's cache first. cuBLAS keeps one workspace (32 MiB under
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) for every stream it ran a matmul on, allocated through
    the caching allocator and kept after the stream is gone: every engine's worker streams add
    theirs, which read as a leak without this.

    Returns:
        ``allocated``: the bytes still allocated; ``cleared``: what the workspaces (and blocks
        whose free waited on a stream) held; ``workspaces_cleared``: whether this torch could
        clear them.
    """
    torch.cuda.synchronize(ctx.device)
    gc.collect()
    before = torch.cuda.memory_allocated(ctx.device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: absent in some builds
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated(ctx.device)
    return {"allocated": allocated, "cleared": before - allocated, "workspaces_cleared": clear is not None}


def lora_model(b_std: float = 0.02) -> torch.nn.Module:
    """The tiny Llama with a LoRA adapter (r 4 on q, v and down projections) on a frozen base.

    peft starts B at zero; B drawn from N(0, ``b_std``) gives both factors gradients and makes
    the adapted model differ from its base.
    """
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama", tied=False),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std, generator=torch.Generator().manual_seed(len(name)))
    return model


def moe_model() -> torch.nn.Module:
    """The tiny Qwen3-MoE (a dense first block, then 4 experts, 2 per token) with a router loss
    weight of ``ROUTER_COEF`` and routers drawn from N(0, 0.5): clear preferences, so the rounding
    of a GPU never routes a token differently from the reference."""
    model = tiny_model("qwen3_moe", router_aux_loss_coef=ROUTER_COEF)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gate." in name or "router" in name:
                p.normal_(0.0, 0.5, generator=g)
    return model


def pair_batch(pairs: int, seed: int, seq: int = 12) -> dict[str, torch.Tensor]:
    """``pairs`` random prompts with two answers of different lengths each, right-padded: row
    ``2i`` the chosen and row ``2i + 1`` the rejected answer of pair ``i``, labels on the answers."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2 * pairs, seq, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i in range(pairs):
        n_prompt = int(torch.randint(2, 5, (1,), generator=g))
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=g)
        for k in (0, 1):
            n = int(torch.randint(n_prompt + 2, seq + 1, (1,), generator=g))
            row = 2 * i + k
            ids[row, :n] = torch.cat([prompt, torch.randint(0, VOCAB, (n - n_prompt,), generator=g)])
            mask[row, :n] = 1
            labels[row, n_prompt:n] = ids[row, n_prompt:n]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its label tokens (written out, not the engine's)."""
    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    targets = labels[:, 1:]
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(dim=-1)


def plain_dpo(
    ctx: Context, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]
) -> tuple[list[float], dict[str, torch.Tensor], list[torch.Tensor]]:
    """DPO the ordinary way on the check's device: the unsplit LoRA model, the whole batch, torch
    SGD, the reference the base with the adapter off. Returns the losses, the weights and the
    reference log-probabilities of each batch."""
    policy: Any = copy.deepcopy(model).to(ctx.device)  # a peft model (disable_adapter)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=DPO_LR)
    losses, references = [], []
    for batch in batches:
        b = {k: v.to(ctx.device) for k, v in batch.items()}
        inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
        with torch.no_grad(), policy.disable_adapter():
            reference = row_logps(policy(**inputs).logits, b["labels"])
        logps = row_logps(policy(**inputs).logits, b["labels"])
        margin = (logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2])
        loss = -torch.nn.functional.logsigmoid(DPO_BETA * margin).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        references.append(reference.cpu())
    return losses, on_cpu(policy.state_dict()), references


def engine_dpo(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], config: EngineConfig
) -> tuple[list[float], dict[str, torch.Tensor], list[torch.Tensor]]:
    """The same through the engine: the base's log-probabilities up front, then DPO steps."""
    from engine.methods.dpo import train as dpo

    with RoundPipe(copy.deepcopy(model), config) as rp:
        references = [rp.sequence_logps(**b, adapters=False) for b in batches]
        losses = []
        for batch, reference in zip(batches, references, strict=True):
            losses.append(dpo.forward_backward(rp, **batch, reference_logps=reference, beta=DPO_BETA).loss)
            rp.step()
        return losses, rp.master_state_dict(), references


Run = tuple[list[float], dict[str, torch.Tensor]]  # losses and weights of a training run


def compare_workers(
    ctx: Context, runs: dict[int, Run], ref: Run, tol: float, against: str
) -> tuple[str, list[str], dict[str, Any]]:
    """Each worker count's run against a reference (within ``tol``), and the worker counts
    against each other (bitwise).

    Returns:
        The status, what went wrong, and the figures (``<n>w_loss_diff``, ``<n>w_weight_diff``,
        ``max_diff``, ``bitwise_for_workers``).
    """
    figures: dict[str, Any] = {"tolerance": tol, "workers": list(runs)}
    status, problems = "PASS", []
    for n, (losses, state) in runs.items():
        loss, weights = loss_gap(losses, ref[0]), weight_gap(state, ref[1])
        figures[f"{n}w_loss_diff"], figures[f"{n}w_weight_diff"] = loss, weights
        if not (loss < tol and weights < tol):  # NaN fails too
            status = "FAIL"
            problems.append(f"{n} workers differ from {against}: loss {loss:.2e}, weights {weights:.2e}")
    figures["max_diff"] = nanmax(v for k, v in figures.items() if k.endswith("_diff"))
    first = runs[min(runs)]
    spread = nanmax(nanmax([loss_gap(r[0], first[0]), weight_gap(r[1], first[1])]) for r in runs.values())
    figures["bitwise_for_workers"] = all(same_bits(r, first) for r in runs.values())
    if not figures["bitwise_for_workers"]:
        if ctx.deterministic is False and spread < tol:
            status = worst(status, "WARN")
            problems.append(f"worker counts not bitwise equal ({spread:.1e}), as two identical runs are not")
        else:
            status = "FAIL"
            problems.append(f"worker counts differ from each other by {spread:.2e}")
    return status, problems, figures


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
def patched(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Replace the method ``owner.name`` by ``make(original)`` for the duration (the engine's
    source is not edited).

    Raises:
        RuntimeError: ``owner`` has no such method any more (this script needs updating).
    """
    original = owner.__dict__.get(name)
    if not callable(original):
        raise RuntimeError(
            f"{owner.__module__}.{owner.__qualname__} has no {name}: update bench/gpu_check.py"
        )
    setattr(owner, name, functools.wraps(original)(make(original)))
    try:
        yield
    finally:
        setattr(owner, name, original)


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

    def __init__(self, seed: int, *, gpu_sleeps: bool, publish_delay_s: float | None = None) -> None:
        self.rng = random.Random(seed)
        self.gpu_sleeps = gpu_sleeps
        self.publish_delay_s = publish_delay_s  # fixed; None: random, half the time
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.sleeps = 0
        self.cycles = 0
        self.jitter_s = 0.0
        self.publishes = 0
        self.publish_wait_s = 0.0

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

    def publish_delay(self) -> float:
        """Seconds to hold the optimizer before it rewrites one unit's compute copy."""
        with self.lock:
            if self.publish_delay_s is not None:
                delay = self.publish_delay_s
            else:
                delay = self.rng.uniform(0, PUBLISH_JITTER_S) if self.rng.random() < 0.5 else 0.0
            self.publishes += 1
            self.publish_wait_s += delay
        return delay

    def figures(self) -> dict[str, Any]:
        return {
            "copies": dict(self.calls),
            "gpu_sleeps": self.sleeps,
            "gpu_sleep_cycles": self.cycles,
            "host_jitter_s": round(self.jitter_s, 4),
            "publishes_delayed": self.publishes,
            "publish_delay_s": round(self.publish_wait_s, 4),
        }


@contextlib.contextmanager
def race_injected(injector: RaceInjector) -> Iterator[None]:
    """``injector`` before every copy, and its delay before every rewrite of a compute copy
    (``HostState.refresh_compute``, and ``Unit.step_writing``, the one-pass AdamW that writes
    the copies as it updates; both on the optimizer thread) for the duration."""
    from engine.parallel.host import HostState
    from engine.parallel.units import Unit

    def refresh(original: Callable[..., Any]) -> Callable[..., Any]:
        def delayed(host: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(injector.publish_delay())
            return original(host, *args, **kwargs)

        return delayed

    with (
        copy_hook(injector),
        patched(HostState, "refresh_compute", refresh),
        patched(Unit, "step_writing", refresh),
    ):
        yield


@dataclass(frozen=True)
class Mutant:
    """One wait of the engine removed on purpose: ``method`` of ``owner`` does nothing when called
    from ``caller`` (or, when it makes the condition a thread waits on, returns one met at once)."""

    what: str
    module: str
    owner: str
    method: str
    caller: str
    condition: bool
    cuda_only: bool


MUTANTS = {
    # without it a worker uploads a layer before the optimizer wrote its new weights
    "publish_wait": Mutant(
        "the worker's wait for the optimizer's new weights (Board.published in Worker._weights)",
        "engine.parallel.board",
        "Board",
        "published",
        "_weights",
        condition=True,
        cuda_only=False,
    ),
    # without it the copy stream uploads an activation before its download from the stage below
    # landed in host memory (CPU copies are synchronous: only a GPU can show it)
    "activation_stream_wait": Mutant(
        "the copy stream's wait for an activation's download (DeviceLink.wait in Worker._stage_input)",
        "engine.parallel.transfer",
        "DeviceLink",
        "wait",
        "_stage_input",
        condition=False,
        cuda_only=True,
    ),
}


@contextlib.contextmanager
def mutant_installed(mutant: Mutant) -> Iterator[Counter[str]]:
    """Remove ``mutant``'s wait for the duration; yields a counter of the waits removed."""
    import importlib

    owner = getattr(importlib.import_module(mutant.module), mutant.owner)
    removed: Counter[str] = Counter()

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def skipping(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_name != mutant.caller:
                return original(obj, *args, **kwargs)
            removed["waits"] += 1
            return (lambda: True) if mutant.condition else None

        return skipping

    with patched(owner, mutant.method, make):
        yield removed


class StepProbe:
    """Watches the workers for ``host_syncs``: wraps ``Worker._stage_input`` and
    ``Worker._start_prefetch`` while installed.

    Counts the stage inputs by stage kind, the activations handed from one stage to the next and
    the prefetches started; while ``inject`` is set, reads the first input a worker takes in each
    training iteration back to the host with ``.item()``: a host sync on a worker's thread, the
    positive control of the sync count.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inject = False
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.inputs: Counter[str] = Counter()
            self.handoffs = 0
            self.prefetches = 0
            self.injected = 0
            self.fired: set[int] = set()

    def paths(self) -> dict[str, Any]:
        with self.lock:
            return {
                "stage_inputs": dict(self.inputs),
                "activation_handoffs": self.handoffs,
                "prefetches": self.prefetches,
            }

    @contextlib.contextmanager
    def installed(self) -> Iterator[StepProbe]:
        from engine.parallel.executor import Worker

        def stage_input(original: Callable[..., Any]) -> Callable[..., Any]:
            def watched(worker: Any, it: Any, stage: Any, mb: int) -> Any:
                x, after = original(worker, it, stage, mb)
                with self.lock:
                    self.inputs[str(stage.kind)] += 1
                    self.handoffs += int(stage.start > 0)
                    fire = self.inject and it.train and it.serial not in self.fired
                    if fire:
                        self.fired.add(it.serial)
                        self.injected += 1
                if fire:
                    x.reshape(-1)[0].item()  # on a GPU: copies one element down and waits for it
                return x, after

            return watched

        def start_prefetch(original: Callable[..., Any]) -> Callable[..., Any]:
            def watched(worker: Any, *args: Any, **kwargs: Any) -> Any:
                started = original(worker, *args, **kwargs)
                if started is not None:
                    with self.lock:
                        self.prefetches += 1
                return started

            return watched

        with patched(Worker, "_stage_input", stage_input), patched(Worker, "_start_prefetch", start_prefetch):
            yield self


class SyncCounter:
    """The host synchronisations CUDA's sync debug mode reports while active, from every thread.

    With ``torch.cuda.set_sync_debug_mode("warn")`` every synchronising call (``.item()``, a
    blocking copy, a stream or device synchronize; an event's ``synchronize`` is not one) raises
    a warning in the thread that made it; autograd replays a backward's at its
    ``torch.autograd.backward`` call. A sync is the model's own when the Python stack that raised
    it passes through transformers or peft (an MoE block's expert dispatch), else the engine's.
    Without CUDA nothing is counted.
    """

    def __init__(self, cuda: bool) -> None:
        import transformers

        self.cuda = cuda
        self.lock = threading.Lock()
        self.records: list[tuple[str, str, str]] = []  # (engine | model, file:line, thread)
        dirs = [Path(transformers.__file__).parent]
        with contextlib.suppress(ImportError):
            import peft

            dirs.append(Path(peft.__file__).parent)
        self.model_dirs = tuple(f"{d}{os.sep}" for d in dirs)
        self._catch: Any = None
        self._mode: Any = 0

    def __enter__(self) -> SyncCounter:
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # module-wide: the worker threads' warnings land here
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if "synchroniz" not in str(message).lower():
            return
        model = any(f.filename.startswith(self.model_dirs) for f in traceback.extract_stack())
        where = f"{Path(filename).name}:{lineno}"
        with self.lock:
            self.records.append(("model" if model else "engine", where, threading.current_thread().name))

    def count(self, kind: str) -> int:
        with self.lock:
            return sum(1 for k, _, _ in self.records if k == kind)

    def by_location(self) -> dict[str, int]:
        with self.lock:
            where = Counter(f"{k} {w} ({t})" for k, w, t in self.records)
        return dict(where.most_common())


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
        figures[f"sync_{n}w_weight_diff"] = weight_gap(state, ref_state)
        if not (figures[f"sync_{n}w_loss_diff"] < tol and figures[f"sync_{n}w_weight_diff"] < tol):
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
        figures[f"async_{n}w_weight_diff"] = weight_gap(state, cpu_state)
        if not (figures[f"async_{n}w_loss_diff"] < tol and figures[f"async_{n}w_weight_diff"] < tol):
            problems.append(f"async with {n} workers differs from the CPU engine")
    _, sync_plain = plain_on(ctx, model, batches, sgd)
    figures["async_vs_sync_weight_diff"] = weight_gap(cpu_state, sync_plain)  # async is really async
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
    """Random stream and publish delays must not change a single bit; a removed wait must."""
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
    clean: dict[str, tuple[Run, float]] = {}  # each config's clean run and its rerun distance
    for i, (name, config) in enumerate(configs.items()):
        a = engine_loop(model, batches, config)[:2]
        b = engine_loop(model, batches, config)[:2]
        injector = RaceInjector(seed=1234 + i, gpu_sleeps=ctx.cuda)
        with race_injected(injector):
            c = engine_loop(model, batches, config)[:2]
        rerun_diff = nanmax([loss_gap(a[0], b[0]), weight_gap(a[1], b[1])])
        injected_diff = nanmax([loss_gap(a[0], c[0]), weight_gap(a[1], c[1])])
        clean[name] = (a, 0.0 if same_bits(a, b) else rerun_diff)
        figures[name] = {
            "rerun_bitwise": same_bits(a, b),
            "rerun_max_diff": rerun_diff,
            "injected_bitwise": same_bits(a, c),
            "injected_max_diff": injected_diff,
            **injector.figures(),
        }
        if sum(injector.calls.values()) == 0 or injector.publishes == 0:
            status = worst(status, "FAIL")
            notes.append(
                f"{name}: the hooks saw no copy or no publish (the engine changed: update the check)"
            )
        elif same_bits(a, b):
            if not same_bits(a, c):
                status = worst(status, "FAIL")
                notes.append(f"{name}: injected delays changed the numbers (max diff {injected_diff:.2e})")
        else:
            deterministic = False
            status = worst(status, "WARN")
            notes.append(f"{name}: two identical runs differ ({rerun_diff:.2e}): non-deterministic kernels")
            if moved(injected_diff, rerun_diff):
                status = worst(status, "FAIL")
                notes.append(f"{name}: injected delays moved the numbers by {injected_diff:.2e}")
    ctx.deterministic = deterministic
    # the self-test: the same injection with one wait removed must change the numbers
    name = "sync_fp32_adamw"
    reference, rerun_diff = clean[name]
    self_test: dict[str, Any] = {"config": name}
    caught_all = True
    for key, mutant in MUTANTS.items():
        if mutant.cuda_only and not ctx.cuda:
            self_test[key] = f"skipped: {mutant.what} needs CUDA streams (CPU copies are synchronous)"
            continue
        injector = RaceInjector(seed=4321, gpu_sleeps=ctx.cuda, publish_delay_s=MUTANT_PUBLISH_DELAY_S)
        with race_injected(injector), mutant_installed(mutant) as removed:
            m = engine_loop(model, batches, configs[name])[:2]
        diff = nanmax([loss_gap(reference[0], m[0]), weight_gap(reference[1], m[1])])
        caught = not same_bits(reference, m) if rerun_diff == 0.0 else moved(diff, rerun_diff)
        self_test[key] = {"removed": mutant.what, "waits_skipped": removed["waits"], "caught": caught}
        self_test[key]["max_diff"] = diff
        if removed["waits"] == 0:
            caught_all = False
            status = worst(status, "FAIL")
            notes.append(
                f"self-test: removing {mutant.what} skipped no wait (the engine changed: update the check)"
            )
        elif not caught:
            caught_all = False
            status = worst(status, "FAIL")
            notes.append(f"self-test did not detect the removed wait: {mutant.what}")
    figures["self_test"] = self_test
    if not notes:
        total = sum(sum(figures[n]["copies"].values()) for n in configs)
        what = (
            "GPU sleeps, publish delays and host jitter"
            if ctx.cuda
            else "publish delays and host jitter (no GPU)"
        )
        mutants = [k for k, v in self_test.items() if isinstance(v, dict)]
        notes.append(f"bitwise equal with {what} on {total} copies; self-test caught {', '.join(mutants)}")
        if not ctx.cuda:
            notes.append("the stream-wait mutant needs a GPU")
    figures["self_test_caught_every_mutant"] = caught_all
    return Result(status, "; ".join(notes), figures)


def moved(diff: float, rerun_diff: float) -> bool:
    """Whether a run moved the numbers beyond what two identical runs differ by (NaN: it did)."""
    return not math.isfinite(diff) or diff > max(10 * rerun_diff, 1e-6)


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
    rounding = weight_gap(split_state, ref_state)  # the plain loop's own whole-batch vs split distance
    figures: dict[str, Any] = {
        "loss_diff": loss_gap(losses, ref_losses),
        "weight_diff_vs_whole_batch": weight_gap(state, ref_state),
        "weight_diff_vs_same_split": weight_gap(state, split_state),
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
        diff = weight_gap(state, s32)
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
        diff = weight_gap(s16, ref)
        backoff["weight_diff_vs_fp32_on_kept_steps"] = diff
        if not diff < LOW_PRECISION_TOL["float16"]:  # NaN fails too
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
        figures[f"{name}_max_diff"] = nanmax([loss_gap(run[0], base[0]), weight_gap(run[1], base[1])])
    no_dropout = engine_loop(
        tiny_model("llama"),
        batches,
        EngineConfig(tf32=False, devices=ctx.devices(1), num_microbatches=3, optimizer="sgd", lr=0.1),
    )
    figures["vs_no_dropout_diff"] = weight_gap(no_dropout[1], base[1])
    worst_diff = max(v for k, v in figures.items() if k.endswith("_max_diff"))
    if figures["vs_no_dropout_diff"] <= 1e-6:
        return Result("FAIL", "dropout had no effect: the check tested nothing", figures)
    if all(figures[f"{n}_bitwise"] for n in runs):
        return Result("PASS", "fused-only, 1, 2 and 3 workers bitwise equal (dropout 0.2)", figures)
    if ctx.deterministic is False and worst_diff < 1e-5:
        return Result("WARN", f"not bitwise ({worst_diff:.1e}), as two identical runs are not", figures)
    return Result("FAIL", f"recompute drew other masks: max diff {worst_diff:.2e}", figures)


def row_result(status: str, problems: list[str], figures: dict[str, Any], passed: str) -> Result:
    """A correctness row's verdict: its problems, or ``passed`` with the largest difference."""
    if problems:
        return Result(status, "; ".join(problems), figures)
    counts = "-".join(str(n) for n in figures["workers"])
    message = f"max diff {figures['max_diff']:.2e} < {figures['tolerance']:g}, bitwise for {counts} workers"
    return Result(status, f"{message}; {passed}", figures)


def lora_runs(
    ctx: Context, model: torch.nn.Module, ref: Run, batches: list[dict[str, torch.Tensor]], **engine: Any
) -> tuple[str, list[str], dict[str, Any], dict[int, Run]]:
    """A LoRA model trained by the engine (SGD, ``LORA_PLAN``) on 1-3 workers against ``ref``:
    ``compare_workers``'s verdict, and the runs."""
    runs: dict[int, Run] = {}
    for n in WORKER_COUNTS:
        config = EngineConfig(
            tf32=False,
            devices=ctx.devices(n),
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            partition=LORA_PLAN,
            **engine,
        )
        runs[n] = engine_loop(model, batches, config)[:2]
    return (*compare_workers(ctx, runs, ref, SGD_TOL[ctx.kind], "the plain loop"), runs)


def check_lora_frozen_base(ctx: Context) -> Result:
    """LoRA on a frozen base against the plain loop on the peft model: only the adapter moves."""
    model = lora_model()
    batches = tiny_batches(2)
    status, problems, figures, runs = lora_runs(ctx, model, plain_on(ctx, model, batches, sgd), batches)
    before = on_cpu(model.state_dict())
    state = runs[WORKER_COUNTS[0]][1]
    base = [k for k in before if "lora_" not in k]
    adapter = [k for k in before if "lora_" in k]
    figures["base_tensors"], figures["adapter_tensors"] = len(base), len(adapter)
    figures["base_changed"] = [k for k in base if k not in state or not torch.equal(state[k], before[k])]
    figures["adapter_unchanged"] = [k for k in adapter if k in state and torch.equal(state[k], before[k])]
    if not adapter or figures["base_changed"] or figures["adapter_unchanged"]:
        status = "FAIL"
        problems.append(
            f"the frozen base moved ({figures['base_changed'][:3]}) or the adapter did not "
            f"({figures['adapter_unchanged'][:3]})"
        )
    return row_result(status, problems, figures, f"{len(base)} base tensors bitwise unchanged")


def check_base_4bit(ctx: Context) -> Result:
    """LoRA on a 4-bit (NF4) base against the plain loop on the base's decoded values, and what
    decoding a block's packed weights on the device costs against the upload time it saves."""
    from engine.model import quant

    model = lora_model()
    reference = copy.deepcopy(model)
    packed_names = [
        n for n, p in model.named_parameters() if ".layers." in n and not p.requires_grad and p.dim() >= 2
    ]
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in packed_names:
                p.copy_(quant.dequantized(p, torch.float32))
    batches = tiny_batches(2)
    ref = plain_on(ctx, reference, batches, sgd)
    status, problems, figures, _ = lora_runs(ctx, model, ref, batches, base_bits=4)
    # one Llama-8B-sized block (hidden 4096, MLP 14336) in bfloat16 on a GPU (a smaller one on
    # CPU workers, where a copy stands for the upload): decode against upload
    hidden, inter = (4096, 14336) if ctx.cuda and not ctx.quick else (1024, 3584)
    shapes = [(hidden, hidden)] * 2 + [(hidden // 4, hidden)] * 2 + [(inter, hidden)] * 2 + [(hidden, inter)]
    g = torch.Generator().manual_seed(0)
    packs = [quant.pack(torch.randn(s, generator=g) * 0.02, torch.bfloat16) for s in shapes]
    dense_bytes = sum(math.prod(s) * 2 for s in shapes)
    packed_bytes = sum(b.numel() for b, _ in packs)
    on_device = [b.to(ctx.device) for b, _ in packs]
    dense = torch.empty(dense_bytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    target = torch.empty_like(dense, device=ctx.device)

    def timed(fn: Callable[[], Any], repeats: int = 5) -> float:
        fn()  # warm up
        device_sync(ctx)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        device_sync(ctx)
        return (time.perf_counter() - t0) / repeats

    decode_s = timed(lambda: [layout.unpack(b) for b, (_, layout) in zip(on_device, packs, strict=True)])
    upload_s = timed(lambda: target.copy_(dense, non_blocking=True))
    saved_s = upload_s * (1 - packed_bytes / dense_bytes)
    # the layouts of checkpoints that arrive quantized (bitsandbytes 4-bit, MXFP4 experts):
    # decoded on the device exactly as on the host, and how long the block's weights take
    stored = stored_layouts(shapes, g)
    for kind, pieces in stored.items():
        device_pieces = [(b.to(ctx.device), layout) for b, layout in pieces]
        for (host_buffer, layout), (buffer, _) in zip(pieces, device_pieces, strict=True):
            if not torch.equal(layout.unpack(buffer).cpu(), layout.unpack(host_buffer)):
                status = "FAIL"
                problems.append(f"a {kind} weight {tuple(layout.shape)} decodes differently on {ctx.device}")
        figures[f"{kind}_decode_s"] = timed(lambda p=device_pieces: [layout.unpack(b) for b, layout in p])
        figures[f"{kind}_packed_ratio"] = sum(b.numel() for b, _ in pieces) / dense_bytes
    figures.update(
        {
            "block": {"hidden": hidden, "intermediate": inter},
            "dense_bytes": dense_bytes,
            "packed_bytes": packed_bytes,
            "packed_ratio": packed_bytes / dense_bytes,
            "decode_s": decode_s,
            "dense_upload_s": upload_s,
            "upload_saved_s": saved_s,
            "decode_over_saved": decode_s / saved_s if saved_s > 0 else float("inf"),
        }
    )
    passed = (
        f"a block: {packed_bytes / dense_bytes:.2f}x the bytes; decoding {decode_s * 1e3:.1f} ms "
        f"against {saved_s * 1e3:.1f} ms of upload saved"
    )
    return row_result(status, problems, figures, passed)


def stored_layouts(
    shapes: list[tuple[int, int]], g: torch.Generator
) -> dict[str, list[tuple[torch.Tensor, Any]]]:
    """The block's weights as a bitsandbytes 4-bit checkpoint (NF4, double-quantized absmax)
    and as MXFP4 (one expert per weight) stores them: random codes and scales, packed buffers
    and layouts (``engine.model.prequantized``)."""
    from engine.model import prequantized as pq
    from engine.model import quant

    nf4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0])
    nf4 = torch.cat([nf4, torch.tensor([0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])])
    bnb, mxfp4 = [], []
    for rows, cols in shapes:
        n = rows * cols
        codes = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, generator=g)
        absmax = torch.randint(0, 256, (n // 64,), dtype=torch.uint8, generator=g)
        nested = torch.rand(-(-n // 64 // 256), generator=g) * 0.05
        book = torch.sort(torch.rand(256, generator=g) * 2 - 1).values
        buffer, parts = quant.lay_out([codes, absmax, nf4, nested, book])
        bnb.append((buffer, pq.BnbLayout(torch.Size((rows, cols)), torch.bfloat16, 64, 256, 0.01, parts)))
        blocks = torch.randint(0, 256, (1, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(110, 130, (1, rows, cols // 32), dtype=torch.uint8, generator=g)
        buffer, parts = quant.lay_out([blocks, scales])
        layout = pq.Mxfp4Layout(torch.Size((1, cols, rows)), torch.bfloat16, tuple(blocks.shape), parts)
        mxfp4.append((buffer, layout))
    return {"bnb4": bnb, "mxfp4": mxfp4}


def check_dpo(ctx: Context) -> Result:
    """DPO (``engine.methods.dpo``) on a LoRA model against a plain DPO loop."""
    model = lora_model(0.05)
    batches = [pair_batch(pairs=4, seed=s) for s in (1, 2)]
    ref_losses, ref_state, ref_logps = plain_dpo(ctx, model, batches)
    runs: dict[int, Run] = {}
    logps_diff = 0.0  # relative to the largest log-probability (sums over up to 10 tokens)
    scale = max(r.abs().max().item() for r in ref_logps)
    for n in WORKER_COUNTS:
        config = EngineConfig(
            tf32=False,
            devices=ctx.devices(n),
            num_microbatches=3,
            optimizer="sgd",
            lr=DPO_LR,
            partition=SPLIT_PLAN,
        )
        losses, state, logps = engine_dpo(model, batches, config)
        runs[n] = (losses, state)
        gaps = [(a - b).abs().max().item() / max(scale, 1.0) for a, b in zip(logps, ref_logps, strict=True)]
        logps_diff = nanmax([logps_diff, *gaps])
    tol = SGD_TOL[ctx.kind]
    status, problems, figures = compare_workers(ctx, runs, (ref_losses, ref_state), tol, "the plain DPO loop")
    figures["reference_logps_rel_diff"] = logps_diff
    figures["losses"] = runs[WORKER_COUNTS[0]][0]
    figures["trained_distance"] = weight_gap(ref_state, on_cpu(model.state_dict()))
    if not logps_diff < tol:
        status = "FAIL"
        problems.append(
            f"the base model's log-probabilities differ from the plain model's by {logps_diff:.2e}"
        )
    if not figures["trained_distance"] > 1e-3:
        status = "FAIL"
        problems.append(f"DPO moved no weight by more than {figures['trained_distance']:.1e}: nothing tested")
    return row_result(status, problems, figures, f"reference log-probabilities within {logps_diff:.1e}")


def check_evaluation(ctx: Context) -> Result:
    """``evaluate`` between training steps: dropout off, the current weights, nothing disturbed."""
    model = tiny_model("llama", attention_dropout=0.2)
    train = tiny_batches(2)
    held = tiny_batch(batch=7, seed=9)

    def config(n: int) -> EngineConfig:
        return EngineConfig(
            tf32=False,
            devices=ctx.devices(n),
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            partition=SPLIT_PLAN,
        )

    def plain_eval(state: dict[str, torch.Tensor] | None) -> float:
        ref = copy.deepcopy(model)
        if state is not None:
            ref.load_state_dict(state)
        ref = ref.to(ctx.device).eval()
        with torch.no_grad():
            return float(ref(**{k: v.to(ctx.device) for k, v in held.items()}).loss)

    runs: dict[int, Run] = {}
    after_one: dict[str, torch.Tensor] = {}
    for n in WORKER_COUNTS:
        with RoundPipe(copy.deepcopy(model), config(n)) as rp:
            scores = [rp.evaluate(**held), rp.evaluate(**held)]
            rp.forward_backward(**train[0])
            rp.step()
            if not after_one:  # the weights the third evaluation must see
                after_one = rp.master_state_dict()
            scores.append(rp.evaluate(**held))
            rp.forward_backward(**train[1])
            rp.step()
            runs[n] = (scores, rp.master_state_dict())
    undisturbed = engine_loop(model, train, config(1))[:2]
    # the reference: the model's own forward in eval mode, on the initial weights and on the
    # engine's after one step (the training steps draw dropout masks no plain loop reproduces)
    first = plain_eval(None)
    ref = ([first, first, plain_eval(after_one)], undisturbed[1])
    status, problems, figures = compare_workers(
        ctx, runs, ref, SGD_TOL[ctx.kind], "the model's own eval loss"
    )
    scores = runs[WORKER_COUNTS[0]][0]
    figures["scores"] = scores
    figures["reference_scores"] = ref[0]
    figures["same_twice"] = scores[0] == scores[1]
    figures["training_undisturbed"] = all(bitwise_equal(r[1], undisturbed[1]) for r in runs.values())
    # bitwise unless two identical runs are not either (then within the tolerance: a WARN)
    lenient = ctx.deterministic is False
    if not figures["same_twice"]:
        small = lenient and abs(scores[0] - scores[1]) < figures["tolerance"]
        status = worst(status, "WARN") if small else "FAIL"
        problems.append(
            f"two evaluations of the same weights differ ({scores[0]} vs {scores[1]}): dropout on?"
        )
    if not figures["training_undisturbed"]:
        small = lenient and figures["max_diff"] < figures["tolerance"]
        status = worst(status, "WARN") if small else "FAIL"
        problems.append("training with evaluations in between differs from training without")
    return row_result(status, problems, figures, "dropout off, training undisturbed bitwise")


def check_round_size(ctx: Context) -> Result:
    """Rounds of 3 micro-batches in iterations of 6 (``round_size < M``) against the plain loop."""
    model = tiny_model("llama")
    batches = tiny_batches(2)
    ref = plain_on(ctx, model, batches, sgd)
    rounds: list[int] = []

    def launch(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(engine: Any, *args: Any, **kwargs: Any) -> Any:
            it = original(engine, *args, **kwargs)
            if it.train:
                rounds.append(len(it.rounds))
            return it

        return counted

    runs: dict[int, Run] = {}
    with patched(RoundPipe, "_launch", launch):
        for n in WORKER_COUNTS:
            config = EngineConfig(
                tf32=False,
                devices=ctx.devices(n),
                num_microbatches=6,
                round_size=3,
                optimizer="sgd",
                lr=0.1,
                partition=SPLIT_PLAN,
            )
            runs[n] = engine_loop(model, batches, config)[:2]
    status, problems, figures = compare_workers(ctx, runs, ref, SGD_TOL[ctx.kind], "the plain loop")
    figures["rounds_per_iteration"] = sorted(set(rounds))
    if set(rounds) != {2}:
        status = "FAIL"
        problems.append(f"iterations of 6 micro-batches ran in {sorted(set(rounds))} rounds, not 2")
    return row_result(status, problems, figures, "2 rounds of 3 per iteration")


def check_router_loss(ctx: Context) -> Result:
    """An MoE model's router loss through forward, fused and backward stages against the model's
    own loss with router logits (the plain loop accumulating the same micro-batches)."""
    model = moe_model()
    batches = [tiny_batch(batch=6, seed=s) for s in (1, 2)]
    with_router: Any = copy.deepcopy(model)
    with_router.config.output_router_logits = True  # its loss adds coef x the router loss
    ref = plain_on(ctx, with_router, batches, sgd, microbatches=3)
    with torch.no_grad():
        without = float(copy.deepcopy(model)(**batches[0]).loss)
    runs: dict[int, Run] = {}
    for n in WORKER_COUNTS:
        config = EngineConfig(
            tf32=False,
            devices=ctx.devices(n),
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            router_aux_loss=True,
            partition=SPLIT_PLAN,
        )
        runs[n] = engine_loop(model, batches, config)[:2]
    status, problems, figures = compare_workers(ctx, runs, ref, SGD_TOL[ctx.kind], "the model's own loss")
    figures["router_loss_added"] = ref[0][0] - without
    if not abs(figures["router_loss_added"]) > 1e-3:
        status = "FAIL"
        problems.append(
            f"the router loss added {figures['router_loss_added']:.2e} to the loss: nothing tested"
        )
    return row_result(
        status, problems, figures, f"router loss {figures['router_loss_added']:.3f} of the loss"
    )


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
    figures["resumed_max_diff"] = weight_gap(resumed, clean)
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
    device_before = settled_device_bytes(ctx)["allocated"] if ctx.cuda else 0
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
        settled = settled_device_bytes(ctx)
        figures["device_bytes_before_after"] = [device_before, settled["allocated"]]
        figures["cleared_after_close_bytes"] = settled["cleared"]  # cuBLAS workspaces of its streams
        figures["cublas_workspaces_cleared"] = settled["workspaces_cleared"]
        if settled["allocated"] > device_before:
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
    # warm-up: the 2 calibration steps and the re-plan after them, and the gradient buffers'
    # pool filling to the number in flight (with two workers sharing a stage, a step later
    # when the workers' timing differs)
    steps, warmup = (6, 3) if ctx.quick else (10, 4)
    model = small_llama(**size)
    batches = token_batches(size["vocab"], batch, size["seq"], steps)
    config = EngineConfig(
        tf32=False, devices=ctx.devices(workers), num_microbatches=4, compute_dtype="bfloat16", lr=1e-4
    )
    if ctx.cuda:
        device_before = settled_device_bytes(ctx)["allocated"]
        torch.cuda.reset_peak_memory_stats(ctx.device)
        retries_before = torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        figures["host_active_bytes_before"] = stats.get("active_bytes.current", 0)
    tensors_before = live_tensors("cuda" if ctx.cuda else None)
    per_step: list[int] = []
    plans: list[str] = []  # the plan after each step: the calibration's re-plan may come a step late
    held: list[dict[int, dict[str, torch.Tensor]]] = []
    rp = RoundPipe(model, config)
    try:
        for b in batches:
            rp.forward_backward(**b)
            rp.step()
            rp.synchronize()
            per_step.append(settled_device_bytes(ctx)["allocated"] if ctx.cuda else live_tensors()[1])
            plans.append(rp.plan.describe() if rp.plan is not None else "")
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
        # the control: one more step, whose first stage's device weights are kept past close()
        with patched(Worker, "_weights", keep_first(held)):
            rp.forward_backward(**batches[-1])
            rp.step()
            rp.synchronize()
    finally:
        rp.close()
    name = "device_bytes_per_step" if ctx.cuda else "live_tensor_bytes_per_step"
    figures[name] = per_step
    # warm-up lasts until the plan is final: a new plan (e.g. more rounds per iteration) may need
    # one more gradient buffer per layer, once
    changed = [i for i in range(1, len(plans)) if plans[i] != plans[i - 1]]
    warmup = min(max(warmup, changed[-1] + 1 if changed else 0), len(per_step) - 1)
    figures["plans"], figures["warmup_steps"] = plans, warmup
    growth = max(per_step[warmup:]) - per_step[warmup - 1]
    figures["growth_after_warmup_bytes"] = growth
    # a leak grows at every step; the gradient buffers' pool fills once, at most a step or two
    # late when the two workers' timing differs under load: the last two steps must be flat
    figures["late_growth_bytes"] = max(per_step[-2:]) - per_step[-3]
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
    # what the readings after close() see with the control's weights still held, then without
    held_bytes = sum(
        t.numel() * t.element_size() for stage in held for ts in stage.values() for t in ts.values()
    )
    with_held = settled_device_bytes(ctx)["allocated"] if ctx.cuda else live_tensors()[1]
    held.clear()
    tensors_after = live_tensors("cuda" if ctx.cuda else None)  # CUDA tensors only, in GPU mode
    settled = settled_device_bytes(ctx) if ctx.cuda else {"allocated": 0, "cleared": 0}
    seen = with_held - (settled["allocated"] if ctx.cuda else live_tensors()[1])
    figures["leak_control"] = {"held_bytes": held_bytes, "seen_bytes": seen, "caught": 0 < held_bytes <= seen}
    if not figures["leak_control"]["caught"]:
        status = worst(status, "FAIL")
        notes.append(
            f"a stage's weights held on purpose ({held_bytes} bytes) read as {seen} bytes after close"
        )
    figures["live_tensors_before_after_close"] = [tensors_before[0], tensors_after[0]]
    if tensors_after[0] > tensors_before[0]:
        status = worst(status, "FAIL")
        notes.append(f"tensors left after close: {tensors_before[0]} -> {tensors_after[0]}")
    if ctx.cuda:
        figures["device_bytes_after_close"] = settled["allocated"] - device_before
        figures["cleared_after_close_bytes"] = settled["cleared"]  # cuBLAS workspaces of its streams
        figures["cublas_workspaces_cleared"] = settled["workspaces_cleared"]
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
        notes.append(
            f"no growth over {steps} steps after {warmup} warm-up{extra}; nothing left after close, "
            f"held weights seen ({held_bytes} bytes)"
        )
    return Result(status, "; ".join(notes), figures)


def keep_first(held: list[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper for ``Worker._weights`` that keeps the first stage's device weights in ``held``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def keeping(worker: Any, *args: Any, **kwargs: Any) -> Any:
            params = original(worker, *args, **kwargs)
            if not held:
                held.append(params)
            return params

        return keeping

    return make


def sync_run(ctx: Context, family: str, *, async_optimizer: bool) -> dict[str, Any]:
    """Host syncs of ``family``'s tiny model on 2 workers with the split plan: 2 warm-up steps,
    3 steady steps counted, then 2 steps with the ``.item()`` control injected, counted too."""
    warmup, steps, control_steps = 2, 3, 2
    spec = SPECS[family]
    config = EngineConfig(
        tf32=False,
        devices=ctx.devices(2),
        num_microbatches=4,
        optimizer="sgd",
        lr=0.1,
        async_optimizer=async_optimizer,
        partition=SPLIT_PLAN,
        router_aux_loss=spec.moe is not None and spec.moe.aux_loss,
    )
    batches = tiny_batches(warmup + steps + control_steps, batch=8)
    probe = StepProbe()
    with probe.installed(), RoundPipe(tiny_model(family), config) as rp:

        def train(part: list[dict[str, torch.Tensor]]) -> None:
            for b in part:
                rp.forward_backward(**b)
                rp.step()
                rp.synchronize()

        train(batches[:warmup])
        probe.reset()
        with SyncCounter(ctx.cuda) as clean:
            train(batches[warmup : warmup + steps])
        paths = probe.paths()
        probe.inject = True
        with SyncCounter(ctx.cuda) as control:
            train(batches[warmup + steps :])
        probe.inject = False
    added = control.count("engine") - clean.count("engine") * control_steps / steps
    return {
        "router_loss": config.router_aux_loss,
        "async": async_optimizer,
        "steps": steps,
        "engine_syncs_per_step": clean.count("engine") / steps,
        "model_syncs_per_step": clean.count("model") / steps,
        "by_location": clean.by_location(),
        "paths": paths,
        "control": {
            "injected": probe.injected,
            "engine_syncs_added": added,
            # None without CUDA: nothing is counted there
            "counted": probe.injected > 0 and added >= probe.injected if ctx.cuda else None,
            "by_location": control.by_location(),
        },
    }


def check_host_syncs(ctx: Context) -> Result:
    """Host syncs per steady step of a split plan, dense and MoE; an injected ``.item()`` must count."""
    allowed = ctx.max_syncs if ctx.max_syncs is not None else ENGINE_SYNCS_PER_STEP
    runs: dict[str, tuple[str, bool]] = {"llama_sync": ("llama", False), "llama_async": ("llama", True)}
    runs.update({f: (f, False) for f in MOE_FAMILIES})
    if not ctx.cuda:  # the hooks and plans only: nothing is counted without CUDA
        runs = {k: runs[k] for k in ("llama_sync", MOE_FAMILIES[0])}
    figures: dict[str, Any] = {"allowed_engine_syncs_per_step": allowed, "plan": SPLIT_PLAN, "workers": 2}
    status, problems, summary = "PASS", [], []
    for name, (family, async_optimizer) in runs.items():
        run = sync_run(ctx, family, async_optimizer=async_optimizer)
        figures[name] = run
        paths = run["paths"]
        missing = [k for k in ("forward", "fused", "backward") if not paths["stage_inputs"].get(k)]
        missing += [k for k in ("activation_handoffs", "prefetches") if not paths[k]]
        if missing:
            status = "FAIL"
            problems.append(f"{name}: the plan exercised no {', '.join(missing)}")
        if not run["control"]["injected"]:
            status = "FAIL"
            problems.append(f"{name}: the control's .item() was never injected (the engine changed)")
        if not ctx.cuda:
            continue
        control = run["control"]
        if not control["counted"]:
            status = "FAIL"
            problems.append(
                f"{name}: the .item() injected on a worker was not counted "
                f"({control['engine_syncs_added']:g} added for {control['injected']}): the count is blind"
            )
        per_step = run["engine_syncs_per_step"]
        if per_step > allowed:
            status = "FAIL"
            top = ", ".join(list(run["by_location"])[:3])
            problems.append(f"{name}: {per_step:g} engine syncs per step (allowed {allowed}): {top}")
        model = f" + {run['model_syncs_per_step']:g} the model's" if run["model_syncs_per_step"] else ""
        summary.append(f"{name} {per_step:g}{model}")
    if problems:
        return Result(status, "; ".join(problems), figures)
    if not ctx.cuda:
        injected = sum(figures[k]["control"]["injected"] for k in runs)
        prefetches = sum(figures[k]["paths"]["prefetches"] for k in runs)
        return Result(
            "SKIP",
            "no GPU (--cpu): torch.cuda.set_sync_debug_mode needs CUDA; the split plans ran "
            f"({prefetches} prefetches) with the control injected {injected} times",
            figures,
        )
    return Result(
        "PASS",
        f"engine syncs per step (allowed {allowed}): {', '.join(summary)}; the injected .item() counted",
        figures,
    )


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


class _Numbers:
    """A stand-in tokenizer for the decoder's text: token ids as numbers."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def check_inference(ctx: Context) -> Result:
    """The batching decoder against ``model.generate``, greedy, and its decode tokens/s."""
    from engine.inference.batching import Ask, Batcher, End, Model, Token
    from engine.inference.chat import Sampling

    if ctx.cuda:  # ~200M parameters in bfloat16
        size = dict(hidden=1024, layers=12, vocab=32000, inter=2816, heads=16, kv=8, seq=4096)
        dtype, new, lengths = torch.bfloat16, 96, (17, 64, 200, 5)
    else:
        size = dict(hidden=64, layers=2, vocab=512, inter=128, heads=4, kv=2, seq=256)
        dtype, new, lengths = torch.float32, 12, (7, 20, 33, 3)
    module = small_llama(**size).to(ctx.device, dtype).eval()
    module.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, size["vocab"], (n,), generator=g).tolist() for n in lengths]

    def generated(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=ctx.device)
        with torch.no_grad():
            out = module.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return [int(t) for t in out[0, len(ids) :]]

    batcher, model = Batcher().start(), Model(module, name="check")

    def decode(batch: list[list[int]]) -> tuple[list[list[int]], float]:
        answers: list[list[int]] = [[] for _ in batch]
        done = [threading.Event() for _ in batch]

        def emit_to(i: int) -> Callable[[Any], None]:
            def emit(event: Any) -> None:
                if isinstance(event, Token):
                    answers[i].append(event.token)
                elif isinstance(event, End):
                    done[i].set()

            return emit

        device_sync(ctx)
        t0 = time.perf_counter()
        for i, ids in enumerate(batch):
            batcher.submit(model, Ask(ids, Sampling(0.0, 1.0, new), _Numbers(), emit_to(i)))
        for event in done:
            if not event.wait(600):
                raise RuntimeError("the decoder did not finish")
        return answers, time.perf_counter() - t0

    try:
        references = [generated(p) for p in prompts]
        alone = [decode([p])[0][0] for p in prompts]
        decode(prompts)  # warm-up of the batched shapes
        together, batched_s = decode(prompts)
        single_s = sum(decode([p])[1] for p in prompts)
    finally:
        batcher.close()

    def agreeing(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    exact_alone = all(a == r for a, r in zip(alone, references, strict=True))
    exact_batched = all(t == r for t, r in zip(together, references, strict=True))
    tokens = new * len(prompts)
    figures = {
        "model": f"Llama {size['layers']} blocks x {size['hidden']} hidden, vocab {size['vocab']}",
        "parameters": sum(p.numel() for p in module.parameters()),
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_tokens": list(lengths),
        "new_tokens": new,
        "alone_equals_generate": exact_alone,
        "batched_equals_generate": exact_batched,
        "batched_tokens_before_first_difference": [
            agreeing(t, r) for t, r in zip(together, references, strict=True)
        ],
        "tokens_per_s_one_at_a_time": tokens / single_s,
        "tokens_per_s_four_batched": tokens / batched_s,
        "batched_over_sequential_time": batched_s / single_s,
    }
    batched, single = figures["tokens_per_s_four_batched"], figures["tokens_per_s_one_at_a_time"]
    speed = f"{batched:.0f} tokens/s batched, {single:.0f} one at a time"
    if not exact_alone:
        return Result("FAIL", "a greedy answer alone differs from model.generate", figures)
    if not exact_batched:  # padded batch shapes round differently in low precision
        return Result(
            "WARN",
            f"alone = generate; batched differs after {figures['batched_tokens_before_first_difference']}"
            f" tokens; {speed}",
            figures,
        )
    return Result("PASS", f"greedy = model.generate alone and batched; {speed}", figures)


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
    parser.add_argument(
        "--max-syncs",
        type=int,
        help=f"engine host syncs per step before host_syncs FAILs (default {ENGINE_SYNCS_PER_STEP})",
    )
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
        "lora_frozen_base": (lambda: check_lora_frozen_base(ctx), timeout),
        "base_4bit": (lambda: check_base_4bit(ctx), timeout),
        "dpo": (lambda: check_dpo(ctx), timeout),
        "evaluation": (lambda: check_evaluation(ctx), timeout),
        "round_size": (lambda: check_round_size(ctx), timeout),
        "router_loss": (lambda: check_router_loss(ctx), timeout),
        "cancel_close": (lambda: check_cancel_close(ctx, timeout), timeout),
        "memory": (lambda: check_memory(ctx), timeout),
        "host_syncs": (lambda: check_host_syncs(ctx), timeout),
        "throughput": (lambda: check_throughput(ctx), 2 * timeout),
        "inference": (lambda: check_inference(ctx), timeout),
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
