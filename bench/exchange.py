"""The gradient exchange of a job on several boxes, measured here: gloo all-reduces between 2 and 3
processes on this machine, against ``engine.planner.exchange``'s price of the same bytes.

Each process joins a torch.distributed gloo group through a TCP store on a free port (rank 0
holds it, as a job's rank 0 holds the rendezvous) and sums fp32 buffers of several sizes in place,
as the boxes sum their gradients before a step. Every repeat starts after a barrier; its time is
the slowest process's. Per size: the median and the spread, the bytes each process sends (a ring
sends ``2 (k - 1) / k`` times the buffer), the achieved Gbit/s, and the planner's time at the rate
the largest buffer achieved (``exchange_seconds(..., measured=True)``), so the small buffers show
what the per-round latency costs. A second table sends the same bytes cut into many tensors, one
all-reduce each, as a LoRA adapter's hundreds of small gradients would go without bucketing.

The processes talk over the loopback interface and share this machine's cores and memory: the
rates are a memory-copy rate, not a network's, and say nothing about a LAN (see the notes in the
results).

    python bench/exchange.py [--sizes-mb 1 4 8 16 64 128] [--repeats 7] [--worlds 2 3]

Results: ``bench/results/exchange.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.planner.exchange import GBIT, ROUND_LATENCY_S, exchange_seconds, ring_bytes  # noqa: E402

MB = 1 << 20
SPLIT_MB = 16  # the buffer cut into many tensors
NOTES = [
    "Loopback is not a LAN: the processes share this machine's cores and memory, so the rates here "
    "are what gloo's ring achieves through the kernel's loopback and memory copies, not what a "
    "10 or 25 GbE link between two boxes gives. On a LAN the link is the bottleneck; the engine "
    "measures it at the start of every job (the 'boxes' event's link_gbps) and the planner "
    "prices a nominal link at engine.planner.exchange.LINK_EFFICIENCY of its rate.",
    "With 3 processes on a machine of fewer cores, the ranks take turns on the cores: the 3-process "
    "figures are lower than a ring of 3 boxes would give for that reason alone.",
    "predicted_s is engine.planner.exchange.exchange_seconds at the rate the largest buffer "
    "achieved (measured=True), including its per-round latency of ROUND_LATENCY_S (a LAN's); "
    "measured_over_predicted near 1 for the large buffers checks the bytes model (2(k-1)/k of the "
    "buffer per process), and its rise for the small ones shows the fixed cost of one all-reduce "
    "here.",
    "split: the same bytes in many tensors, one all-reduce each: every call pays the fixed cost "
    "again, which is what a LoRA adapter's hundreds of small gradient tensors pay unless they go "
    "in one flat buffer.",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def timed(group_sizes: list[int], repeats: int, world: int) -> list[float]:
    """Seconds of each repeat of all-reducing one fp32 tensor of each of ``group_sizes`` bytes in
    turn, the slowest rank's."""
    tensors = [torch.ones(n // 4, dtype=torch.float32) for n in group_sizes]
    for t in tensors:  # warm-up: gloo's pairs connect and its buffers are allocated
        dist.all_reduce(t)
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.all_reduce(t)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        out.append(float(took.item()))
    del tensors
    return out


def worker(rank: int, world: int, port: int, plan: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        sizes = {str(mb): timed([mb * MB], plan["repeats"], world) for mb in plan["sizes_mb"]}
        split = {
            str(count): timed([SPLIT_MB * MB // count] * count, plan["repeats"], world)
            for count in plan["split_counts"]
        }
        if rank == 0:
            results.put({"sizes": sizes, "split": split})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(world: int, plan: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, plan, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        raw: dict[str, Any] = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"{world} processes: exit codes {bad}")
    return raw


def summarise(world: int, raw: dict[str, Any]) -> dict[str, Any]:
    sizes = []
    for mb, times in raw["sizes"].items():
        nbytes = int(mb) * MB
        med = statistics.median(times)
        sent = ring_bytes(nbytes, world)
        sizes.append(
            {
                "mb": int(mb),
                "bytes": nbytes,
                "seconds_median": med,
                "seconds_min": min(times),
                "seconds_max": max(times),
                "bytes_sent_per_process": sent,
                "gbps": sent / med / GBIT,
                "repeats": times,
            }
        )
    rate = sizes[-1]["gbps"]  # the largest buffer's: the rate the link reaches
    for row in sizes:
        row["predicted_s"] = exchange_seconds(row["bytes"], world, rate, measured=True)
        row["measured_over_predicted"] = row["seconds_median"] / row["predicted_s"]
    split = []
    one_tensor = statistics.median(raw["split"]["1"]) if "1" in raw["split"] else None
    for count, times in raw["split"].items():
        med = statistics.median(times)
        split.append(
            {
                "tensors": int(count),
                "mb_total": SPLIT_MB,
                "seconds_median": med,
                "over_one_tensor": med / one_tensor if one_tensor else None,
                "per_call_s": med / int(count),
                "repeats": times,
            }
        )
    return {"processes": world, "link_gbps_measured": rate, "sizes": sizes, "split": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 8, 16, 64, 128])
    parser.add_argument("--split-counts", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "exchange.json")
    args = parser.parse_args()
    for name, values in (("--sizes-mb", args.sizes_mb), ("--split-counts", args.split_counts)):
        if any(v < 1 for v in values):
            parser.error(f"{name}={values}: every value must be >= 1")
    if any(w < 2 for w in args.worlds):
        parser.error(f"--worlds={args.worlds}: an exchange needs at least 2 processes")
    if any((SPLIT_MB * MB) % (c * 4) for c in args.split_counts):
        parser.error(f"--split-counts={args.split_counts}: each must cut {SPLIT_MB} MB into whole floats")
    plan = {"sizes_mb": sorted(args.sizes_mb), "split_counts": args.split_counts, "repeats": args.repeats}
    load_before = os.getloadavg()
    started = time.perf_counter()
    worlds = []
    for world in args.worlds:
        w = summarise(world, measure(world, plan))
        worlds.append(w)
        for row in w["sizes"]:
            print(
                f"{world} processes {row['mb']:5d} MB: {row['seconds_median'] * 1e3:9.2f} ms median, "
                f"{row['gbps']:6.2f} Gbit/s sent per process, measured/predicted "
                f"{row['measured_over_predicted']:.3f}"
            )
        for row in w["split"]:
            print(
                f"{world} processes {SPLIT_MB} MB in {row['tensors']:4d} tensors: "
                f"{row['seconds_median'] * 1e3:9.2f} ms ({row['over_one_tensor']:.2f}x one tensor)"
            )
    report = {
        "benchmark": "exchange",
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gloo": dist.is_gloo_available(),
        },
        "interface": "loopback (127.0.0.1)",
        "dtype": "float32",
        "repeats": args.repeats,
        "round_latency_s_planner": ROUND_LATENCY_S,
        "seconds_total": time.perf_counter() - started,
        "worlds": worlds,
        "notes": NOTES,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
