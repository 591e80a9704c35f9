"""Pipeline bubbles of six schedules on the paper's five models, and our partitioner against the paper's.

Reads the per-layer timings and partitions the RoundPipe paper simulated (8 GPUs, 16 micro-batches)
and simulates every schedule with ``engine.scheduling.simulate`` in both modes:

- ``paper``: the rules of the paper's simulator (pre-work may run before its inputs, rounds of exactly
  N, each round starting on the GPU that frees up first);
- ``physical``: every op waits for its inputs and rounds rotate as the engine dispatches them.

RoundPipe runs with the paper's partition (``paper``) and with the partition
``engine.scheduling.partition_search.search_partition`` finds for the same mode (``ours``). Writes
``bench/results/bubbles.json`` (paper mode), ``bench/results/bubbles_physical.json`` (physical mode),
``bench/results/bubbles.md`` and a few timelines under ``bench/results/timelines/``.

    python bench/bubbles.py [--data ../shared/data/paper-layer-times.json] [--evaluations 600]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from engine.scheduling.partition import Plan
from engine.scheduling.partition_search import search_partition
from engine.scheduling.simulate import (
    SimResult,
    closed_form_bubble,
    layers_from_blocks,
    plan_from_blocks,
    simulate,
    timeline_svg,
    uniform_costs,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "paper-layer-times.json"
BOUND = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")
ROUNDPIPE = ("roundpipe-sync", "roundpipe-async", "roundpipe-async-steady")
MODES = ("paper", "physical")


def blocks_of(plan: Plan) -> tuple[list[int], list[int]]:
    """A plan in the data file's notation: forward blocks bottom-up; fused then backward blocks top-down."""
    c = plan.to_counts()
    forward, fused, backward = c["forward"], c["fused"], c["backward"]
    if not isinstance(forward, list) or not isinstance(backward, list) or not isinstance(fused, int):
        raise TypeError(f"unexpected plan counts {c}")
    if not forward:
        return [], [fused - 2]
    return [forward[0] - 1, *forward[1:]], [fused - 1, *backward[:-1], backward[-1] - 1]


