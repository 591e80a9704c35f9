// One row of the job page's checkpoints table: step, kind, losses, age, and its downloads (the
// adapter or model; for an adapter the merged model too, and clearing that cached build; a GGUF
// folder for llama.cpp and Ollama in the chosen quantization).

import { api, downloadUrl } from "../api.js";
import { age, el, number } from "../widgets.js";

const QUANTS = ["q8_0", "q4_k_m", "f16", "bf16"];

function ggufDownload(jobId, step) {
  const url = (quant) => downloadUrl(`/jobs/${jobId}/checkpoints/${step}/download`, { gguf: quant });
  const link = el("a", {
    class: "button secondary download-gguf",
    download: "",
    href: url(QUANTS[0]),
    title: "The model as a GGUF file for llama.cpp and Ollama, with a Modelfile (built once, then kept)",
    text: "GGUF",
  });
  const quant = el(
    "select",
    {
      class: "gguf-quant",
      "aria-label": "GGUF quantization",
      onchange: (ev) => {
        link.href = url(ev.target.value);
      },
    },
    ...QUANTS.map((q) => el("option", { value: q, text: q })),
  );
  return [quant, link];
}

export function checkpointRow(jobId, c, onError) {
  return el(
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
    ),
  );
}
