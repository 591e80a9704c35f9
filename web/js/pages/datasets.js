// Datasets: upload (drop or pick; progress; errors by line), pull a split from the Hub
// (dataset-pull.js), list, preview through a model's chat template with the trained tokens
// highlighted (preference rows: the prompt, then both answers; prompt rows: the prompt, then the
// fields a grader reads; KTO rows: whether the completion is desirable), token-length histogram,
// delete. A row with images shows their thumbnails beside its tokens. An upload may be a zip or tar
// of a data file and the images its rows name. The row formats come from GET /api/datasets/formats.

import { api, upload } from "../api.js";
import { age, bytes, el, errorBox, number } from "../widgets.js";
import { pullCard } from "./dataset-pull.js";

function tokens(list) {
  return el(
    "pre",
    { class: "tokens" },
    list.map((t) => el("span", { class: t.trained ? "tok trained" : "tok", text: t.text })),
  );
}

// A row's images as thumbnails (data URLs the preview carries), in the order its text names them.
function thumbnails(images) {
  return el(
    "div",
    { class: "thumbs" },
    images.map((src, i) => el("img", { src, class: "thumb", alt: `image ${i + 1}`, title: `image ${i + 1}` })),
  );
}

// One previewed row; a preference row is its prompt, then the preferred and the rejected answer
// side by side (stacked on a narrow window); a row with images, its thumbnails beside its tokens.
function previewRow(r) {
  const row = previewBody(r);
  return r.images?.length ? el("div", { class: "with-images" }, thumbnails(r.images), row) : row;
}

function previewBody(r) {
  const where = el("div", { class: "muted small", text: `line ${r.line}${r.truncated ? " (truncated)" : ""}` });
  if (r.item)
    // a prompt row (GRPO): what the completions follow, and what its grader reads as item.<field>
    return el(
      "div",
      { class: "preview-row prompts" },
      where,
      el("h4", { text: "Prompt" }),
      el("div", { class: "prompt" }, tokens(r.tokens)),
      el("h4", { text: "Grader fields (item)" }),
      el("pre", { class: "item code", text: JSON.stringify(r.item, null, 2) }),
    );
  if (typeof r.label === "boolean")
    // an unpaired preference row (KTO): the prompt and its completion, and whether it is desirable
    return el(
      "div",
      { class: `preview-row unpaired ${r.label ? "preferred" : "rejected"}` },
      where,
      el("h4", { text: r.label ? "Desirable completion" : "Undesirable completion" }),
      tokens(r.tokens),
    );
  if (!r.chosen || !r.rejected) return el("div", { class: "preview-row" }, where, tokens(r.tokens));
  const answer = (kind, title, a) =>
    el(
      "div",
      { class: `answer ${kind}` },
      el("h4", { text: a.truncated ? `${title} (truncated)` : title }),
      tokens(a.tokens),
    );
  return el(
    "div",
    { class: "preview-row preference" },
    where,
    el("h4", { text: "Prompt" }),
    el("div", { class: "prompt" }, tokens(r.tokens)),
    el(
      "div",
      { class: "answers" },
      answer("preferred", "Preferred", r.chosen),
      answer("rejected", "Rejected", r.rejected),
    ),
  );
}

