// Compare (#/compare/<id>,<id>[,...]): 2 to 6 jobs side by side: their loss, validation loss and
// throughput overlaid on a common step or token axis, the config rows that differ (and only
// those), and the final metrics and evaluation results in one table. Reached from the jobs list
// (select several) and from a sweep.

import { api } from "../api.js";
import { el, errorBox, number, statusBadge } from "../widgets.js";

const KEYS = ["loss/train", "loss/val", "accuracy/val", "throughput/tokens_per_s", "tokens/batch"];
const FINAL = [
  ["loss/train", "Final train loss"],
  ["loss/val", "Final validation loss"],
  ["accuracy/val", "Final validation token accuracy"],
  ["throughput/tokens_per_s", "Tokens/s (last)"],
];
const CHARTS = [
  ["loss/train", "Train loss", "loss"],
  ["loss/val", "Validation loss", "loss"],
  ["throughput/tokens_per_s", "Throughput", "tokens/s"],
];
// fields every job has its own value of: left out of the differences
const OWN = ["output_dir", "data.train", "data.validation", "model.path"];

// a nested config as "section.field" -> value text
function flat(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) flat(v, prefix ? `${prefix}.${k}` : k, out);
  } else out[prefix] = JSON.stringify(value);
  return out;
}

// the steps' cumulative tokens (of their batches): the token axis
function tokenAxis(series) {
  const at = new Map();
  let total = 0;
  for (const p of series["tokens/batch"] || []) {
    total += p.value;
    at.set(p.step, total);
  }
  return at;
}

export async function render(main, ids) {
  const jobIds = [...new Set((ids || "").split(",").filter(Boolean))];
  const axis = el(
    "select",
    { id: "compare-axis" },
    el("option", { value: "step", text: "step" }),
    el("option", { value: "tokens", text: "tokens trained" }),
  );
  main.append(el("div", { class: "title-row" }, el("h1", { text: "Compare jobs" })));
  if (jobIds.length < 2 || jobIds.length > 6) {
    main.append(
      el("p", { class: "error", id: "compare-error", text: `Compare takes 2 to 6 jobs (got ${jobIds.length}).` }),
    );
    return null;
  }
  let runs;
  try {
    runs = await Promise.all(
      jobIds.map(async (id) => {
        const [job, metrics, evaluations] = await Promise.all([
          api(`/jobs/${id}`),
          api(`/jobs/${id}/metrics`, { query: { keys: KEYS } }),
          api(`/jobs/${id}/evaluations`),
        ]);
        return { job, series: metrics.data, evaluations: evaluations.data };
      }),
    );
  } catch (err) {
    main.append(errorBox(err));
    return null;
  }

  const charts = CHARTS.map(([key, label, ylabel]) => {
    const chart = el("rh-line-chart", { id: `compare-${key.replace(/[^a-z0-9]+/gi, "-")}`, label, ylabel });
    return { key, label, chart };
  });
  function draw() {
    for (const { key, chart } of charts) {
      chart.setAttribute("xlabel", axis.value === "tokens" ? "tokens trained" : "step");
      chart.setSeries(
        runs.map(({ job, series }) => {
          const tokens = tokenAxis(series);
          const points = (series[key] || [])
            .map((p) => [axis.value === "tokens" ? tokens.get(p.step) : p.step, p.value])
            .filter((p) => p[0] !== undefined && p[0] !== null);
          return { name: job.name, points };
        }),
      );
    }
  }
  axis.addEventListener("change", draw);

  // the config rows that differ
  const flats = runs.map(({ job }) => flat({ base_model: job.base_model, ...job.config }));
  const keys = [...new Set(flats.flatMap((f) => Object.keys(f)))].sort();
  const differing = keys.filter((k) => !OWN.includes(k) && new Set(flats.map((f) => f[k])).size > 1);
  const head = el(
    "tr",
    {},
    el("th", { text: "" }),
    runs.map(({ job }) => el("th", {}, el("a", { href: `#/jobs/${job.id}`, text: job.name }))),
  );
  const diff = el(
    "table",
    { id: "config-diff" },
    el("thead", {}, head.cloneNode(true)),
    el(
      "tbody",
      {},
      differing.length
        ? differing.map((k) =>
            el(
              "tr",
              { dataset: { field: k } },
              el("th", { text: k }),
              flats.map((f) => el("td", { text: f[k] === undefined ? "–" : f[k] })),
            ),
          )
        : el("tr", {}, el("td", { colspan: runs.length + 1, class: "muted", text: "The configs are the same." })),
    ),
  );

  // final metrics and the latest succeeded evaluation of each
  const last = (series, key) => {
    const s = series[key] || [];
    return s.length ? s[s.length - 1].value : null;
  };
  const evaluated = runs.map(({ evaluations }) => evaluations.find((e) => e.status === "succeeded") || null);
  const rows = [
    ["Status", runs.map(({ job }) => statusBadge(job.status))],
    ["Steps", runs.map(({ job }) => `${job.step}/${job.total_steps ?? "–"}`)],
    ...FINAL.map(([key, label]) => [label, runs.map(({ series }) => number(last(series, key), 4))]),
    ["Evaluation: loss", evaluated.map((e) => (e ? number(e.metrics.loss, 4) : "–"))],
    ["Evaluation: token accuracy", evaluated.map((e) => (e ? number(e.metrics.token_accuracy, 4) : "–"))],
    ["Evaluation: exact match", evaluated.map((e) => (e ? number(e.metrics.exact_match, 4) : "–"))],
  ];
  const finals = el(
    "table",
    { id: "final-metrics" },
    el("thead", {}, head),
    el(
      "tbody",
      {},
      rows.map(([label, cells]) =>
        el(
          "tr",
          {},
          el("th", { text: label }),
          cells.map((c) => el("td", {}, c)),
        ),
      ),
    ),
  );

  main.append(
    el("div", { class: "toolbar" }, el("label", { for: "compare-axis", text: "X axis" }), axis),
    el(
      "div",
      { class: "compare-charts" },
      charts.map(({ label, chart }) => el("section", { class: "card" }, el("h2", { text: label }), chart)),
    ),
    el(
      "section",
      { class: "card" },
      el("h2", { text: "Config differences" }),
      el("div", { class: "table-wrap" }, diff),
    ),
    el("section", { class: "card" }, el("h2", { text: "Final metrics" }), el("div", { class: "table-wrap" }, finals)),
  );
  draw();
  return null;
}
