"""Scale on paper: 2 to 8 boxes of 8 RTX 4090s over 10 and 25 GbE, the paper's five models, LoRA and
full fine-tunes, sync and async, simulated with ``engine.scheduling.multibox``.

Every box runs RoundPipe (the paper's partition, physical mode) over its 8 GPUs with 16 micro-batches
a step; the boxes sum their fp32 gradients with a ring all-reduce priced by
``engine.scheduling.exchange`` at the link's nominal rate (``LINK_EFFICIENCY`` of it), and each box
updates its masters on its host at the planner's ``OPTIMIZER_PARAMS_PER_S``. Two ways to share the
work:

- ``fixed``: the job's batch stays 128 sequences of 2048 tokens and the boxes split it as the engine
  does (16 micro-batches on each box of ``8 / k`` sequences; one box runs 16 of 8): the per-layer
  times are the paper's (measured at 4 sequences) scaled by the rows, the first-order rule of
  ``simulate_boxes``;
- ``per-box``: every box runs the paper's measured micro-batches (16 of 4 x 2048 tokens), so the
  batch grows with the boxes (64 sequences a box).

The figure is the k-box job's tokens/s over one box's (one box with the whole batch for ``fixed``,
with its own 64 sequences for ``per-box``); it scales when it exceeds 0.9 k. Trainable weights come
from the models' config shapes (``bench/plan_speed.py``) through the planner: LoRA of rank 16 on the
repository's default targets (each family's own: the mixture-of-experts families adapt attention),
or every weight. Qwen3-235B-A22B runs LoRA only, as the paper timed it (a full fine-tune's host
state, about 3.8 TB, is no box's).

Writes ``bench/results/multibox_sim.json``, ``bench/results/multibox_sim.md`` and the figures'
section of ``docs/guides/several-boxes-scale.md`` (between its markers).

    python bench/multibox_sim.py [--data ../shared/data/paper-layer-times.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bubbles import DEFAULT_DATA  # noqa: E402
from bench.plan_speed import MODELS  # noqa: E402
from engine.planner.fit import trainable_per_layer  # noqa: E402
from engine.planner.report import OPTIMIZER_PARAMS_PER_S  # noqa: E402
from engine.planner.shapes import Shape  # noqa: E402
from engine.planner.workload import Workload  # noqa: E402
from engine.scheduling.exchange import LINK_EFFICIENCY, ROUND_LATENCY_S  # noqa: E402
from engine.scheduling.multibox import BoxStep, scaling, simulate_boxes  # noqa: E402
from engine.scheduling.simulate import plan_from_blocks, uniform_costs  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "guides" / "several-boxes-scale.md"
BOXES = range(1, 9)
LINKS_GBPS = (10.0, 25.0)
# a link so fast that only the update and the pipeline remain: what no network can beat
IDEAL_GBPS = 1e6
TUNINGS = ("lora", "full")
OPTIMIZERS = ("sync", "async")
SEQ_LEN = 2048
MEASURED_ROWS = 4  # sequences in the paper's timed micro-batch
FIXED_ROWS = 8  # sequences in one box's micro-batch of the fixed batch (1 on each of 8 boxes)
THRESHOLD = 0.9
LORA_ONLY = {"Qwen3-235B-A22B-LoRA": "Qwen3-235B-A22B"}


def trainable(config: dict[str, Any], tuning: str) -> int:
    return sum(trainable_per_layer(Shape.from_config(config), Workload(method=tuning)))


def points(md: dict[str, Any], *, params: int, n: int, m: int) -> dict[str, Any]:
    """Every (batch, link, optimizer, boxes) step of one model and tuning."""
    plan = plan_from_blocks(md["num_layers"], forward=md["partition_fwd"], backward=md["partition_bwd"])
    update_ms = params / OPTIMIZER_PARAMS_PER_S * 1e3
    out: dict[str, Any] = {}
    for batch, rows in (("fixed", FIXED_ROWS), ("per-box", MEASURED_ROWS)):
        scale = rows / MEASURED_ROWS
        costs = uniform_costs(
            md["num_layers"],
            fwd=md["fwd_layer"] * scale,
            bwd=md["bwd_layer"] * scale,
            head_fwd=md["head_fwd"] * scale,
            head_bwd=md["head_bwd"] * scale,
        )
        for link in (*LINKS_GBPS, IDEAL_GBPS):
            for opt in OPTIMIZERS:
                steps: list[BoxStep] = [
                    simulate_boxes(
                        costs,
                        boxes=k,
                        num_workers=n,
                        num_microbatches=m,
                        plan=plan,
                        hop=md["hop"] * scale,
                        trainable_params=params,
                        link_gbps=link,
                        update=update_ms,
                        async_optimizer=opt == "async",
                        batch=batch,
                        batch_rows=rows * m if batch == "fixed" else None,
                    )
                    for k in BOXES
                ]
                tokens_one = rows * m * SEQ_LEN  # the tokens of the costs' batch
                out[f"{batch}/{link:g}/{opt}"] = [
                    {
                        "boxes": s.boxes,
                        "iteration_s": s.iteration / 1e3,
                        "exchange_s": s.exchange / 1e3,
                        "update_s": s.update / 1e3,
                        "step_s": s.step / 1e3,
                        "exposed_s": s.exposed / 1e3,
                        "hidden": s.hidden,
                        "bytes_per_step": s.bytes_per_step,
                        "tokens_per_s": tokens_one * s.throughput * 1e3,
                        "over_one_box": scaling(steps[0], s),
                        "over_k": scaling(steps[0], s) / s.boxes,
                    }
                    for s in steps
                ]
    return out


def bold(row: dict[str, Any]) -> str:
    """A ratio, in bold when it exceeds ``THRESHOLD`` x k."""
    text = f"{row['over_one_box']:.2f}"
    return f"**{text}**" if row["over_k"] > THRESHOLD else text


def scales_to(rows: list[dict[str, Any]]) -> int:
    """The most boxes up to which every count exceeds ``THRESHOLD`` x k (1: not even 2)."""
    best = 1
    for r in rows[1:]:
        if r["over_one_box"] <= THRESHOLD * r["boxes"]:
            break
        best = r["boxes"]
    return best


def markdown_summary(runs: dict[str, Any]) -> list[str]:
    lines = [
        f"Most boxes k (of 2-8) up to which k boxes give more than {THRESHOLD} k times one box's "
        "tokens/s (1: not even two), and in brackets what 8 boxes give, as a multiple of one box's; "
        f"the last column prices the exchange at {IDEAL_GBPS:g} Gbit/s, leaving what no network removes "
        "(every box updates every weight it trains):",
        "",
    ]
    for batch, what in (
        ("fixed", "the job's batch fixed at 128 x 2048 tokens, split over the boxes"),
        ("per-box", "each box trains 64 x 2048 tokens a step, the batch grows with the boxes"),
    ):
        lines += [
            f"**{batch}** ({what}):",
            "",
            "| model | tuning | trained weights | gradients | 10 GbE sync | 10 GbE async "
            "| 25 GbE sync | 25 GbE async | no link cost, 8 boxes: sync / async |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, by_tuning in runs.items():
            for tuning, run in by_tuning.items():
                cells = []
                for link in LINKS_GBPS:
                    for opt in OPTIMIZERS:
                        rows = run["points"][f"{batch}/{link:g}/{opt}"]
                        cells.append(f"{scales_to(rows)} ({rows[-1]['over_one_box']:.2f}x)")
                ideal = [
                    run["points"][f"{batch}/{IDEAL_GBPS:g}/{opt}"][-1]["over_one_box"] for opt in OPTIMIZERS
                ]
                cells.append(" / ".join(f"{x:.2f}x" for x in ideal))
                lines.append(
                    f"| {name} | {tuning} | {run['trainable_params'] / 1e6:,.0f} M "
                    f"| {run['gradient_bytes'] / 1e9:.2f} GB | " + " | ".join(cells) + " |"
                )
        lines.append("")
    return lines


def markdown_ratios(runs: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for batch in ("fixed", "per-box"):
        for link in LINKS_GBPS:
            lines += [
                f"### {batch}, {link:g} GbE",
                "",
                "k boxes' tokens/s over one box's (**bold**: more than 0.9 k); one box's tokens/s; "
                "the exchange and the update in seconds at 8 boxes:",
                "",
                "| model | tuning | opt | one box tok/s | "
                + " | ".join(f"k={k}" for k in BOXES if k > 1)
                + " | exchange s (k=8) | iteration s (k=8) | update s |",
                "|---|---|---|---|" + "---|" * (len(BOXES) - 1) + "---|---|---|",
            ]
            for name, by_tuning in runs.items():
                for tuning, run in by_tuning.items():
                    for opt in OPTIMIZERS:
                        rows = run["points"][f"{batch}/{link:g}/{opt}"]
                        cells = [bold(r) for r in rows[1:]]
                        last = rows[-1]
                        lines.append(
                            f"| {name} | {tuning} | {opt} | {rows[0]['tokens_per_s']:,.0f} | "
                            + " | ".join(cells)
                            + f" | {last['exchange_s']:.2f} | {last['iteration_s']:.2f} "
                            + f"| {last['update_s']:.2f} |"
                        )
            lines.append("")
    return lines


def rules() -> list[str]:
    return [
        "How it is computed (`bench/multibox_sim.py`, `engine.scheduling.multibox`):",
        "",
        "- One box: 8 RTX 4090s, RoundPipe with the paper's partition in physical mode, 16 micro-batches "
        "a step, the paper's per-layer times (one RTX 4090, 4 x 2048 tokens a micro-batch); "
        "`fixed` scales them (and the activation hop) by the rows of a box's micro-batch, a first-order "
        "rule: a GPU runs small micro-batches less efficiently, so `fixed` is the best case of a split.",
        f"- Exchange: ring all-reduce of the fp32 gradients, 2 (k-1)/k of them sent per box, at "
        f"{LINK_EFFICIENCY:g} of the nominal rate, plus {ROUND_LATENCY_S * 1e6:g} µs a round "
        "(`engine.scheduling.exchange`).",
        f"- Update: every box updates all its masters, {OPTIMIZER_PARAMS_PER_S / 1e9:g} G parameters/s "
        "(the planner's rate); it does not shrink with more boxes.",
        "- Sync: a step is the box's iteration (fill and drain included), the exchange, and the update "
        "overlapping the next iteration layer by layer: exchange + max(iteration, update). Async "
        "(staleness 1): the steady period of chained iterations, the exchange and the update beside "
        "the next one: max(period, exchange + update).",
        "- The same per-layer times serve LoRA and full fine-tunes (the data has one set a model; a "
        "LoRA backward skips the frozen weights' gradients and is faster, which makes the exchange "
        "weigh a little more than shown). Host RAM and GPU memory are not checked here (the planner "
        "does).",
    ]


def write_section(name: str, lines: list[str]) -> bool:
    """Replace what stands between the doc's ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``
    markers with ``lines``; False when the doc or its markers are absent."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    if not DOC.exists():
        return False
    text = DOC.read_text()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + tail)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="paper-layer-times.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    n, m = data["setting"]["num_gpus"], data["setting"]["num_microbatches"]
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    for name, md in data["models"].items():
        config = MODELS[LORA_ONLY.get(name, name)]
        runs[name] = {}
        for tuning in ("lora",) if name in LORA_ONLY else TUNINGS:
            params = trainable(config, tuning)
            runs[name][tuning] = {
                "trainable_params": params,
                "gradient_bytes": params * 4,
                "points": points(md, params=params, n=n, m=m),
            }
            row = runs[name][tuning]["points"]
            print(
                f"{name:22s} {tuning:4s} scales to k = "
                + ", ".join(f"{key}: {scales_to(row[key])}" for key in sorted(row) if key.startswith("fixed"))
            )
    report = {
        "benchmark": "multibox_sim",
        "setting": {
            "gpus_per_box": n,
            "microbatches_per_box": m,
            "sequence_tokens": SEQ_LEN,
            "fixed_batch_sequences": FIXED_ROWS * m,
            "per_box_batch_sequences": MEASURED_ROWS * m,
            "boxes": list(BOXES),
            "links_gbps": list(LINKS_GBPS),
            "ideal_link_gbps": IDEAL_GBPS,
            "link_efficiency": LINK_EFFICIENCY,
            "round_latency_s": ROUND_LATENCY_S,
            "optimizer_params_per_s": OPTIMIZER_PARAMS_PER_S,
            "lora": {"rank": Workload().lora_r, "targets": "the family's defaults"},
            "mode": "physical",
            "threshold": THRESHOLD,
        },
        "seconds": time.perf_counter() - started,
        "models": runs,
        "scales_to": {
            name: {
                tuning: {key: scales_to(rows) for key, rows in run["points"].items()}
                for tuning, run in t.items()
            }
            for name, t in runs.items()
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multibox_sim.json").write_text(json.dumps(report, indent=2) + "\n")
    summary = markdown_summary(runs)
    md = [
        "# Several boxes, simulated: 2-8 boxes of 8 RTX 4090s",
        "",
        *summary,
        *markdown_ratios(runs),
        *rules(),
    ]
    (args.out / "multibox_sim.md").write_text("\n".join(md) + "\n")
    section = [
        "",
        "Generated by `python bench/multibox_sim.py` (from `bench/results/multibox_sim.json`; every "
        "ratio in `bench/results/multibox_sim.md`).",
        "",
        *summary,
        *rules(),
        "",
    ]
    doc = (
        "and " + str(DOC.relative_to(ROOT))
        if write_section("multibox_sim", section)
        else "(no doc markers found)"
    )
    print(f"wrote {args.out / 'multibox_sim.json'}, multibox_sim.md {doc}")


if __name__ == "__main__":
    main()
