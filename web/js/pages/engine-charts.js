// The job page's engine cards: where a step's time goes besides compute. Pipeline: each worker's
// idle time between iterations and its waits for weights and activations (seconds per worker per
// step), with the idle share of the step period and the prefetch hit rate; Transfers: the GB/s
// achieved each way; Optimizer: the seconds of its phases per step.

import { el, number } from "../widgets.js";

const CARDS = [
  {
    id: "pipeline-chart",
    title: "Pipeline (s per worker)",
    hint: "Each worker's idle time between iterations, and how long its compute waited for weights and for activations, per step.",
    ylabel: "seconds",
    lines: [
      ["idle between iterations", "pipeline/idle_between_s"],
      ["waiting for weights", "time/wait/weights_s"],
      ["waiting for activations", "time/wait/activations_s"],
    ],
  },
  {
    id: "transfer-chart",
    title: "Transfers (GB/s)",
    hint: "Bytes copied each way over the time the copies were in flight.",
    ylabel: "GB/s",
    lines: [
      ["host → device", "transfer/h2d_gbps"],
      ["device → host", "transfer/d2h_gbps"],
    ],
  },
  {
    id: "optimizer-chart",
    title: "Optimizer phases (s)",
    hint: "The CPU optimizer's time per step: adding the gradients up, their norm, the update, and the copy in the compute dtype.",
    ylabel: "seconds",
    lines: [
      ["fold", "time/optimizer/fold_s"],
      ["norm", "time/optimizer/norm_s"],
      ["update", "time/optimizer/update_s"],
      ["copy", "time/optimizer/copy_s"],
    ],
  },
];

const percent = (v) => `${number(100 * v)}%`;

// The cards, `take(e)` for a metrics event, `draw()` to redraw the charts.
export function engineCharts() {
  const series = Object.fromEntries(CARDS.flatMap((c) => c.lines.map(([, key]) => [key, []])));
  const charts = CARDS.map((c) =>
    el("rh-line-chart", {
      id: c.id,
      label: c.title,
      xlabel: "step",
      ylabel: c.ylabel,
      zero: true,
      empty: "no step logged yet",
    }),
  );
  const idleShare = el("span", { id: "idle-between-ratio", text: "–" });
  const prefetch = el("span", { id: "prefetch-hit-rate", text: "–" });
  const cards = CARDS.map((c, i) =>
    el(
      "section",
      { class: "card" },
      el("h2", { text: c.title }),
      el("p", { class: "hint", text: c.hint }),
      charts[i],
      ...(c.id === "pipeline-chart"
        ? [
            el(
              "dl",
              { class: "stats" },
              el("div", {}, el("dt", { text: "idle between iterations" }), el("dd", {}, idleShare)),
              el("div", {}, el("dt", { text: "prefetch hits" }), el("dd", {}, prefetch)),
            ),
          ]
        : []),
    ),
  );
  return {
    cards,
    take(e) {
      const d = e.data;
      for (const key of Object.keys(series)) if (key in d) series[key].push([e.step, d[key]]);
      if ("pipeline/idle_between_ratio" in d) idleShare.textContent = percent(d["pipeline/idle_between_ratio"]);
      if ("pipeline/prefetch_hit_rate" in d) prefetch.textContent = percent(d["pipeline/prefetch_hit_rate"]);
    },
    draw() {
      CARDS.forEach((c, i) => charts[i].setSeries(c.lines.map(([name, key]) => ({ name, points: series[key] }))));
    },
  };
}
