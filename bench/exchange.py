"""The gradient exchange of a job on several boxes, measured here: gloo all-reduces between 2 and 3
processes on this machine, against ``engine.scheduling.exchange``'s price of the same bytes.

Each process joins a torch.distributed gloo group through a TCP store on a free port (rank 0
holds it, as a job's rank 0 holds the rendezvous) and sums fp32 buffers of several sizes in place,
as the boxes sum their gradients before a step. Every repeat starts after a barrier; its time is
the slowest process's. Per size: the median and the spread, the bytes each process sends (a ring
sends ``2 (k - 1) / k`` times the buffer), the achieved Gbit/s, and the planner's time
(``exchange_seconds(..., measured=True)``) at the rate of a line ``fixed + bytes / rate`` fitted
to each size's fastest repeat, so the small buffers show a call's fixed cost next to the planner's
per-round latency. A second table sends the same bytes cut into many tensors, one all-reduce
each, as gradients sent in pieces go (the engine sends one flat block per layer).

The processes talk over the loopback interface and share this machine's cores and memory: the
rates are a memory-copy rate, not a network's, and say nothing about a LAN (see the notes in the
results).

    python bench/exchange.py [--sizes-mb 1 4 8 16 64 128] [--repeats 7] [--worlds 2 3]

Results: ``bench/results/exchange.json``, and a table of them in
``docs/guides/several-boxes-scale.md`` (between its ``exchange`` markers).
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

from bench.multibox_sim import DOC, write_section  # noqa: E402
from engine.scheduling.exchange import GBIT, ROUND_LATENCY_S, exchange_seconds, ring_bytes  # noqa: E402

MB = 1 << 20
SPLIT_MB = 16  # the buffer cut into many tensors
NOTES = [
    "Loopback is not a LAN: the processes share this machine's cores and memory, so the rates here "
    "are what gloo's ring achieves through the kernel's loopback and memory copies, not what a "
    "10 or 25 GbE link between two boxes gives. On a LAN the link is the bottleneck; the engine "
    "measures it at the start of every job (the 'boxes' event's link_gbps) and the planner "
    "prices a nominal link at engine.scheduling.exchange.LINK_EFFICIENCY of its rate.",
    "With 3 processes on a machine of fewer cores, the ranks take turns on the cores: the 3-process "
    "figures are lower than a ring of 3 boxes would give for that reason alone.",
    "predicted_s is engine.scheduling.exchange.exchange_seconds (measured=True) at the rate fitted to "
    "each size's fastest repeat (seconds = fixed + bytes sent / rate, least squares: link_gbps_fit, "
    "fixed_s_fit), with the planner's own per-round latency (ROUND_LATENCY_S, a LAN's: "
    "fixed_s_planner); min_over_predicted near 1 says the bytes model (2(k-1)/k of the buffer per "
    "process) holds, a rise for the small buffers shows a fixed cost per all-reduce above the "
    "planner's, and median_over_predicted adds what other work on the machine cost.",
    "This machine is shared: the load averages before and after are in the results, and the "
    "medians move by tens of percent between runs when other work runs.",
    "split: the same bytes in many tensors, one all-reduce each: every call pays the fixed cost "
    "again. So the engine packs the optimizer units' gradient blocks into buckets of up to "
    "32 MiB (engine.distributed.group.BUCKET_BYTES), one all-reduce each: a LoRA adapter's "
    "gradients in one to a few calls, a full fine-tune's about one call per 32 MiB.",
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
    rate, fixed = fit(sizes)
    for row in sizes:
        row["predicted_s"] = exchange_seconds(row["bytes"], world, rate, measured=True)
        row["median_over_predicted"] = row["seconds_median"] / row["predicted_s"]
        row["min_over_predicted"] = row["seconds_min"] / row["predicted_s"]
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
    return {
        "processes": world,
        "link_gbps_fit": rate,
        "fixed_s_fit": fixed,
        "fixed_s_planner": 2 * (world - 1) * ROUND_LATENCY_S,
        "sizes": sizes,
        "split": split,
    }


def fit(sizes: list[dict[str, Any]]) -> tuple[float, float]:
    """The rate (Gbit/s) and fixed cost (s) of ``seconds = fixed + bytes sent / rate``, fitted by
    least squares to each size's fastest repeat (the one other work on the machine slowed least);
    the largest buffer's rate alone when the fit has no slope."""
    xs = [r["bytes_sent_per_process"] for r in sizes]
    ys = [r["seconds_min"] for r in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if slope <= 0:
        return sizes[-1]["gbps"], 0.0
    return 1 / slope / GBIT, my - slope * mx


def doc_section(report: dict[str, Any]) -> list[str]:
    """The measured figures as the doc shows them."""
    m = report["machine"]
    lines = [
        "",
        f"Generated by `python bench/exchange.py` (from `bench/results/exchange.json`): gloo all-reduces of "
        f"fp32 buffers between processes of one machine ({m['cpu_count']} cores, {m['processor']}, torch "
        f"{report['versions']['torch']}), the median of {report['repeats']}; predicted: "
        "`exchange_seconds` at the rate fitted to each size's fastest repeat.",
        "",
        "| processes | fitted rate Gbit/s | fitted fixed cost ms | planner's latency ms |",
        "|---|---|---|---|",
        *(
            f"| {w['processes']} | {w['link_gbps_fit']:.2f} | {w['fixed_s_fit'] * 1e3:.2f} "
            f"| {w['fixed_s_planner'] * 1e3:.2f} |"
            for w in report["worlds"]
        ),
        "",
        "| processes | buffer MB | bytes each sends | median ms | Gbit/s each sends | fastest ms "
        "| fastest / predicted | median / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in report["worlds"]:
        for row in w["sizes"]:
            lines.append(
                f"| {w['processes']} | {row['mb']} | {row['bytes_sent_per_process'] / MB:.1f} MB "
                f"| {row['seconds_median'] * 1e3:.1f} | {row['gbps']:.2f} "
                f"| {row['seconds_min'] * 1e3:.1f} | {row['min_over_predicted']:.2f} "
                f"| {row['median_over_predicted']:.2f} |"
            )
    lines += [
        "",
        f"The same {SPLIT_MB} MB in many tensors, one all-reduce each:",
        "",
        "| processes | tensors | median ms | over one tensor | ms a call |",
        "|---|---|---|---|---|",
    ]
    for w in report["worlds"]:
        for row in w["split"]:
            lines.append(
                f"| {w['processes']} | {row['tensors']} | {row['seconds_median'] * 1e3:.1f} "
                f"| {row['over_one_tensor']:.2f} | {row['per_call_s'] * 1e3:.2f} |"
            )
    return [*lines, "", *(f"- {note}" for note in report["notes"]), ""]


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
                f"{row['median_over_predicted']:.3f}"
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
    doc = f" and {DOC.relative_to(ROOT)}" if write_section("exchange", doc_section(report)) else ""
    print(f"wrote {args.out}{doc}")


if __name__ == "__main__":
    main()
