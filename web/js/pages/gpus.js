// GPUs: every worker's devices under its host name, live from the telemetry stream.

import { stream } from "../api.js";
import { age, bytes, el, number } from "../widgets.js";

// One worker's devices: a table of its GPUs, or "No GPU" on a CPU-only host.
function workerBlock(h, { newest }) {
  const cpu = h.cpu || {};
  const cpuLine = el("p", {
    class: "muted",
    text: `CPU ${number(cpu.utilization)}% of ${cpu.cores || "?"} cores · RAM ${bytes(cpu.memory_used)} / ${bytes(cpu.memory_total)} · sampled ${age(h.sampled_at)} · worker ${h.worker}`,
  });
  const head = newest
    ? []
    : [
        el("p", {
          class: "muted small",
          text: `worker ${h.worker}: ${h.online ? "online" : "offline"}, last seen ${age(h.heartbeat_at)}`,
        }),
      ];
  if (!h.gpu) {
    return el(
      "div",
      { class: "worker" },
      ...head,
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
    "div",
    { class: "worker" },
    ...head,
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

// The workers grouped by host name (a job runs on one host's GPUs; placement.host names it):
// online workers first, the newest first.
export function byHost(workers) {
  const hosts = new Map();
  for (const w of workers) {
    if (!hosts.has(w.hostname)) hosts.set(w.hostname, []);
    hosts.get(w.hostname).push(w);
  }
  return [...hosts.entries()]
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([hostname, members]) => {
      members.sort((a, b) => b.online - a.online || Date.parse(b.heartbeat_at) - Date.parse(a.heartbeat_at));
      const online = members.filter((w) => w.online);
      return {
        hostname,
        online: online.length > 0,
        gpus: Math.max(0, ...online.map((w) => w.devices.length)),
        workers: members,
      };
    });
}

function hostCard(host) {
  const count = !host.online
    ? "no worker online"
    : host.gpus
      ? `${host.gpus} GPU${host.gpus === 1 ? "" : "s"}`
      : "no GPU";
  const head = el(
    "div",
    { class: "title-row" },
    el("h2", { text: host.hostname }),
    el(
      "span",
      {},
      el("span", { class: "muted", text: `${count} ` }),
      el("span", {
        class: `status ${host.online ? "status-running" : "status-failed"}`,
        text: host.online ? "online" : "offline",
      }),
    ),
  );
  return el(
    "article",
    { class: "card host", "data-host": host.hostname },
    head,
    ...host.workers.map((w, i) => workerBlock(w, { newest: i === 0 })),
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
          ? byHost(data).map(hostCard)
          : [el("p", { class: "muted", text: "No worker has reported yet. Start one with: roundhouse worker" })]),
      );
    },
  });
  return () => es.close();
}
