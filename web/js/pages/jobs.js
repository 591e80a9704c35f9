// Jobs: every job with its status, progress and age; filter by status. Refreshes every 3 s.

import { api } from "../api.js";
import { STATUSES } from "../kinds.js";
import { age, el, statusBadge } from "../widgets.js";

export async function render(main) {
  const filter = el(
    "select",
    { id: "status-filter" },
    el("option", { value: "", text: "all" }),
    Object.entries(STATUSES).map(([s, { label }]) => el("option", { value: s, text: label })),
  );
  const body = el("tbody");
  const more = el("button", { type: "button", class: "secondary", hidden: true, text: "Show more" });
  let cursor = null;
  main.append(
    el(
      "div",
      { class: "title-row" },
      el("h1", { text: "Jobs" }),
      el("a", { class: "button", href: "#/jobs/new", text: "New job" }),
    ),
    el("div", { class: "toolbar" }, el("label", { for: "status-filter", text: "Status" }), filter),
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
            ["Name", "Status", "Progress", "Base model", "Created"].map((h) => el("th", { text: h })),
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
      el("td", {}, el("a", { href: `#/jobs/${j.id}`, text: j.name })),
      el("td", {}, statusBadge(j.status)),
      el(
        "td",
        {},
        el("progress", { max: total || 1, value: total ? j.step : 0, "aria-label": `progress of ${j.name}` }),
        el("span", { class: "muted small", text: total ? ` ${j.step}/${total}` : "" }),
      ),
      el("td", { text: j.base_model }),
      el("td", { title: j.created_at, text: age(j.created_at) }),
    );
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
          : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "No jobs yet. Start one with New job." }))]),
      );
  }

  filter.addEventListener("change", () => load(false));
  more.addEventListener("click", () => load(true));
  await load(false);
  const timer = setInterval(() => {
    if (!cursor) load(false).catch(() => {});
  }, 3000);
  return () => clearInterval(timer);
}
