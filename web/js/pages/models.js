// Models: the base models this server has (source, family, size on disk, MoE facts, whether the
// engine can train each and why not), deleting one (the bytes freed shown), and "Add from the
// Hub": a repo id pulled by a worker, each pull with its own progress bar.

import { api } from "../api.js";
import { bytes, el, errorBox, field, number } from "../widgets.js";
import { transferLine } from "./transfer.js";

const SOURCES = { demo: "demo", models: "models folder", hub: "Hugging Face Hub", "hf-cache": "HF cache" };

function moeText(m) {
  const stored = m.quantization ? ` · ${m.quantization}` : "";
  if (!m.moe) return `dense${stored}`;
  const of = m.experts ? ` · ${m.active_experts ?? "?"} of ${m.experts} experts` : "";
  return `MoE${of}${stored}`;
}

export async function render(main) {
  const repo = el("input", {
    type: "text",
    placeholder: "ORG/NAME, e.g. Qwen/Qwen3-0.6B",
    required: true,
    maxlength: 200,
    autocomplete: "off",
    spellcheck: "false",
  });
  const revision = el("input", { type: "text", placeholder: "main", maxlength: 200, autocomplete: "off" });
  const submit = el("button", { type: "submit", id: "pull-model", text: "Pull" });
  const formError = el("div", { id: "pull-error" });
  const pulls = el("div", { id: "model-pulls", "aria-live": "polite" });
  const notice = el("p", { id: "models-notice", "aria-live": "polite" });
  const body = el("tbody");
  const form = el(
    "form",
    { id: "pull-form", class: "card" },
    el("h2", { text: "Add from the Hub" }),
    el(
      "div",
      { class: "grid" },
      field("pull-repo", "Repo id", repo, "a model repo of the Hugging Face Hub"),
      field("pull-revision", "Revision", revision, "a branch, tag or commit (default: main)"),
    ),
    el(
      "p",
      { class: "muted small" },
      "Only config.json is read first: a model the engine cannot train, or one the disk cannot hold, " +
        "is refused before any weight is downloaded. Gated repos need ROUNDHOUSE_HUB_TOKEN.",
    ),
    submit,
    formError,
    pulls,
  );
  main.append(
    el("h1", { text: "Models" }),
    form,
    notice,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "models-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Name", "Source", "Family", "Parameters", "Size on disk", "Experts", "Trainable", ""].map((h) =>
              el("th", { text: h }),
            ),
          ),
        ),
        body,
      ),
    ),
  );

  const lines = new Map(); // transfer id -> its line
  function follow(t) {
    if (lines.has(t.id)) return;
    const line = transferLine(t, {
      onEnd: (now) => {
        if (now.status === "succeeded") {
          notice.textContent = `Pulled ${now.repo_id}.`;
          list();
        }
      },
    });
    lines.set(t.id, line);
    pulls.prepend(line.node);
  }

  async function remove(m, button) {
    if (!window.confirm(`Delete the model ${m.name} (${bytes(m.size_bytes)}) from this server?`)) return;
    button.disabled = true;
    try {
      const done = await api(`/models/${m.name.split("/").map(encodeURIComponent).join("/")}`, {
        method: "DELETE",
      });
      notice.textContent = `Deleted ${done.name}: ${bytes(done.freed_bytes)} freed.`;
      await list();
    } catch (err) {
      button.disabled = false;
      notice.replaceChildren(errorBox(err));
    }
  }

  async function list() {
    const { data } = await api("/models");
    body.replaceChildren(
      ...data.map((m) =>
        el(
          "tr",
          { dataset: { model: m.name }, class: m.supported ? "" : "unsupported" },
          el(
            "td",
            {},
            el("strong", { text: m.name }),
            m.hub ? el("div", { class: "muted small", text: `commit ${String(m.hub.sha || "").slice(0, 10)}` }) : null,
          ),
          el("td", { class: "model-source", text: SOURCES[m.source] || m.source }),
          el("td", { class: "model-family", text: m.family || m.architecture || "–" }),
          el("td", { text: m.parameters ? number(m.parameters) : "–" }),
          el("td", { class: "model-size", text: m.ready ? bytes(m.size_bytes) : "prepared on first use" }),
          el("td", { class: "model-moe", text: moeText(m) }),
          el(
            "td",
            { class: "model-supported", title: m.unsupported_reason || "" },
            m.supported ? "yes" : `no: ${m.unsupported_reason}`,
          ),
          el(
            "td",
            { class: "actions" },
            m.source === "models" || m.source === "hub"
              ? el("button", {
                  type: "button",
                  class: "danger delete-model",
                  text: "Delete",
                  onclick: (ev) => remove(m, ev.currentTarget),
                })
              : null,
          ),
        ),
      ),
    );
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    formError.replaceChildren();
    submit.disabled = true;
    try {
      const t = await api("/models/pulls", {
        method: "POST",
        body: { repo_id: repo.value.trim(), revision: revision.value.trim() || null },
      });
      follow(t);
      repo.value = "";
    } catch (err) {
      formError.replaceChildren(errorBox(err));
    } finally {
      submit.disabled = false;
    }
  });

  await list();
  const { data } = await api("/models/pulls");
  for (const t of data.filter((p) => ["queued", "running", "cancelling"].includes(p.status)).reverse()) follow(t);
  return () => {
    for (const line of lines.values()) line.close();
  };
}