def compact(counts: list[int]) -> str:
    """``[2, 2, 2, 1]`` -> ``"2×3, 1"``."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}×{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return ", ".join(out)


def run_model(name: str, md: dict[str, Any], *, n: int, m: int, evaluations: int) -> dict[str, Any]:
    costs = uniform_costs(
        md["num_layers"],
        fwd=md["fwd_layer"],
        bwd=md["bwd_layer"],
        head_fwd=md["head_fwd"],
        head_bwd=md["head_bwd"],
    )
    hop = md["hop"]
    paper_plan = plan_from_blocks(md["num_layers"], forward=md["partition_fwd"], backward=md["partition_bwd"])
    out: dict[str, Any] = {"plans": {}, "results": {}, "search_s": {}}
    for mode in MODES:
        started = time.perf_counter()
        plans = {"paper": paper_plan}
        for objective, budget in (("sync", evaluations), ("steady", max(1, evaluations // 3))):
            plans[f"ours-{objective}"] = search_partition(
                costs,
                num_workers=n,
                num_microbatches=m,
                hop=hop,
                mode=mode,
                objective=objective,
                max_evaluations=budget,
            )
        out["search_s"][mode] = time.perf_counter() - started
        out["plans"][mode] = plans
        results: dict[str, dict[str, SimResult]] = {}
        for schedule in BOUND:
            key = "v1" if schedule in ("gpipe", "1f1b") else "looped"
            stages = layers_from_blocks(md["partition_bound"][key])
            results[schedule] = {
                "paper": simulate(
                    schedule, costs, num_workers=n, num_microbatches=m, hop=hop, stages=stages, mode=mode
                )
            }
        for schedule in ROUNDPIPE:
            ours = plans["ours-steady" if schedule == "roundpipe-async-steady" else "ours-sync"]
            results[schedule] = {
                label: simulate(
                    schedule, costs, num_workers=n, num_microbatches=m, hop=hop, plan=plan, mode=mode
                )
                for label, plan in (("paper", paper_plan), ("ours", ours))
            }
        out["results"][mode] = results
    return out


def to_json(runs: dict[str, dict[str, Any]], mode: str) -> dict[str, Any]:
    return {
        name: {
            schedule: {
                label: {"bubble": round(r.bubble, 6), "makespan_ms": round(r.makespan, 3)}
                for label, r in by_label.items()
            }
            for schedule, by_label in run["results"][mode].items()
        }
        for name, run in runs.items()
    }


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def markdown(runs: dict[str, dict[str, Any]], *, n: int, m: int, evaluations: int) -> str:
    lines = [
        "# Pipeline bubbles: six schedules, five models",
        "",
        f"Written by `bench/bubbles.py` from the per-layer timings and partitions of the RoundPipe paper "
        f"(one RTX 4090, micro-batch 4 × 2048 tokens), simulated for N = {n} GPUs and M = {m} micro-batches "
        "per iteration with `engine.scheduling.simulate`. Bubble = idle ÷ (N × makespan). JSON: "
        "`bubbles.json` (paper mode) and `bubbles_physical.json` (physical mode).",
        "",
        "With the paper's partitions, paper mode reproduces the bubble ratios and makespans published with "
        "the paper's simulator for all five models and six schedules (RoundPipe async as defined there). "
        "RP = RoundPipe; *paper* = the paper's partition, *ours* = our partitioner's (same mode and rules).",
        "",
    ]
    for mode in MODES:
        lines += [f"## {mode.capitalize()} mode", "", "Bubble ratio (makespan in ms below each):", ""]
        head = "| model | GPipe | 1F1B | Interleaved-1F1B | Looped-BFS | RP sync (paper) | RP sync (ours) "
        head += "| closed form (paper S / ours S) | RP async (paper) | RP async (ours) "
        head += "| RP steady (paper / ours) |"
        lines += [head, "|" + "---|" * 11]
        for name, run in runs.items():
            res = run["results"][mode]
            plans = run["plans"][mode]
            cf = [
                closed_form_bubble(num_workers=n, num_microbatches=m, num_slots=plans[p].num_slots)
                for p in ("paper", "ours-sync")
            ]
            row = [name]
            row += [f"{pct(res[s]['paper'].bubble)}<br>{res[s]['paper'].makespan:.0f}" for s in BOUND]
            row += [
                f"{pct(res['roundpipe-sync'][p].bubble)}<br>{res['roundpipe-sync'][p].makespan:.0f}"
                for p in ("paper", "ours")
            ]
            row.append(f"{pct(cf[0])} / {pct(cf[1])}")
            row += [pct(res["roundpipe-async"][p].bubble) for p in ("paper", "ours")]
            steady = res["roundpipe-async-steady"]
            row.append(
                f"{pct(steady['paper'].bubble)} / {pct(steady['ours'].bubble)}<br>"
                f"{steady['paper'].makespan:.0f} / {steady['ours'].makespan:.0f}"
            )
            lines.append("| " + " | ".join(row) + " |")
        lines += [
            "",
            "Our partitioner against the paper's partition (RoundPipe, same mode, same rules): makespan "
            "of one sync iteration and the steady-state period of the async pipeline.",
            "",
            "| model | sync paper ms | sync ours ms | ratio | steady paper ms | steady ours ms | ratio "
            "| S paper / ours sync / ours steady | search s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, run in runs.items():
            res = run["results"][mode]
            plans = run["plans"][mode]
            sp, so = res["roundpipe-sync"]["paper"].makespan, res["roundpipe-sync"]["ours"].makespan
            tp, to = (
                res["roundpipe-async-steady"]["paper"].makespan,
                res["roundpipe-async-steady"]["ours"].makespan,
            )
            lines.append(
                f"| {name} | {sp:.1f} | {so:.1f} | {so / sp:.4f} | {tp:.1f} | {to:.1f} | {to / tp:.4f} "
                f"| {' / '.join(str(plans[p].num_slots) for p in ('paper', 'ours-sync', 'ours-steady'))} "
                f"| {run['search_s'][mode]:.1f} |"
            )
        lines += ["", "Our partitions, in blocks (forward bottom-up | fused blocks | backward top-down):", ""]
        for name, run in runs.items():
            for objective in ("sync", "steady"):
                f, b = blocks_of(run["plans"][mode][f"ours-{objective}"])
                lines.append(f"- {name}, {objective}: {compact(f)} | {b[0]} | {compact(b[1:])}")
        lines.append("")
    lines += RULES.format(evaluations=evaluations, steady=max(1, evaluations // 3)).splitlines()
    return "\n".join(lines) + "\n"


RULES = """## Rules

