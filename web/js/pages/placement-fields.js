// The new-job page's "Placement" fields, posted as the job's placement: one host by name and/or a
// GPU count each host must have; or several boxes at once (placement.hosts: 1 to 64, or "auto":
// as many free hosts as fit), each training its share of every batch, and the fewest boxes the
// job may go on with after one is lost (placement.min_hosts). A job on several boxes is not
// pinned to one host, so the host picker is off while more than one box is asked for.

import { el, field } from "../widgets.js";

const MAX_HOSTS = 64; // POST /api/jobs's bound on placement.hosts

function choice(options, selected) {
  return el(
    "select",
    {},
    options.map(([v, t]) => el("option", { value: v, text: t, selected: v === selected })),
  );
}

// ``hosts``: GET /api/gpus's hosts. Returns the fieldset, the placement to post (null: anywhere)
// and ``controls``: each placement field's control id (an error's param names the field).
export function placementFields(hosts) {
  const online = hosts.filter((h) => h.online).length;
  const host = choice([
    ["", "Any host"],
    ...hosts.map((h) => [
      h.hostname,
      `${h.hostname} — ${h.online ? (h.gpus ? `${h.gpus} GPU${h.gpus === 1 ? "" : "s"}` : "no GPU") : "offline"}`,
    ]),
  ]);
  const gpus = el("input", { type: "number", min: 1, step: 1, placeholder: "any" });
  // 1 up to the online hosts (8 at least, so a job can wait for boxes still to come), and "auto"
  const most = Math.min(MAX_HOSTS, Math.max(8, online));
  const boxes = choice(
    [
      ...Array.from({ length: most }, (_, i) => [String(i + 1), i ? `${i + 1} boxes` : "1 box"]),
      ["auto", `as many as fit (${online} online now)`],
    ],
    "1",
  );
  const minBoxes = el("input", { type: "number", min: 1, max: MAX_HOSTS, step: 1, placeholder: "all of them" });
  const minField = field(
    "placement-min-hosts",
    "Min boxes after a fault",
    minBoxes,
    "a lost box pauses the job; it resumes from its checkpoint on this many or more (same batch)",
  );
  const several = () => boxes.value !== "1";
  function show() {
    host.disabled = several();
    if (several()) host.value = "";
    minField.hidden = !several();
    minBoxes.max = boxes.value === "auto" ? MAX_HOSTS : boxes.value;
    minBoxes.placeholder = boxes.value === "auto" ? "1" : "all of them";
  }
  boxes.addEventListener("change", show);
  show();
  const element = el(
    "fieldset",
    { id: "placement" },
    el("legend", { text: "Placement" }),
    el(
      "div",
      { class: "grid" },
      field("placement-host", "Host", host, "runs only there (one box)"),
      field("placement-gpus", "GPUs", gpus, "a host with at least this many (each box's)"),
      field(
        "placement-hosts",
        "Boxes",
        boxes,
        "hosts that train the job together, each its share of every batch; their gradients are summed each step",
      ),
      minField,
    ),
  );
  function value() {
    const out = {};
    if (host.value && !several()) out.host = host.value;
    if (gpus.value) out.gpus = Number(gpus.value);
    if (several()) {
      out.hosts = boxes.value === "auto" ? "auto" : Number(boxes.value);
      if (minBoxes.value) out.min_hosts = Number(minBoxes.value);
    }
    return Object.keys(out).length ? { host: null, gpus: null, ...out } : null;
  }
  const controls = {
    host: "placement-host",
    gpus: "placement-gpus",
    hosts: "placement-hosts",
    "min-hosts": "placement-min-hosts",
  };
  return { element, value, controls };
}
