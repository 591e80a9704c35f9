// One row of the job page's checkpoints table: step, kind, losses, age, and its downloads (the
// adapter or model, then one per export format the API lists for the job: the merged model of an
// adapter, a GGUF folder for llama.cpp and Ollama in the chosen variant, ...; clearing the cached
// merged build); Push sends it to a Hub repo in one of the same formats.

import { api, downloadUrl } from "../api.js";
import { age, el, errorBox, number } from "../widgets.js";
import { transferLine } from "./transfer.js";

// the export formats of each job (GET /api/jobs/{id}/checkpoints/formats), asked once per job
const formatsOf = new Map();
// the variant chosen per checkpoint and format ("job/step/format"): the table is redrawn as
// checkpoints arrive and a job ends, and a choice must survive that
const chosenVariant = new Map();

function exportFormats(jobId) {
  if (!formatsOf.has(jobId)) {
    const asked = api(`/jobs/${jobId}/checkpoints/formats`).then((r) => r.data);
    asked.catch(() => formatsOf.delete(jobId)); // asked again by the next redraw
    formatsOf.set(jobId, asked);
  }
  return formatsOf.get(jobId);
}

// The download of one export format (with its variant's select when it has variants).
function formatDownload(jobId, step, f) {
  const download = (variant) => downloadUrl(`/jobs/${jobId}/checkpoints/${step}/download`, { format: f.name, variant });
  const key = `${jobId}/${step}/${f.name}`;
  const chosen = () => chosenVariant.get(key) ?? f.default_variant;
  const link = el("a", {
    class: `button secondary download-${f.name}`,
    download: "",
    href: download(chosen()),
    title: `${f.summary} (built once, then kept)`,
    text: f.label,
  });
  if (!f.variants.length) return [link];
  const select = el(
    "select",
    {
      class: `variant-${f.name}`,
      "aria-label": `${f.label} variant`,
      onchange: (ev) => {
        chosenVariant.set(key, ev.target.value);
        link.href = download(ev.target.value);
      },
    },
    ...f.variants.map((v) => el("option", { value: v, text: v })),
  );
  select.value = chosen();
  return [select, link];
}

// The formats of the job's listing the checkpoint can be exported in, but its own files (the
// row's first download, the push's first choice): a format refused for it is left out.
function usableFormats(formats, c) {
  return formats.filter((f) => f.name !== "checkpoint" && !f.refused && !(f.adapter_only && c.kind !== "adapter"));
}

// The downloads of every usable format, filled in once the job's formats are known.
function formatDownloads(jobId, c, onError) {
  const holder = el("span", { class: "export-formats" });
  exportFormats(jobId)
    .then((formats) => {
      holder.replaceChildren(...usableFormats(formats, c).flatMap((f) => formatDownload(jobId, c.step, f)));
    })
    .catch(onError);
  return holder;
}

// The push's format select (the checkpoint's own files, named as its first download, then each
// usable format once the job's formats are known) and the variant select of a format that has
// variants (a GGUF's quantization, its default chosen), as the downloads offer them.
function pushFormat(jobId, c) {
  const offered = new Map();
  const format = el(
    "select",
    { class: "push-format", "aria-label": "Format pushed" },
    el("option", { value: "checkpoint", text: c.kind === "adapter" ? "Adapter" : "Model" }),
  );
  const variant = el("select", { class: "push-variant", "aria-label": "Format variant", hidden: true });
  format.addEventListener("change", () => {
    const f = offered.get(format.value);
    variant.hidden = !f?.variants.length;
    variant.replaceChildren(...(f?.variants ?? []).map((v) => el("option", { value: v, text: v })));
    if (f?.default_variant) variant.value = f.default_variant;
    format.title = f?.summary ?? "";
  });
  exportFormats(jobId)
    .then((formats) => {
      for (const f of usableFormats(formats, c)) {
        offered.set(f.name, f);
        format.append(el("option", { value: f.name, text: f.label, title: f.summary }));
      }
    })
    .catch(() => {}); // the row's downloads say why the formats are missing
  const chosen = () => ({ format: format.value, ...(variant.hidden ? {} : { variant: variant.value }) });
  return { format, variant, chosen };
}

// The Push button and, under the row, its form (repo id, private, the format and its variant)
// and the push's progress.
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
  const pushed = pushFormat(jobId, c);
  const problem = el("div", { class: "push-error" });
  const progress = el("div", { class: "push-progress", "aria-live": "polite" });
  const send = el("button", { type: "submit", class: "push-submit", text: "Push to the Hub" });
  const form = el(
    "form",
    { class: "push-form toolbar" },
    repo,
    el("label", {}, isPrivate, " private"),
    pushed.format,
    pushed.variant,
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
        body: { repo_id: repo.value.trim(), private: isPrivate.checked, ...pushed.chosen() },
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
      formatDownloads(jobId, c, onError),
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
      push.button,
    ),
  );
  return [row, push.panel];
}
