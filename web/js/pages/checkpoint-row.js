// One row of the job page's checkpoints table: step, kind, losses, age, and its downloads (the
// adapter or model; for an adapter the merged model too, and clearing that cached build; a GGUF
// folder for llama.cpp and Ollama in the chosen quantization); Push sends it to a Hub repo.

import { api, downloadUrl } from "../api.js";
import { age, el, errorBox, number } from "../widgets.js";
import { transferLine } from "./transfer.js";

const QUANTS = ["q8_0", "q4_k_m", "f16", "bf16"];
// the quantization chosen per checkpoint ("job/step"): the table is redrawn as checkpoints
// arrive and a job ends, and a choice must survive that
const chosenQuant = new Map();

function ggufDownload(jobId, step) {
  const key = `${jobId}/${step}`;
  const url = (quant) => downloadUrl(`/jobs/${jobId}/checkpoints/${step}/download`, { gguf: quant });
  const link = el("a", {
    class: "button secondary download-gguf",
    download: "",
    href: url(chosenQuant.get(key) ?? QUANTS[0]),
    title: "The model as a GGUF file for llama.cpp and Ollama, with a Modelfile (built once, then kept)",
    text: "GGUF",
  });
  const quant = el(
    "select",
    {
      class: "gguf-quant",
      "aria-label": "GGUF quantization",
      onchange: (ev) => {
        chosenQuant.set(key, ev.target.value);
        link.href = url(ev.target.value);
      },
    },
    ...QUANTS.map((q) => el("option", { value: q, text: q })),
  );
  quant.value = chosenQuant.get(key) ?? QUANTS[0];
  return [quant, link];
}

// The Push button and, under the row, its form (repo id, private, merged) and the push's progress.
function pushControls(jobId, c) {
  const repo = el("input", {
    type: "text",
    class: "push-repo",
    placeholder: "ORG/NAME",
    required: true,
    maxlength: 200,
    autocomplete: "off",
    spellcheck: "false",
    "aria-label": "Hub repo id",
  });
  const isPrivate = el("input", { type: "checkbox", class: "push-private", checked: true });
  const merged = el("input", { type: "checkbox", class: "push-merged" });
  const problem = el("div", { class: "push-error" });
  const progress = el("div", { class: "push-progress", "aria-live": "polite" });
  const send = el("button", { type: "submit", class: "push-submit", text: "Push to the Hub" });
  const form = el(
    "form",
    { class: "push-form toolbar" },
    repo,
    el("label", {}, isPrivate, " private"),
    c.kind === "adapter" ? el("label", { title: "the adapter merged into its base model" }, merged, " merged") : null,
    send,
  );
  const panel = el("tr", { class: "push-panel", hidden: true }, el("td", { colspan: 6 }, form, problem, progress));
  let line = null;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    problem.replaceChildren();
    send.disabled = true;
    try {
      const t = await api(`/jobs/${jobId}/checkpoints/${c.step}/push`, {
        method: "POST",
        body: { repo_id: repo.value.trim(), private: isPrivate.checked, merged: merged.checked },
      });
      if (line) line.close();
      line = transferLine(t, {
        label: `step ${c.step} → ${t.repo_id}`,
        onEnd: (now) => {
          send.disabled = false;
          if (now.status === "succeeded")
            progress.append(
              el("a", { class: "push-link", href: now.target, target: "_blank", rel: "noopener", text: now.target }),
            );
        },
      });
      progress.replaceChildren(line.node);
    } catch (err) {
      send.disabled = false;
      problem.replaceChildren(errorBox(err));
    }
  });
  const button = el("button", {
    type: "button",
    class: "button secondary push-checkpoint",
    title: "Push this checkpoint to a Hugging Face Hub repo, with a model card",
    text: "Push",
    onclick: () => {
      panel.hidden = !panel.hidden;
      if (!panel.hidden) repo.focus();
    },
  });
  return { button, panel };
}

// The row, and the push panel that follows it (hidden until Push is clicked).
export function checkpointRow(jobId, c, onError) {
  const push = pushControls(jobId, c);
  const row = el(
    "tr",
    { dataset: { step: c.step } },
    el("td", { text: c.step }),
    el("td", { text: c.kind }),
    el("td", { text: number(c.metrics["loss/train"]) }),
    el("td", { text: number(c.metrics["loss/val"]) }),
    el("td", { title: c.created_at, text: age(c.created_at) }),
    el(
      "td",
      { class: "actions" },
      el("a", {
        class: "button secondary download-adapter",
        download: "",
        href: downloadUrl(`/jobs/${jobId}/checkpoints/${c.step}/download`),
        text: c.kind === "adapter" ? "Adapter" : "Model",
      }),
      c.kind === "adapter"
        ? el("a", {
            class: "button secondary download-merged",
            download: "",
            href: downloadUrl(`/jobs/${jobId}/checkpoints/${c.step}/download`, { merged: true }),
            text: "Merged",
          })
        : null,
      c.kind === "adapter"
        ? el("button", {
            type: "button",
            class: "button secondary clear-merged",
            title: "Delete the cached merged build from the server (the next merged download builds it again)",
            text: "Clear merged",
            onclick: async (ev) => {
              ev.target.disabled = true;
              try {
                await api(`/jobs/${jobId}/checkpoints/${c.step}/merged`, { method: "DELETE" });
                ev.target.textContent = "Cleared";
              } catch (err) {
                ev.target.disabled = false;
                onError(err);
              }
            },
          })
        : null,
      ...ggufDownload(jobId, c.step),
      push.button,
    ),
  );
  return [row, push.panel];
}