export async function render(main) {
  const input = el("input", {
    type: "file",
    id: "dataset-file",
    accept: ".jsonl,.csv,.parquet,.zip,.tar,.tar.gz,.tgz",
  });
  const name = el("input", {
    type: "text",
    id: "dataset-name",
    placeholder: "defaults to the file name",
    maxlength: 255,
  });
  const progress = el("progress", {
    id: "upload-progress",
    max: 1,
    value: 0,
    hidden: true,
    "aria-label": "upload progress",
  });
  const status = el("p", { id: "upload-status", "aria-live": "polite" });
  const errors = el("ul", { id: "upload-errors", class: "errors" });
  const moreErrors = el("p", { id: "upload-errors-more", class: "muted small" });
  // the row formats an upload may hold, as the server's registry lists them (GET /api/datasets/formats)
  const shapes = el("p", { id: "dataset-formats", class: "muted small" });
  let formats = [];
  const drop = el(
    "div",
    { id: "drop-zone", class: "drop-zone" },
    el("p", {}, "Drop a .jsonl, .csv or .parquet file (or a .zip or .tar of one with its images) here, or "),
    el("label", { for: "dataset-file", class: "button", text: "Dataset file" }),
    input,
    shapes,
  );
  const body = el("tbody");
  const preview = el("section", { id: "preview", class: "card", hidden: true });
  const pull = pullCard({ onStored: () => list() });
  main.append(
    el("h1", { text: "Datasets" }),
    el(
      "section",
      { class: "card" },
      el("h2", { text: "Upload" }),
      el("div", { class: "field" }, el("label", { for: "dataset-name", text: "Name" }), name),
      drop,
      progress,
      status,
      errors,
      moreErrors,
    ),
    pull.node,
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "datasets-table" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Name", "Format", "Rows", "Size", "Uploaded", ""].map((h) => el("th", { text: h })),
          ),
        ),
        body,
      ),
    ),
    preview,
  );

  async function list() {
    const { data } = await api("/datasets");
    body.replaceChildren(
      ...(data.length
        ? data.map((d) =>
            el(
              "tr",
              { dataset: { datasetId: d.id } },
              el("td", { text: d.name }),
              el("td", { text: d.format }),
              el("td", { text: d.rows }),
              el("td", { text: bytes(d.size_bytes) }),
              el("td", { title: d.created_at, text: age(d.created_at) }),
              el(
                "td",
                { class: "actions" },
                el("button", { type: "button", class: "secondary", text: "Preview", onclick: () => showPreview(d) }),
                el("button", { type: "button", class: "danger", text: "Delete", onclick: () => remove(d) }),
              ),
            ),
          )
        : [el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No datasets yet." }))]),
    );
  }

  async function send(file) {
    errors.replaceChildren();
    moreErrors.textContent = "";
    progress.hidden = false;
    progress.value = 0;
    status.textContent = `Uploading ${file.name}…`;
    try {
      const d = await upload("/datasets", file, { name: name.value.trim() }, (f) => {
        progress.value = f;
        if (f >= 1) status.textContent = `Validating ${file.name}…`;
      });
      status.textContent = `Stored ${d.name}: ${d.rows} rows (${d.format}).`;
      name.value = "";
      await list();
      await showPreview(d);
    } catch (error) {
      status.textContent = error.message;
      errors.replaceChildren(
        ...error.details.map((e) => el("li", { text: `${e.unit || "line"} ${e.line}: ${e.message}` })),
      );
      const more = error.detailsTotal - error.details.length;
      if (more > 0) moreErrors.textContent = `and ${more.toLocaleString("en-US")} more`;
    } finally {
      progress.hidden = true;
      input.value = "";
    }
  }

  async function remove(d) {
    if (!confirm(`Delete dataset ${d.name}?`)) return;
    try {
      await api(`/datasets/${d.id}`, { method: "DELETE" });
      if (preview.dataset.id === d.id) preview.hidden = true;
      await list();
    } catch (error) {
      status.textContent = error.message;
    }
  }

  async function showPreview(d) {
    const models = (await api("/models")).data.filter((m) => m.ready);
    const select = el(
      "select",
      { id: "preview-model" },
      models.map((m) => el("option", { value: m.name, text: m.name })),
    );
    const maxLength = el("input", { type: "number", id: "preview-max-length", min: 8, value: 1024 });
    const rows = el("div", { class: "preview-rows" });
    const histogram = el("rh-histogram", { id: "token-histogram", label: "token lengths" });
    const summary = el("p", { class: "muted" });
    preview.dataset.id = d.id;
    preview.hidden = false;
    preview.replaceChildren(
      el("h2", { text: `Preview: ${d.name}` }),
      el(
        "div",
        { class: "toolbar" },
        el("label", { for: "preview-model", text: "Chat template of" }),
        select,
        el("label", { for: "preview-max-length", text: "Max length" }),
        maxLength,
      ),
      el("p", { class: "muted small" }, "Highlighted tokens are trained on; the rest is context."),
      rows,
      el("h3", { text: "Token lengths" }),
      histogram,
      summary,
    );
    async function refresh() {
      if (!select.value) {
        rows.replaceChildren(el("p", { class: "muted", text: "No base model is ready to render the rows." }));
        return;
      }
      rows.replaceChildren(el("p", { class: "muted", text: "Rendering…" }));
      try {
        const q = { model: select.value, max_length: maxLength.value, limit: 5 };
        const [p, stats] = await Promise.all([
          api(`/datasets/${d.id}/preview`, { query: q }),
          api(`/datasets/${d.id}/stats`, { query: { model: select.value, max_length: maxLength.value } }),
        ]);
        rows.replaceChildren(...p.rows.map(previewRow));
        histogram.setBins(stats.histogram, stats.max_length);
        const measures = formats.find((f) => f.name === d.format)?.measures;
        const each = measures ? ` (${measures})` : "";
        summary.textContent = `${stats.sampled} of ${stats.rows} rows measured${each} · mean ${number(stats.mean)} tokens · longest ${stats.max} · ${number(100 * stats.truncated_share)}% longer than ${stats.max_length} (cut)`;
      } catch (error) {
        rows.replaceChildren(errorBox(error));
      }
    }
    select.addEventListener("change", refresh);
    maxLength.addEventListener("change", refresh);
    await refresh();
  }

  input.addEventListener("change", () => input.files.length && send(input.files[0]));
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    if (e.dataTransfer.files.length) send(e.dataTransfer.files[0]);
  });
  try {
    formats = (await api("/datasets/formats")).data;
    const described = formats.map((f) => f.description);
    shapes.textContent = `Rows: ${described.slice(0, -1).join(", ")} or ${described.at(-1)}.`;
  } catch (error) {
    shapes.textContent = error.message;
  }
  await list();
  await pull.start();
  return () => pull.close();
}
