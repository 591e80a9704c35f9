// Jobs: every job with its status, progress, times and disk use, a Delete button for the finished
// ones, and the disk use of all jobs; filter by status. Refreshes every 3 s.

import { api } from "../api.js";
import { STATUSES, isActive } from "../kinds.js";
import { age, bytes, clock, duration, el, errorBox, statusBadge } from "../widgets.js";

const DELETABLE = ["succeeded", "failed", "cancelled", "interrupted", "paused"];
const COLUMNS = [
  "",
  "Name",
  "Status",
  "Progress",
  "Base model",
  "Created",
  "Started",
  "Finished",
  "Duration",
  "Disk",
  "",
];

// how long it ran: start to finish, or to now while it runs
function ran(j) {
  if (!j.started_at) return "–";
  const end = j.finished_at ? Date.parse(j.finished_at) : isActive(j.status) ? Date.now() : null;
  return end === null ? "–" : duration((end - Date.parse(j.started_at)) / 1000);
}

export async function render(main) {
  const filter = el(
    "select",
    { id: "status-filter" },
    el("option", { value: "", text: "all" }),
    Object.entries(STATUSES).map(([s, { label }]) => el("option", { value: s, text: label })),
  );
  const body = el("tbody");
  const more = el("button", { type: "button", class: "secondary", hidden: true, text: "Show more" });
  const diskTotal = el("span", { id: "disk-total", class: "muted small" });
  const problem = el("div", { id: "jobs-error" });
  // jobs ticked for Compare (2 to 6), kept across refreshes
  const picked = new Set();
  const compare = el("a", { class: "button secondary", id: "compare-jobs", hidden: true, text: "Compare" });
  function showPicked() {
    compare.hidden = picked.size < 2 || picked.size > 6;
    compare.textContent = `Compare ${picked.size}`;
    compare.href = `#/compare/${[...picked].join(",")}`;
  }
  let cursor = null;
  main.append(
    el(
      "div",
      { class: "title-row" },
      el("h1", { text: "Jobs" }),
      diskTotal,
      el("a", { class: "button", href: "#/jobs/new", text: "New job" }),
    ),
    el("div", { class: "toolbar" }, el("label", { for: "status-filter", text: "Status" }), filter, compare),
    problem,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "jobs-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            COLUMNS.map((h) => el("th", { text: h })),
          ),
        ),
        body,
      ),
    ),
    more,
  );

  function row(j) {
    const total = j.total_steps || 0;
    return el(
      "tr",
      { dataset: { jobId: j.id } },
      el(
        "td",
        {},
        el("input", {
          type: "checkbox",
          class: "pick-job",
          "aria-label": `select ${j.name} to compare`,
          checked: picked.has(j.id),
          onchange: (e) => {
            if (e.target.checked) picked.add(j.id);
            else picked.delete(j.id);
            showPicked();
          },
        }),
      ),
      el("td", {}, el("a", { href: `#/jobs/${j.id}`, text: j.name })),
      el("td", {}, statusBadge(j.status)),
      el(
        "td",
        {},
        el("progress", { max: total || 1, value: total ? j.step : 0, "aria-label": `progress of ${j.name}` }),
        el("span", { class: "muted small", text: total ? ` ${j.step}/${total}` : "" }),
      ),
      el("td", { text: j.base_model }),
      el("td", { class: "created", title: j.created_at, text: age(j.created_at) }),
      el("td", { class: "started", title: j.started_at || "", text: clock(j.started_at) }),
      el("td", { class: "finished", title: j.finished_at || "", text: clock(j.finished_at) }),
      el("td", { class: "duration", text: ran(j) }),
      el("td", { class: "disk", text: bytes(j.disk_bytes) }),
      el(
        "td",
        { class: "actions" },
        DELETABLE.includes(j.status)
          ? el("button", { type: "button", class: "danger delete-job", text: "Delete", onclick: () => remove(j) })
          : null,
      ),
    );
  }

  async function remove(j) {
    if (!confirm(`Delete job ${j.name} with its checkpoints and files?`)) return;
    try {
      await api(`/jobs/${j.id}`, { method: "DELETE" });
      problem.replaceChildren();
    } catch (err) {
      problem.replaceChildren(errorBox(err));
    }
    await load(false);
    await showDisk(true);
  }

  // the total walks every job's folder (cached by the server): on load, after a delete, every 30 s
  let diskAt = 0;
  async function showDisk(force) {
    if (!force && Date.now() - diskAt < 30_000) return;
    diskAt = Date.now();
    const d = await api("/disk");
    diskTotal.textContent = `${bytes(d.jobs_bytes)} on disk in ${d.jobs} job${d.jobs === 1 ? "" : "s"} · ${bytes(d.free_bytes)} free`;
  }

  let latest = 0;
  async function load(append) {
    const ticket = ++latest;
    const page = await api("/jobs", { query: { status: filter.value, limit: 50, cursor: append ? cursor : null } });
    if (ticket !== latest) return; // a newer request (a filter change) already answered or will
    cursor = page.next_cursor;
    more.hidden = !cursor;
    const rows = page.data.map(row);
    if (append) body.append(...rows);
    else
      body.replaceChildren(
        ...(rows.length
          ? rows
          : [
              el(
                "tr",
                {},
                el("td", { colspan: COLUMNS.length, class: "muted", text: "No jobs yet. Start one with New job." }),
              ),
            ]),
      );
    showDisk(false).catch(() => {});
  }

  filter.addEventListener("change", () => load(false));
  more.addEventListener("click", () => load(true));
  await load(false);
  const timer = setInterval(() => {
    if (!cursor) load(false).catch(() => {});
  }, 3000);
  return () => clearInterval(timer);
}