Common to both modes: every decoder block costs the same forward and backward time (backward excludes
the recompute, which costs one forward); the output layer (final norm, LM head, loss) has its own
forward and backward time, and the input layer costs nothing. A hop latency is added to every
dependency between two different GPUs (never on the same GPU); it occupies no GPU and no link. Each
GPU runs its ops one at a time in a fixed order, each as soon as its GPU and its inputs allow.
Forward, recompute, head and backward all count as busy time. An empty stage forwards its hops but
adds no time.

- **Stage-bound schedules** (GPipe, 1F1B, Interleaved-1F1B, Looped-BFS) use the data file's
  `partition_bound` (stage *s* on GPU *s* mod N); a backward recomputes its stage (not the LM head)
  after its gradient arrives. 1F1B and Interleaved-1F1B follow PyTorch's per-rank orders. Their
  weights stay on their GPUs, so both modes give the same figures.
- **RoundPipe** slots (forward stages, the fused stage, backward stages) are dispatched by the
  engine's own `build_schedule`: slot *i* of a round runs on GPU (g0 + *i*) mod N over the round's
  micro-batches. A backward stage waits for the stage above it and for the last forward stage.
- **Paper mode** (the rules of the paper's simulator): rounds of exactly N micro-batches; each
  round starts on the GPU whose last op ends first; the fused stage's LM-head forward and a backward
  stage's recompute are pre-work that needs only an idle GPU, placed to end exactly when the main
  part can start, even before its inputs have arrived.
- **Physical mode**: pre-work waits for its inputs (the head forward for the last forward stage's
  output, a recompute for its checkpointed stage input); rounds of N micro-batches start at
  (g0 + S) mod N, as the engine dispatches them. No weights are uploaded here (the data file has no
  parameter sizes); the simulator models uploads when given parameter bytes and a link bandwidth.
- **RP async** leaves each GPU's fill (before its first op) and drain (after its last backward) out
  of the sync timeline's idle time, over the same denominator N × sync makespan. **RP steady**
  chains 8 iterations with no flush and measures the period and idle share of the last 4. A plan with
  a larger fused stage skips the recompute of its blocks, so it can have a shorter period and yet a
  larger idle share.
- **Closed form**: N(N−1) ÷ (M·S + N(N−1)) for S slots per round; it assumes equal slots and no hop.
- **Ours**: `search_partition` starts from the closed-form-optimal plan of `auto_partition`, scans
  balanced plans by their numbers of forward and backward stages, then moves single stage boundaries
  while the simulated time under the same mode drops. It never sees the paper's partition. RP sync
  and RP async use the plan minimising one iteration's makespan (at most {evaluations} simulations
  per model and mode); RP steady the plan minimising the steady period (at most {steady}).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="paper-layer-times.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--evaluations", type=int, default=600, help="simulations per partition search")
    parser.add_argument(
        "--timelines", default="Qwen3-1.7B", help="model whose paper-mode timelines are drawn ('' for none)"
    )
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    n, m = data["setting"]["num_gpus"], data["setting"]["num_microbatches"]
    runs: dict[str, dict[str, Any]] = {}
    for name, md in data["models"].items():
        runs[name] = run_model(name, md, n=n, m=m, evaluations=args.evaluations)
        for mode in MODES:
            res = runs[name]["results"][mode]["roundpipe-sync"]
            paper, ours = res["paper"].makespan, res["ours"].makespan
            print(
                f"{name:24s} {mode:8s} RP sync paper {paper:10.1f} ms, ours {ours:10.1f} ms, "
                f"ratio {ours / paper:.4f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bubbles.json").write_text(json.dumps(to_json(runs, "paper"), indent=2) + "\n")
    (args.out / "bubbles_physical.json").write_text(json.dumps(to_json(runs, "physical"), indent=2) + "\n")
    (args.out / "bubbles.md").write_text(markdown(runs, n=n, m=m, evaluations=args.evaluations))
    if args.timelines:
        folder = args.out / "timelines"
        folder.mkdir(exist_ok=True)
        res = runs[args.timelines]["results"]["paper"]
        for schedule in (*BOUND, "roundpipe-sync"):
            for label, r in res[schedule].items():
                title = (
                    f"{args.timelines} {schedule} ({label} partition, paper mode): "
                    f"bubble {pct(r.bubble)}, makespan {r.makespan:.0f} ms"
                )
                (folder / f"{args.timelines}_{schedule}_{label}.svg").write_text(timeline_svg(r, title=title))
    print(f"wrote {args.out / 'bubbles.md'}")


if __name__ == "__main__":
    main()
