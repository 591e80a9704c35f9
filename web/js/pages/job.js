// Job: status, method, progress and ETA, times (created, started, finished, duration), disk use, loss
// (train and validation), the method's own charts as GET /api/methods lists them (token accuracy,
// a preference method's rewards, GRPO's rewards and completions), the latest graded samples of a
// method that samples (data_format "prompts"), throughput, learning rate, bubble ratio,
// the engine's idle time, waits, transfers and optimizer phases, per-GPU utilization and memory over the job's
// life, the event log, checkpoints, cancel, pause, resume and delete. Everything is rebuilt from the
// job's event stream, which replays the stored events and then goes live (again after a resume).

import { api, stream } from "../api.js";
import { EVENT_KINDS, isActive } from "../kinds.js";
import { checkpointRow } from "./checkpoint-row.js";
import { engineCharts } from "./engine-charts.js";
import { mountEvaluations } from "./evaluations.js";
import { age, bytes, clock, duration, el, errorBox, number, showStatus } from "../widgets.js";

const RESUMABLE = ["cancelled", "failed", "interrupted", "paused"];
const DELETABLE = ["succeeded", "failed", "cancelled", "interrupted", "paused"];
const PAUSABLE = ["queued", "running", "interrupted"];
const RUNS = ["running", "pausing", "cancelling"]; // a worker runs it: the ETA means something

const SAMPLE_STEPS = 5; // the samples events shown: the latest steps'

// A job's method (method.objective; an older job's method.kind): "sft", "dpo", "orpo", "grpo", ...
export function methodObjective(m = {}) {
  if (m.objective) return m.objective;
  return m.kind === "lora" || m.kind === "full" || !m.kind ? "sft" : m.kind;
}

// What trains (method.tuning; an older job's method.kind or method.dpo_tuning): "lora" or "full"
export function methodTuning(m = {}) {
  return m.tuning ?? (methodObjective(m) === "sft" ? m.kind : m.dpo_tuning) ?? "lora";
}

// the options a one-line label names where the method has them, and how
const LABELLED = [
  ["group_size", "group"],
  ["beta", "beta"],
];

// "LoRA (r 16)", "LoRA (r 16), 4-bit base", "Full fine-tune", "DPO (LoRA), beta 0.1",
// "KTO (full), beta 0.1", "GRPO (LoRA), group 4, beta 0.04". ``entry``: the method's entry of GET
// /api/methods, whose defaults stand for the options an older job's section lacks.
export function methodLabel(m = {}, entry = null) {
  const objective = methodObjective(m);
  const tuning = methodTuning(m);
  if (objective === "sft")
    return tuning === "full"
      ? "Full fine-tune"
      : `LoRA (r ${m.lora_r ?? 16})${m.base_bits === 4 ? ", 4-bit base" : ""}`;
  // the method's options (an older job's section may hold every method's: only its own count)
  const schema = entry?.options_schema.properties;
  const named = LABELLED.filter(([key]) => (schema ? key in schema : key in m)).map(
    ([key, word]) => `, ${word} ${m[key] ?? schema?.[key]?.default}`,
  );
  return `${objective.toUpperCase()} (${tuning === "full" ? "full" : "LoRA"})${named.join("")}`;
}

// One chart of a method's listing (its id, title, hint, y label and lines): the card and the chart
function methodChart(c, shown) {
  const chart = el("rh-line-chart", {
    id: c.id,
    label: c.title,
    xlabel: "step",
    ylabel: c.ylabel,
    zero: c.share,
    ymax: c.share ? 1 : null,
    empty: "nothing logged yet",
  });
  const card = el(
    "section",
    { class: "card method-card", hidden: !shown, dataset: { chart: c.id } },
    el("h2", { text: c.title }),
    el("p", { class: "hint", text: c.hint }),
    chart,
  );
  return { card, chart, lines: c.lines.map(([name, key]) => [name, key]), more: c.more };
}

