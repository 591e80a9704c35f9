// Job page, "Evaluations": score a checkpoint on a dataset (POST /api/jobs/<id>/evaluations; a
// worker runs it), the results (loss, perplexity, token accuracy, exact match) and the sample
// outputs next to their references. Refreshes every 2 s while one is queued or running (every
// 10 s otherwise, for new checkpoints), and stops once the section leaves the page.

import { api } from "../api.js";
import { el, errorBox, number, showStatus } from "../widgets.js";

const ACTIVE = new Set(["queued", "running"]);

function percent(v) {
  return v === null || v === undefined ? "–" : `${number(100 * v)}%`;
}

function exactMatch(m) {
  if (m.exact_match === null || m.exact_match === undefined) return "–";
  return `${percent(m.exact_match)} (${m.exact_match_correct}/${m.exact_match_rows})`;
}

function samplesTable(detail) {
  if (!detail.samples.length) {
    const why = detail.stored ? "This evaluation has no sample (no row with a reference answer)." : "";
    return el("p", { class: "muted", text: why || "The result file went with its checkpoint (pruned)." });
  }
  return el(
    "div",
    { class: "table-wrap" },
    el(
      "table",
      { class: "samples" },
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          ["Line", "Prompt", "Reference", "Output", "Match"].map((h) => el("th", { text: h })),
        ),
      ),
      el(
        "tbody",
        {},
        detail.samples.map((s) =>
          el(
            "tr",
            { class: "sample" },
            el("td", { text: s.line }),
            el("td", { class: "sample-prompt", text: s.prompt }),
            el("td", { class: "sample-reference", text: s.reference }),
            el("td", { class: "sample-output", text: s.output.trim() ? s.output : "(blank)" }),
            el("td", {
              class: "sample-match",
              text: s.match === null ? "–" : s.match ? "yes" : "no",
              title: s.match === null ? "reference too long for exact match" : "",
            }),
          ),
        ),
      ),
    ),
  );
}

