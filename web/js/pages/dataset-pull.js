// Datasets, "Pull from the Hub": a split of a Hub dataset repo (its own JSONL, Parquet or CSV files,
// else the Hub's Parquet conversion) that a worker downloads and stores like an upload. Each pull is
// a transfer line (transfer.js: progress, speed, ETA, Cancel); one whose rows are invalid fails with
// them, by line. The pulls under way when the page opens are followed too.

import { api } from "../api.js";
import { el, errorBox, field } from "../widgets.js";
import { transferLine } from "./transfer.js";

const ACTIVE = new Set(["queued", "running", "cancelling"]);

function text(attrs) {
  return el("input", { type: "text", maxlength: 200, autocomplete: "off", spellcheck: "false", ...attrs });
}

// pullCard({ onStored }) -> { node, start, close }: onStored(dataset) once a pull stored its split;
// start() follows the pulls under way; close() ends the lines' streams.
export function pullCard({ onStored } = {}) {
  const repo = text({ placeholder: "ORG/NAME, e.g. HuggingFaceH4/no_robots", required: true });
  const split = text({ value: "train", required: true, maxlength: 128 });
  const config = text({ placeholder: "default", maxlength: 128 });
  const revision = text({ placeholder: "main" });
  const submit = el("button", { type: "submit", id: "pull-dataset", text: "Pull" });
  const formError = el("div", { id: "dataset-pull-error" });
  const notice = el("p", { id: "dataset-pull-notice", "aria-live": "polite" });
  const pulls = el("div", { id: "dataset-pulls", "aria-live": "polite" });
  const form = el(
    "form",
    { id: "dataset-pull-form", class: "card" },
    el("h2", { text: "Pull from the Hub" }),
    el(
      "div",
      { class: "grid" },
      field("dataset-pull-repo", "Repo id", repo, "a dataset repo of the Hugging Face Hub"),
      field("dataset-pull-split", "Split", split, "e.g. train, test, validation"),
      field("dataset-pull-config", "Config", config, "the subset, when the repo has several"),
      field("dataset-pull-revision", "Revision", revision, "a branch, tag or commit (default: main)"),
    ),
    el(
      "p",
      { class: "muted small" },
      "Only the file list is read first: a split over the upload limit, or one the disk cannot hold, " +
        "is refused before it is downloaded. A worker downloads it and checks every row as for an upload. " +
        "Gated repos need ROUNDHOUSE_HUB_TOKEN.",
    ),
    submit,
    formError,
    notice,
    pulls,
  );

  const lines = new Map(); // transfer id -> its line
  function follow(t) {
    if (lines.has(t.id)) return;
    const line = transferLine(t, {
      label: `${t.repo_id} · ${t.options.split}`,
      onEnd: async (now) => {
        if (now.status !== "succeeded" || !now.dataset_id) return;
        try {
          const d = await api(`/datasets/${now.dataset_id}`);
          notice.textContent = `Pulled ${d.name}: ${d.rows} rows (${d.format}).`;
          if (onStored) await onStored(d);
        } catch (err) {
          notice.replaceChildren(errorBox(err));
        }
      },
    });
    lines.set(t.id, line);
    pulls.prepend(line.node);
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    formError.replaceChildren();
    submit.disabled = true;
    try {
      const t = await api("/datasets/pulls", {
        method: "POST",
        body: {
          repo_id: repo.value.trim(),
          split: split.value.trim(),
          config: config.value.trim() || null,
          revision: revision.value.trim() || null,
        },
      });
      follow(t);
      repo.value = "";
    } catch (err) {
      formError.replaceChildren(errorBox(err));
    } finally {
      submit.disabled = false;
    }
  });

  async function start() {
    const { data } = await api("/transfers", { query: { kind: "dataset_pull" } });
    for (const t of data.filter((p) => ACTIVE.has(p.status)).reverse()) follow(t);
  }

  function close() {
    for (const line of lines.values()) line.close();
  }

  return { node: form, start, close };
}
