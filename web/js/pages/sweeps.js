// Sweeps: the list (#/sweeps), and one sweep (#/sweeps/<id>): the planner's price, the trials'
// table (parameters, metric, state, time), their loss curves overlaid, the best trial marked with
// one click to its checkpoints, its playground and its export; Compare opens the trials side by
// side; Cancel sweep cancels its queued and running trials. Refreshes every 3 s while it runs.

import { api, downloadUrl } from "../api.js";
import { clock, duration, el, errorBox, number, statusBadge } from "../widgets.js";

const short = (name) => name.split(".").pop();
const params = (p) =>
  Object.entries(p)
    .map(([k, v]) => `${short(k)}=${number(v, 4)}`)
    .join(" ");

export async function render(main, sweepId) {
  return sweepId ? one(main, sweepId) : list(main);
}

async function list(main) {
  const body = el("tbody");
  main.append(
    el("div", { class: "title-row" }, el("h1", { text: "Sweeps" })),
    el(
      "p",
      { class: "muted small" },
      "A sweep searches a job's hyperparameters: POST /api/sweeps, or roundhouse sweeps create SWEEP.json.",
    ),
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "sweeps-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Name", "Status", "Trials", "Metric", "Created"].map((h) => el("th", { text: h })),
          ),
        ),
        body,
      ),
    ),
  );
  const page = await api("/sweeps");
  body.replaceChildren(
    ...(page.data.length
      ? page.data.map((s) =>
          el(
            "tr",
            { dataset: { sweepId: s.id } },
            el("td", {}, el("a", { href: `#/sweeps/${s.id}`, text: s.name })),
            el("td", {}, statusBadge(s.status)),
            el("td", { text: String(s.trials.length) }),
            el("td", { text: `${s.goal} ${s.metric}` }),
            el("td", { text: clock(s.created_at) }),
          ),
        )
      : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "No sweeps yet." }))]),
  );
}