// Add the section after the checkpoints card of the job page in `main`.
export function mountEvaluations(main, jobId) {
  const checkpoint = el("select", { id: "eval-checkpoint" });
  const dataset = el("select", { id: "eval-dataset", required: true });
  const maxRows = el("input", { id: "eval-max-rows", type: "number", min: 1, max: 100000, value: 200 });
  const maxTokens = el("input", { id: "eval-max-new-tokens", type: "number", min: 1, max: 2048, value: 64 });
  const submit = el("button", { type: "submit", id: "evaluate", text: "Evaluate" });
  const error = el("div", { id: "eval-error" });
  const rows = el("tbody");
  const samples = el("div", { id: "evaluation-samples" });
  const field = (label, input, hint) =>
    el(
      "div",
      { class: "field" },
      el("label", { for: input.id, text: label }),
      input,
      hint ? el("span", { class: "hint", text: hint }) : null,
    );
  const form = el(
    "form",
    { id: "evaluate-form" },
    el(
      "div",
      { class: "grid" },
      field("Checkpoint", checkpoint),
      field("Dataset", dataset),
      field("Max rows", maxRows, "the first rows of the dataset"),
      field("Max new tokens", maxTokens, "the longest generated answer"),
    ),
    el("div", { class: "actions" }, submit),
    error,
  );
  const section = el(
    "section",
    { class: "card", id: "evaluations" },
    el("h2", { text: "Evaluations" }),
    el("p", {
      class: "muted small",
      text:
        "A worker scores the checkpoint on the dataset (after the job it is training, if any): mean loss over " +
        "the trained tokens, perplexity, next-token accuracy, and exact match on answers of at most 32 tokens.",
    }),
    form,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "evaluations-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Checkpoint", "Dataset", "Status", "Rows", "Loss", "Perplexity", "Token accuracy", "Exact match", ""].map(
              (h) => el("th", { text: h }),
            ),
          ),
        ),
        rows,
      ),
    ),
    samples,
  );
  const anchor = main.querySelector("#checkpoints-table");
  const card = anchor && anchor.closest("section");
  if (card) card.after(section);
  else main.append(section);

  const names = new Map();
  const details = new Map(); // evaluation id -> its detail (samples), once succeeded
  let shown = null; // the evaluation whose samples are shown
  let timer = null;

  async function showSamples(id) {
    shown = id;
    if (!details.has(id)) details.set(id, await api(`/jobs/${jobId}/evaluations/${id}`));
    const d = details.get(id);
    samples.replaceChildren(
      el("h3", { text: `Samples of step ${d.step} on ${names.get(d.dataset_id) || d.dataset_id}` }),
      samplesTable(d),
    );
    for (const tr of rows.querySelectorAll("tr[data-evaluation-id]"))
      tr.classList.toggle("selected", tr.dataset.evaluationId === id);
  }

  function row(e) {
    const m = e.metrics || {};
    const done = e.status === "succeeded";
    return el(
      "tr",
      { dataset: { evaluationId: e.id, step: e.step } },
      el("td", { text: e.step }),
      el("td", { text: names.get(e.dataset_id) || e.dataset_id }),
      el("td", { class: "eval-status" }, showStatus(el("span"), e.status)),
      el("td", { class: "eval-rows", text: done ? m.rows : "–" }),
      el("td", { class: "eval-loss", text: done ? number(m.loss, 4) : "–" }),
      el("td", { class: "eval-perplexity", text: done ? number(m.perplexity, 4) : "–" }),
      el("td", { class: "eval-token-accuracy", text: done ? percent(m.token_accuracy) : "–" }),
      el("td", { class: "eval-exact-match", text: done ? exactMatch(m) : "–" }),
      el(
        "td",
        { class: "actions" },
        done
          ? el("button", {
              type: "button",
              class: "secondary show-samples",
              text: "Samples",
              onclick: () => showSamples(e.id).catch((err) => error.replaceChildren(errorBox(err))),
            })
          : e.error
            ? el("span", { class: "error small eval-error", text: e.error })
            : null,
      ),
    );
  }

  async function refreshCheckpoints() {
    const { data } = await api(`/jobs/${jobId}/checkpoints`);
    const chosen = checkpoint.value;
    const options = data.length
      ? [
          ["latest", `latest (step ${data[data.length - 1].step})`],
          ...data.reverse().map((c) => [c.step, `step ${c.step}`]),
        ]
      : [["", "no checkpoint yet"]];
    checkpoint.replaceChildren(...options.map(([v, label]) => el("option", { value: v, text: label })));
    if ([...checkpoint.options].some((o) => o.value === chosen)) checkpoint.value = chosen;
    submit.disabled = !data.length;
  }

  async function refreshEvaluations() {
    const { data } = await api(`/jobs/${jobId}/evaluations`);
    rows.replaceChildren(
      ...(data.length
        ? data.map(row)
        : [el("tr", {}, el("td", { colspan: 9, class: "muted", text: "No evaluation yet." }))]),
    );
    const newest = data.find((e) => e.status === "succeeded");
    const pick = shown && data.some((e) => e.id === shown) ? shown : newest && newest.id;
    if (pick) await showSamples(pick);
    return data.some((e) => ACTIVE.has(e.status));
  }

  async function tick() {
    timer = null;
    if (!section.isConnected) return;
    let active = false;
    try {
      [, active] = await Promise.all([refreshCheckpoints(), refreshEvaluations()]);
    } catch (err) {
      error.replaceChildren(errorBox(err));
    }
    if (section.isConnected) timer = setTimeout(tick, active ? 2000 : 10000);
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.replaceChildren();
    submit.disabled = true;
    const step = checkpoint.value === "latest" ? "latest" : Number(checkpoint.value);
    try {
      await api(`/jobs/${jobId}/evaluations`, {
        method: "POST",
        body: {
          checkpoint: step,
          dataset_id: dataset.value,
          max_rows: Number(maxRows.value),
          max_new_tokens: Number(maxTokens.value),
        },
      });
      shown = null;
      if (timer) clearTimeout(timer);
      await tick();
    } catch (err) {
      error.replaceChildren(errorBox(err));
    } finally {
      submit.disabled = !checkpoint.value;
    }
  });

  (async () => {
    try {
      const [job, sets] = await Promise.all([api(`/jobs/${jobId}`), api("/datasets")]);
      for (const d of sets.data) names.set(d.id, d.name);
      dataset.replaceChildren(
        ...sets.data.map((d) => el("option", { value: d.id, text: `${d.name} (${d.rows} rows)` })),
      );
      const preferred = job.validation_dataset_id || job.dataset_id;
      if (names.has(preferred)) dataset.value = preferred;
    } catch (err) {
      error.replaceChildren(errorBox(err));
    }
    await tick();
  })();
}