export async function render(main, jobId) {
  const [first, methods] = await Promise.all([api(`/jobs/${jobId}`), api("/methods")]);
  let job = first;
  const status = el("span", { id: "job-status", class: "status", "aria-live": "polite" });
  const progress = el("progress", { id: "job-progress", max: 1, value: 0, "aria-label": "job progress" });
  const stepText = el("span", { id: "job-step" });
  const eta = el("span", { id: "job-eta" });
  const tokens = el("span", { id: "tokens-per-s", text: "–" });
  const lrText = el("span", { id: "learning-rate", text: "–" });
  const bubble = el("span", { id: "bubble-ratio", text: "–" });
  const gradNorm = el("span", { id: "grad-norm", text: "–" });
  const lossChart = el("rh-line-chart", {
    id: "loss-chart",
    label: "loss",
    xlabel: "step",
    ylabel: "loss",
    empty: "no loss logged yet",
  });
  const speedChart = el("rh-line-chart", {
    id: "speed-chart",
    label: "tokens per second",
    xlabel: "step",
    ylabel: "tokens/s",
    zero: true,
  });
  const gpuChart = el("rh-line-chart", {
    id: "gpu-chart",
    label: "device utilization (%)",
    xlabel: "time since the run started",
    ylabel: "utilization (%)",
    xtime: true,
    zero: true,
    ymax: 100,
    empty: "no utilization sample yet",
  });
  const memoryChart = el("rh-line-chart", {
    id: "memory-chart",
    label: "device memory used (GB)",
    xlabel: "time since the run started",
    ylabel: "memory used (GB)",
    xtime: true,
    zero: true,
    empty: "no memory sample yet",
  });
  const engine = engineCharts(); // the Pipeline, Transfers and Optimizer cards (engine-charts.js)
  const log = el("ol", { id: "event-log", class: "log" });
  const checkpoints = el("tbody");
  const cancel = el("button", { type: "button", id: "cancel-job", class: "danger", text: "Cancel job" });
  const pause = el("button", {
    type: "button",
    id: "pause-job",
    class: "secondary",
    text: "Pause",
    title: "Stop at the next step with a checkpoint; Resume continues from it",
  });
  const resume = el("button", { type: "button", id: "resume-job", text: "Resume" });
  const pausedNote = el("p", { id: "paused-note", class: "paused-note", hidden: true });
  const remove = el("button", { type: "button", id: "delete-job", class: "danger", text: "Delete job" });
  const created = el("span", { id: "job-created" });
  const started = el("span", { id: "job-started" });
  const finished = el("span", { id: "job-finished" });
  const took = el("span", { id: "job-duration" });
  const diskUse = el("span", { id: "job-disk" });
  const error = el("div", { id: "job-error" });
  const title = el("h1", { text: job.name });
  const objective = methodObjective(job.config.method);
  const entry = methods.data.find((m) => m.name === objective);
  // the job's method's charts, shown; every other method's (an id once), hidden until their
  // metrics arrive: the metrics shown wherever they come from
  const charts = [];
  for (const m of [entry, ...methods.data.filter((o) => o !== entry)])
    for (const c of m?.charts ?? [])
      if (!charts.some((taken) => taken.card.dataset.chart === c.id)) charts.push(methodChart(c, m === entry));
  const finishedShare = el("span", { id: "completion-finished", text: "–" });
  const graderErrors = el("span", { id: "grader-errors", text: "–" });
  // the latest steps' graded completions (the run's "samples" events), newest first
  const samplesList = el("ol", { id: "grpo-samples", class: "samples-list" });
  const samplesCard = el(
    "section",
    { class: "card", id: "samples", hidden: entry?.data_format !== "prompts" },
    el("h2", { text: "Samples" }),
    el("p", {
      class: "hint",
      text: "A few of each step's sampled completions with the grader's reward (the latest steps).",
    }),
    el(
      "dl",
      { class: "stats" },
      el("div", {}, el("dt", { text: "completions that stopped" }), el("dd", {}, finishedShare)),
      el("div", {}, el("dt", { text: "grader errors (last step)" }), el("dd", {}, graderErrors)),
    ),
    samplesList,
  );
  main.append(
    el("div", { class: "title-row" }, title, status),
    el(
      "p",
      { class: "muted small" },
      `${job.base_model} · `,
      el("span", { id: "job-method", text: methodLabel(job.config.method, entry) }),
      ` · job ${job.id} · `,
      created,
    ),
    el(
      "section",
      { class: "card" },
      el("div", { class: "progress-row" }, progress, stepText, el("span", {}, "ETA ", eta)),
      el(
        "dl",
        { class: "stats" },
        el("div", {}, el("dt", { text: "tokens/s" }), el("dd", {}, tokens)),
        el("div", {}, el("dt", { text: "learning rate" }), el("dd", {}, lrText)),
        el("div", {}, el("dt", { text: "gradient norm" }), el("dd", {}, gradNorm)),
        el("div", {}, el("dt", { text: "pipeline bubble" }), el("dd", {}, bubble)),
      ),
      el(
        "dl",
        { class: "stats", id: "job-times" },
        el("div", {}, el("dt", { text: "started" }), el("dd", {}, started)),
        el("div", {}, el("dt", { text: "finished" }), el("dd", {}, finished)),
        el("div", {}, el("dt", { text: "duration" }), el("dd", {}, took)),
        el("div", {}, el("dt", { text: "on disk" }), el("dd", {}, diskUse)),
      ),
      error,
      pausedNote,
      el(
        "div",
        { class: "actions" },
        cancel,
        pause,
        resume,
        remove,
        el("a", { id: "try-in-playground", href: `#/playground/${jobId}`, text: "Try in the playground" }),
      ),
    ),
    el(
      "div",
      { class: "charts" },
      el("section", { class: "card" }, el("h2", { text: "Loss" }), lossChart),
      ...charts.map((c) => c.card),
      el("section", { class: "card" }, el("h2", { text: "Throughput (tokens/s)" }), speedChart),
      ...engine.cards,
      el("section", { class: "card" }, el("h2", { text: "Device utilization (%)" }), gpuChart),
      el("section", { class: "card" }, el("h2", { text: "Memory used (GB)" }), memoryChart),
    ),
    el(
      "section",
      { class: "card" },
      el("h2", { text: "Checkpoints" }),
      el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          { id: "checkpoints-table" },
          el(
            "thead",
            {},
            el(
              "tr",
              {},
              ["Step", "Kind", "Train loss", "Val. loss", "Saved", "Download"].map((h) => el("th", { text: h })),
            ),
          ),
          checkpoints,
        ),
      ),
    ),
    samplesCard,
    el("section", { class: "card" }, el("h2", { text: "Events" }), log),
  );

  const series = {
    "loss/train": [],
    "loss/val": [],
    "throughput/tokens_per_s": [],
  };
  for (const c of charts) for (const [, key] of c.lines) series[key] = [];
  const devices = new Map();
  const memory = new Map();
  let runStart = null; // when the run first started (ms): the x origin of the device charts
  let firstSample = null;

  // the figures that move with the clock: "created N s ago", a running job's duration
  function showTimes() {
    created.textContent = `created ${age(job.created_at)}`;
    created.title = job.created_at;
    started.textContent = clock(job.started_at);
    started.title = job.started_at || "";
    finished.textContent = clock(job.finished_at);
    finished.title = job.finished_at || "";
    const begin = job.started_at ? Date.parse(job.started_at) : null;
    const end = job.finished_at ? Date.parse(job.finished_at) : isActive(job.status) ? Date.now() : null;
    took.textContent = begin !== null && end !== null ? duration((end - begin) / 1000) : "–";
  }

  function showJob() {
    showTimes();
    diskUse.textContent = bytes(job.disk_bytes);
    resume.hidden = !RESUMABLE.includes(job.status);
    pause.hidden = !PAUSABLE.includes(job.status);
    remove.hidden = !DELETABLE.includes(job.status);
    pausedNote.hidden = !["paused", "pausing"].includes(job.status);
    pausedNote.textContent =
      job.status === "pausing"
        ? "Pausing: the run stops at its next step and saves a checkpoint there."
        : `Paused at step ${job.step}: Resume continues from its latest checkpoint; the files stay until you delete the job.`;
    showStatus(status, job.status);
    const total = job.total_steps || 0;
    progress.max = total || 1;
    progress.value = total ? job.step : 0;
    stepText.textContent = total ? `step ${job.step} / ${total}` : `step ${job.step}`;
    cancel.hidden = !isActive(job.status) || job.status === "cancelling";
    if (!RUNS.includes(job.status)) eta.textContent = "–";
    error.replaceChildren(...(job.error ? [errorBox({ message: job.error })] : []));
  }

  function redraw() {
    lossChart.setSeries([
      { name: "train", points: series["loss/train"] },
      { name: "validation", points: series["loss/val"] },
    ]);
    speedChart.setSeries([{ name: "tokens/s", points: series["throughput/tokens_per_s"] }]);
    for (const c of charts) {
      if (c.lines.some(([, key]) => series[key].length)) c.card.hidden = false;
      c.chart.setSeries(c.lines.map(([name, key]) => ({ name, points: series[key] })));
    }
    gpuChart.setSeries([...devices.entries()].map(([k, points]) => ({ name: k, points })));
    memoryChart.setSeries([...memory.entries()].map(([k, points]) => ({ name: k, points })));
    engine.draw();
  }

  let pending = false;
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      redraw();
    });
  }

  // a training step's metrics: the loss and throughput charts, the figures, the progress
  function metrics(e) {
    const d = e.data;
    // a key under a chart's prefix (GRPO's reward/<grader name>, a multi grader's parts): a line
    // of that chart, named by the rest of the key
    for (const key of Object.keys(d)) {
      const c = !(key in series) && charts.find((x) => x.more && key.startsWith(x.more));
      if (c) {
        series[key] = [];
        c.lines.push([key.slice(c.more.length), key]);
      }
    }
    for (const key of Object.keys(series)) if (key in d) series[key].push([e.step, d[key]]);
    if ("completion/finished" in d) finishedShare.textContent = `${number(100 * d["completion/finished"])}%`;
    if ("grpo/grader_errors" in d) graderErrors.textContent = number(d["grpo/grader_errors"]);
    engine.take(e);
    if ("progress/step" in d) {
      job.step = d["progress/step"];
      job.total_steps = d["progress/total_steps"];
      if (RUNS.includes(job.status)) eta.textContent = duration(d["time/eta_s"]);
    }
    if ("throughput/tokens_per_s" in d) tokens.textContent = number(d["throughput/tokens_per_s"]);
    if ("optim/lr" in d) lrText.textContent = number(d["optim/lr"]);
    if ("optim/grad_norm" in d) gradNorm.textContent = number(d["optim/grad_norm"]);
    if ("pipeline/bubble_ratio" in d) bubble.textContent = `${number(100 * d["pipeline/bubble_ratio"])}%`;
    showJob();
    schedule();
  }

  // a sample of the worker host's devices: the utilization and memory charts
  function telemetry(e) {
    const at = Date.parse(e.created_at);
    if (firstSample === null) firstSample = at;
    const x = (at - (runStart ?? firstSample)) / 1000;
    for (const [key, value] of Object.entries(e.data)) {
      const gpu = key.match(/^gpu\/(\d+)\/(utilization|memory_used)$/);
      const host = key.match(/^host\/(cpu_utilization|memory_used)$/);
      if (!gpu && !host) continue;
      const label = gpu ? `GPU ${gpu[1]}` : host[1] === "memory_used" ? "host RAM" : "CPU";
      const isMemory = (gpu ? gpu[2] : host[1]) === "memory_used";
      const target = isMemory ? memory : devices;
      if (!target.has(label)) target.set(label, []);
      target.get(label).push([x, isMemory ? value / 1e9 : value]);
    }
    schedule();
  }

  // a step's graded completions: a list item of the step, the latest SAMPLE_STEPS kept
  function samples(e) {
    const d = e.data || {};
    const shown = Array.isArray(d.samples) ? d.samples : [];
    const item = el(
      "li",
      { class: "sample-step", dataset: { step: d.step ?? e.step ?? "" } },
      el("h3", { text: `step ${d.step ?? e.step}` }),
      el(
        "table",
        { class: "grpo-samples-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Prompt", "Completion", "Reward"].map((h) => el("th", { text: h })),
          ),
        ),
        el(
          "tbody",
          {},
          shown.map((s) =>
            el(
              "tr",
              { class: `grpo-sample${s.error ? " failed" : ""}` },
              el("td", { class: "grpo-prompt", title: s.prompt, text: String(s.prompt ?? "").slice(-200) }),
              el("td", { class: "grpo-completion", text: s.completion ?? "" }),
              el(
                "td",
                { class: "grpo-reward", title: s.error || "" },
                number(s.reward),
                s.error ? el("div", { class: "grpo-error error small", text: s.error }) : null,
              ),
            ),
          ),
        ),
      ),
    );
    samplesList.prepend(item);
    while (samplesList.children.length > SAMPLE_STEPS) samplesList.lastElementChild.remove();
    samplesCard.hidden = false;
  }

  function logLine(e) {
    const when = new Date(e.created_at).toLocaleTimeString();
    const kind = EVENT_KINDS[e.kind] ? EVENT_KINDS[e.kind].label : e.kind;
    log.append(
      el(
        "li",
        { class: `event-${e.kind}` },
        el("time", { datetime: e.created_at, text: when }),
        ` ${kind}: ${e.message}`,
      ),
    );
  }

  // the rows are redrawn only when the list changed: an open Push form or a chosen GGUF
  // quantization stays while the job's events replay or arrive
  let shownCheckpoints = null;
  async function refreshCheckpoints() {
    const { data } = await tracked(api(`/jobs/${jobId}/checkpoints`));
    const shown = JSON.stringify(data);
    if (shown === shownCheckpoints) return;
    shownCheckpoints = shown;
    checkpoints.replaceChildren(
      ...(data.length
        ? data.flatMap((c) => checkpointRow(jobId, c, (err) => error.replaceChildren(errorBox(err))))
        : [el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No checkpoint yet." }))]),
    );
  }

  // the page's own requests in flight: a delete waits for them (none may answer 404 after it)
  const inflight = new Set();
  function tracked(request) {
    inflight.add(request);
    request.then(
      () => inflight.delete(request),
      () => inflight.delete(request),
    );
    return request;
  }

  async function refreshJob() {
    job = await tracked(api(`/jobs/${jobId}`));
    showJob();
  }

  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    try {
      job = await api(`/jobs/${jobId}/cancel`, { method: "POST" });
      showJob();
    } catch (err) {
      error.replaceChildren(errorBox(err));
    } finally {
      cancel.disabled = false;
    }
  });

  pause.addEventListener("click", async () => {
    pause.disabled = true;
    try {
      job = await api(`/jobs/${jobId}/pause`, { method: "POST" });
      showJob();
    } catch (err) {
      error.replaceChildren(errorBox(err));
    } finally {
      pause.disabled = false;
    }
  });

  resume.addEventListener("click", async () => {
    resume.disabled = true;
    try {
      job = await api(`/jobs/${jobId}/resume`, { method: "POST" });
      showJob();
      follow(); // the stream ended with the old final state: follow the new run
    } catch (err) {
      error.replaceChildren(errorBox(err));
    } finally {
      resume.disabled = false;
    }
  });

  remove.addEventListener("click", async () => {
    if (!confirm(`Delete job ${job.name} with its checkpoints and files?`)) return;
    remove.disabled = true;
    es.close(); // no event, and no refresh it would start, after the job is gone
    await Promise.allSettled([...inflight]);
    try {
      await api(`/jobs/${jobId}`, { method: "DELETE" });
      location.hash = "#/jobs";
    } catch (err) {
      error.replaceChildren(errorBox(err));
      remove.disabled = false;
      follow();
    }
  });

  showJob();
  redraw();
  await refreshCheckpoints();
  mountEvaluations(main, jobId); // the Evaluations card (evaluations.js)
  // every kind of kinds.js: the charts take theirs, the others are lines of the event log
  const consumers = {
    metrics,
    telemetry,
    state: (e) => {
      if (e.data.to === "running" && runStart === null) runStart = Date.parse(e.created_at);
      logLine(e);
      refreshJob();
    },
    checkpoint: (e) => {
      logLine(e);
      refreshCheckpoints();
    },
    samples,
  };
  let lastId = 0; // the last event shown: a new stream (after a resume) continues from it
  const handlers = Object.fromEntries(
    Object.entries(EVENT_KINDS).map(([kind, { chart }]) => {
      const consume = consumers[kind] || (chart ? () => {} : logLine);
      return [
        kind,
        (e) => {
          if (e.id <= lastId) return;
          lastId = e.id;
          consume(e);
        },
      ];
    }),
  );
  let es = null;
  function follow() {
    if (es) es.close();
    es = stream(
      `/jobs/${jobId}/stream`,
      {
        ...handlers,
        end: () => {
          refreshJob();
          refreshCheckpoints();
        },
      },
      { after: lastId || null },
    );
  }
  follow();
  const timer = setInterval(showTimes, 1000);
  return () => {
    clearInterval(timer);
    es.close();
  };
}
