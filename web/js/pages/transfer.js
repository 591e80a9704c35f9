// One Hub transfer (a model pull, a dataset pull or a checkpoint push) as a live line: status badge,
// progress bar, bytes done of total, speed and ETA, a Cancel button while it runs, and its error when
// it fails (a dataset pull's invalid rows listed by line).
// The line follows GET /api/transfers/{id}/stream until the transfer ends.

import { api, stream } from "../api.js";
import { bytes, duration, el, errorBox, showStatus } from "../widgets.js";

const ACTIVE = new Set(["queued", "running", "cancelling"]);

// transferLine(t, { label, onEnd }) -> { node, close }: onEnd(t) once the transfer ends.
export function transferLine(t, { label, onEnd } = {}) {
  const badge = el("span", { class: "status transfer-status" });
  const bar = el("progress", {
    class: "transfer-progress",
    max: 1,
    value: 0,
    "aria-label": `${label || t.repo_id} progress`,
  });
  const figures = el("span", { class: "transfer-bytes muted small" });
  const problem = el("div", { class: "transfer-error" });
  const cancel = el("button", {
    type: "button",
    class: "secondary cancel-transfer",
    text: "Cancel",
    onclick: async () => {
      cancel.disabled = true;
      try {
        show(await api(`/transfers/${t.id}/cancel`, { method: "POST" }));
      } catch (err) {
        problem.replaceChildren(errorBox(err));
        cancel.disabled = false;
      }
    },
  });
  const node = el(
    "div",
    { class: "transfer progress-row", dataset: { transferId: t.id, repo: t.repo_id } },
    el("strong", { text: label || t.repo_id }),
    badge,
    bar,
    figures,
    cancel,
    problem,
  );
  let es = null;
  let ended = false;

  function show(now) {
    showStatus(badge, now.status);
    badge.classList.add("transfer-status");
    const total = now.bytes_total || 0;
    bar.max = Math.max(total, 1);
    bar.value = now.status === "succeeded" ? bar.max : Math.min(now.bytes_done, bar.max);
    const speed = now.bytes_per_s ? ` · ${bytes(now.bytes_per_s)}/s` : "";
    const eta = now.eta_s !== null && now.eta_s !== undefined ? ` · ${duration(now.eta_s)} left` : "";
    figures.textContent = `${bytes(now.bytes_done)} of ${total ? bytes(total) : "?"}${ACTIVE.has(now.status) ? speed + eta : ""}`;
    cancel.hidden = !ACTIVE.has(now.status) || now.status === "cancelling";
    if (now.error && now.status === "failed")
      problem.replaceChildren(errorBox({ message: now.error, details: now.details || [] }));
    if (!ACTIVE.has(now.status) && !ended) {
      ended = true;
      close();
      if (onEnd) onEnd(now);
    }
  }

  function close() {
    if (es) es.close();
    es = null;
  }

  show(t);
  if (!ended) es = stream(`/transfers/${t.id}/stream`, { progress: show });
  return { node, close };
}
