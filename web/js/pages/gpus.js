// GPUs: every worker host's devices, live from the telemetry stream.

import { stream } from "../api.js";
import { age, bytes, el, number } from "../widgets.js";

function hostCard(h) {
  const head = el(
    "div",
    { class: "title-row" },
    el("h2", { text: h.hostname }),
    el("span", {
      class: `status ${h.online ? "status-running" : "status-failed"}`,
      text: h.online ? "online" : "offline",
    }),
  );
  const cpu = h.cpu || {};
  const cpuLine = el("p", {
    class: "muted",
    text: `CPU ${number(cpu.utilization)}% of ${cpu.cores || "?"} cores · RAM ${bytes(cpu.memory_used)} / ${bytes(cpu.memory_total)} · sampled ${age(h.sampled_at)} · worker ${h.worker}`,
  });
  if (!h.gpu) {
    return el(
      "article",
      { class: "card host" },
      head,
      el("p", { class: "no-gpu", text: "No GPU on this host" }),
      el("p", { class: "muted small", text: h.message }),
      cpuLine,
    );
  }
  const rows = h.devices.map((d) =>
    el(
      "tr",
      {},
      el("td", { text: `${d.index}` }),
      el("td", { text: d.name }),
      el(
        "td",
        {},
        el("meter", { min: 0, max: 100, value: d.utilization ?? 0, "aria-label": `GPU ${d.index} utilization` }),
        ` ${number(d.utilization)}%`,
      ),
      el("td", { text: `${bytes(d.memory_used)} / ${bytes(d.memory_total)}` }),
      el("td", { text: d.temperature === null ? "–" : `${number(d.temperature)} °C` }),
      el("td", { text: d.power_w === null ? "–" : `${number(d.power_w)} W` }),
    ),
  );
  return el(
    "article",
    { class: "card host" },
    head,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        {},
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["#", "GPU", "Utilization", "Memory", "Temp.", "Power"].map((t) => el("th", { text: t })),
          ),
        ),
        el("tbody", {}, rows),
      ),
    ),
    cpuLine,
  );
}

export async function render(main) {
  const hosts = el(
    "div",
    { id: "gpu-hosts", "aria-live": "polite" },
    el("p", { class: "muted", text: "Waiting for the workers' telemetry…" }),
  );
  main.append(el("h1", { text: "GPUs" }), hosts);
  const es = stream("/gpus/stream", {
    gpus: (data) => {
      hosts.replaceChildren(
        ...(data.length
          ? data.map(hostCard)
          : [el("p", { class: "muted", text: "No worker has reported yet. Start one with: roundhouse worker" })]),
      );
    },
  });
  return () => es.close();
}