async function one(main, sweepId) {
  const title = el("h1", { id: "sweep-name" });
  const status = el("span", { id: "sweep-status" });
  const summary = el("p", { id: "sweep-summary", class: "muted" });
  const problem = el("div", { id: "sweep-error" });
  const cancel = el("button", { type: "button", class: "danger", id: "cancel-sweep", text: "Cancel sweep" });
  const compare = el("a", { class: "button secondary", id: "compare-trials", text: "Compare trials" });
  const best = el("section", { id: "best-trial", class: "card", hidden: true });
  const chart = el("rh-line-chart", { id: "sweep-loss-chart", label: "Loss of each trial", ylabel: "loss" });
  const body = el("tbody");
  main.append(
    el("div", { class: "title-row" }, el("div", {}, title, " ", status), el("div", {}, compare, " ", cancel)),
    summary,
    problem,
    best,
    el(
      "div",
      { class: "table-wrap" },
      el("table", { id: "trials-table" }, el("thead", {}, el("tr", { id: "trials-head" })), body),
    ),
    el("section", { class: "card" }, el("h2", { text: "Loss curves" }), chart),
  );

  let sweep = null;
  cancel.addEventListener("click", async () => {
    if (!confirm(`Cancel sweep ${sweep.name} and its unfinished trials?`)) return;
    try {
      sweep = await api(`/sweeps/${sweepId}/cancel`, { method: "POST" });
      show();
    } catch (err) {
      problem.replaceChildren(errorBox(err));
    }
  });

  async function showBest() {
    const trial = sweep.trials.find((t) => t.job_id === sweep.best_job_id);
    best.hidden = !trial;
    if (!trial) return;
    const saved = (await api(`/jobs/${trial.job_id}/checkpoints`)).data;
    const last = saved[saved.length - 1];
    best.replaceChildren(
      el("h2", { text: `Best: #${trial.index} ${params(trial.params)}` }),
      el("p", {}, `${sweep.metric} ${number(trial.metric, 4)} · `, el("span", { class: "muted", text: trial.name })),
      el(
        "div",
        { class: "toolbar" },
        el("a", { class: "button", id: "best-checkpoints", href: `#/jobs/${trial.job_id}`, text: "Checkpoints" }),
        el("a", {
          class: "button secondary",
          id: "best-playground",
          href: `#/playground/${trial.job_id}`,
          text: "Playground",
        }),
        last
          ? el("a", {
              class: "button secondary",
              id: "best-export",
              href: downloadUrl(`/jobs/${trial.job_id}/checkpoints/${last.step}/download`),
              text: `Export step ${last.step}`,
            })
          : null,
      ),
    );
  }

  async function showCurves() {
    const series = [];
    for (const t of sweep.trials) {
      if (t.status === "deleted") continue;
      const data = (await api(`/jobs/${t.job_id}/metrics`, { query: { keys: "loss/train" } })).data;
      const points = (data["loss/train"] || []).map((p) => [p.step, p.value]);
      const mark = t.job_id === sweep.best_job_id ? " (best)" : "";
      series.push({ name: `#${t.index} ${params(t.params)}${mark}`, points });
    }
    chart.setSeries(series);
  }

  function show() {
    title.textContent = sweep.name;
    status.replaceChildren(statusBadge(sweep.status));
    cancel.hidden = !["running"].includes(sweep.status);
    const live = sweep.trials.filter((t) => t.status !== "deleted").map((t) => t.job_id);
    compare.href = `#/compare/${live.slice(0, 6).join(",")}`;
    compare.hidden = live.length < 2;
    // the trials end to end; priced from this box's measured times, or the planner's assumptions
    const source = { measured: "measured on this box", calibrated: "rate measured on this box" };
    const priced = source[sweep.plan.estimate] ?? "the planner's estimate";
    const eta = sweep.plan.eta_s === null ? "unknown" : `${duration(sweep.plan.eta_s)} (${priced})`;
    summary.textContent =
      `${sweep.search} search over ${Object.keys(sweep.parameters).map(short).join(", ")} · ` +
      `${sweep.trials.length} trials, priced at ${eta} one after another · ${sweep.goal} ${sweep.metric}` +
      (sweep.early_stopping ? " · early stopping" : "");
    const names = Object.keys(sweep.parameters);
    document
      .getElementById("trials-head")
      .replaceChildren(
        ...["#", ...names.map(short), sweep.metric, "Status", "Step", "Time", ""].map((h) => el("th", { text: h })),
      );
    body.replaceChildren(
      ...sweep.trials.map((t) =>
        el(
          "tr",
          { dataset: { jobId: t.job_id }, class: t.job_id === sweep.best_job_id ? "best" : "" },
          el("td", { text: String(t.index) }),
          names.map((n) => el("td", { class: "param", text: number(t.params[n], 4) })),
          el("td", { class: "metric", text: t.metric === null ? "–" : number(t.metric, 4) }),
          el(
            "td",
            {},
            statusBadge(t.status),
            t.stopped_early
              ? el("span", {
                  class: "muted small stopped-early",
                  text: ` stopped early at step ${t.stopped_early.step}`,
                })
              : null,
          ),
          el("td", { text: t.total_steps ? `${t.step}/${t.total_steps}` : "–" }),
          el("td", { class: "time", text: t.duration_s === null ? "–" : duration(t.duration_s) }),
          el(
            "td",
            {},
            t.status === "deleted" ? null : el("a", { href: `#/jobs/${t.job_id}`, text: "job" }),
            t.job_id === sweep.best_job_id ? el("strong", { class: "best-mark", text: " ★ best" }) : null,
          ),
        ),
      ),
    );
  }

  async function load() {
    sweep = await api(`/sweeps/${sweepId}`);
    show();
    await Promise.all([showBest(), showCurves()]);
  }

  await load();
  const timer = setInterval(() => {
    if (sweep && ["running", "cancelling"].includes(sweep.status)) load().catch(() => {});
  }, 3000);
  return () => clearInterval(timer);
}
