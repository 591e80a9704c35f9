// New job: base model, dataset, method and the key hyperparameters (engine settings under
// "Advanced"); the equivalent API request is shown and can be copied.

import { api } from "../api.js";
import { bytes, duration, el, errorBox, field, number } from "../widgets.js";

function num(value, attrs = {}) {
  return el("input", { type: "number", value, ...attrs });
}

function choice(options, selected) {
  return el(
    "select",
    {},
    options.map(([v, t]) => el("option", { value: v, text: t, selected: v === selected })),
  );
}

// "name — Qwen3-MoE, MoE · 8 of 128 experts, 30.5B parameters"
function modelLabel(m) {
  let moe = "";
  if (m.moe) {
    if (m.experts === null) moe = ", MoE";
    else if (m.active_experts === null) moe = `, MoE · ${m.experts} experts`;
    else moe = `, MoE · ${m.active_experts} of ${m.experts} experts`;
  }
  const n = m.parameters;
  const count = n >= 1e9 ? `${number(n / 1e9)}B` : n >= 1e6 ? `${number(n / 1e6)}M` : `${number(n / 1e3)}K`;
  const size = n ? `${count} parameters` : bytes(m.size_bytes);
  return `${m.name} — ${m.family || m.architecture || "?"}${moe}, ${size}`;
}

// The base model picker: the models the engine can fine-tune; the others (GET /api/models says
// why) as disabled options, their reasons in a list under the picker.
function modelPicker(models) {
  const usable = models.filter((m) => m.supported);
  const unusable = models.filter((m) => !m.supported);
  const select = choice(usable.map((m) => [m.name, modelLabel(m)]));
  if (!unusable.length) return [select, null];
  select.append(
    el(
      "optgroup",
      { label: "Not supported (see the list below)" },
      unusable.map((m) =>
        el("option", {
          value: m.name,
          text: `${m.name} — ${m.family || "unknown family"}: not supported`,
          title: m.unsupported_reason,
          disabled: true,
        }),
      ),
    ),
  );
  const reasons = el(
    "details",
    { id: "unsupported-models", class: "small" },
    el("summary", {
      text: `${unusable.length} model folder${unusable.length === 1 ? "" : "s"} cannot be fine-tuned`,
    }),
    el(
      "ul",
      {},
      unusable.map((m) =>
        el("li", { dataset: { model: m.name } }, el("strong", { text: m.name }), `: ${m.unsupported_reason}`),
      ),
    ),
  );
  return [select, reasons];
}

// A name that marks a held-out set ("heldout", "held-out", "validation", "val", "dev", "test", "eval").
const HELD_OUT = /(^|[^a-z])(held[-_ ]?out|valid(ation)?|val|dev|test|eval)([^a-z]|$)/i;

const stem = (d) =>
  d.name
    .toLowerCase()
    .replace(/\.(jsonl|csv|parquet)$/, "")
    .replace(/(^|[^a-z])(train(ing)?|held[-_ ]?out|valid(ation)?|val|dev|test|eval)(?=[^a-z]|$)/g, "$1")
    .replace(/[^a-z0-9]+/g, "");

// The held-out set of a training dataset: one whose name marks it held out and is the same once
// the markers are dropped ("inventory (train)" and "inventory (held-out)"); "" when none.
export function heldOutFor(list, trainId) {
  const train = list.find((d) => d.id === trainId);
  const match = train && list.find((d) => d !== train && HELD_OUT.test(d.name) && stem(d) === stem(train));
  return match ? match.id : "";
}

// The datasets to preselect: the newest one that is not a held-out set (else the newest), and its
// held-out set as validation. The list comes newest first.
export function suitableData(list) {
  const train = list.find((d) => !HELD_OUT.test(d.name)) ?? list[0];
  return train ? [train.id, heldOutFor(list, train.id)] : ["", ""];
}

export async function render(main) {
  const [models, datasets] = await Promise.all([api("/models"), api("/datasets")]);
  const [base, unsupported] = modelPicker(models.data);
  const [trainPick, validationPick] = suitableData(datasets.data);
  const train = choice(
    datasets.data.map((d) => [d.id, `${d.name} (${d.rows} rows)`]),
    trainPick,
  );
  const validation = choice(
    [["", "none (hold out a fraction instead)"], ...datasets.data.map((d) => [d.id, d.name])],
    validationPick,
  );
  const heldOut = num(0, { min: 0, max: 0.5, step: 0.01 });
  const lora = el("input", { type: "radio", name: "method", value: "lora", id: "method-lora", checked: true });
  const full = el("input", { type: "radio", name: "method", value: "full", id: "method-full" });
  const maxSteps = num(60, { min: 1 });
  const epochs = num("", { min: 0.01, step: 0.01, placeholder: "or epochs" });
  const batch = num(8, { min: 1 });
  const lr = num(0.0003, { min: 0, step: "any" });
  const schedule = choice(
    [
      ["cosine", "cosine"],
      ["linear", "linear"],
      ["constant", "constant"],
    ],
    "cosine",
  );
  const warmup = num(0, { min: 0 });
  const rank = num(16, { min: 1 });
  const maxLength = num(1024, { min: 8 });
  const every = num(20, { min: 1 });
  const evalEvery = num("", { min: 1, placeholder: "at the end only" });
  const microbatches = num(4, { min: 1 });
  // engine.async_optimizer: sync (false) waits for each optimizer step; async (true) overlaps the
  // CPU optimizer step with the next iteration, which then runs on weights one step old
  const mode = choice(
    [
      ["sync", "sync — exact"],
      ["async", "async — staleness 1"],
    ],
    "sync",
  );
  const dtype = choice(
    [
      ["auto", "auto (bf16 on GPUs, fp32 on CPU)"],
      ["bfloat16", "bfloat16"],
      ["float16", "float16"],
      ["float32", "float32"],
    ],
    "auto",
  );
  const devices = el("input", { type: "text", value: "auto", placeholder: "auto, or cuda:0,cuda:1" });
  const tf32 = el("input", { type: "checkbox", checked: true });
  // mixture-of-experts models: LoRA on the expert weights too (method.target_parameters), and
  // the routers' load-balancing loss (hyper.router_aux_loss); shown only for such a model
  const byName = new Map(models.data.map((m) => [m.name, m]));
  const isMoe = () => Boolean(byName.get(base.value)?.moe);
  const expertsLora = el("input", { type: "checkbox", id: "lora-experts" });
  const routerLoss = el("input", { type: "checkbox", id: "router-aux-loss" });
  const moeOptions = el(
    "fieldset",
    { id: "moe-options", hidden: true },
    el("legend", { text: "Mixture of experts" }),
    el("label", { for: "lora-experts" }, expertsLora, " LoRA on the experts too (not only on attention)"),
    el("label", { for: "router-aux-loss" }, routerLoss, " Router load-balancing loss (the model's coefficient)"),
  );
  const name = el("input", { type: "text", placeholder: "defaults to model on dataset", maxlength: 255 });
  const preview = el("pre", { id: "request-preview", class: "code" });
  const error = el("div", { id: "form-error", "aria-live": "polite" });
  const copy = el("button", { type: "button", class: "secondary", text: "Copy request" });
  const planBox = el(
    "section",
    { id: "plan", class: "card", "aria-live": "polite" },
    el("h2", { text: "Fit and time" }),
    el("p", { class: "muted", text: "Planning…" }),
  );

  // The POST /api/jobs body; POST /api/plan takes the very same one, so the plan is of this job.
  function body() {
    const b = {
      base_model: base.value,
      ...(train.value ? { dataset_id: train.value } : {}),
      data: { max_length: Number(maxLength.value) },
      method: lora.checked ? { kind: "lora", lora_r: Number(rank.value) } : { kind: "full" },
      hyper: {
        batch_size: Number(batch.value),
        learning_rate: Number(lr.value),
        schedule: schedule.value,
        warmup_steps: Number(warmup.value),
      },
      engine: {
        devices:
          devices.value.trim() === "auto"
            ? "auto"
            : devices.value
                .split(",")
                .map((s) => s.trim())
                .filter(Boolean),
        num_microbatches: Number(microbatches.value),
        async_optimizer: mode.value === "async",
        compute_dtype: dtype.value,
        tf32: tf32.checked,
      },
      checkpoint: { every_steps: Number(every.value) },
    };
    if (name.value.trim()) b.name = name.value.trim();
    if (validation.value) b.validation_dataset_id = validation.value;
    else if (Number(heldOut.value) > 0) b.data.validation_fraction = Number(heldOut.value);
    if (maxSteps.value) b.hyper.max_steps = Number(maxSteps.value);
    if (epochs.value) b.hyper.epochs = Number(epochs.value);
    if (evalEvery.value) b.eval = { every_steps: Number(evalEvery.value) };
    if (isMoe()) {
      if (lora.checked && expertsLora.checked) b.method.target_parameters = ["experts"];
      if (routerLoss.checked) b.hyper.router_aux_loss = true;
    }
    return b;
  }

  // what stops a longer sequence (POST /api/plan's max_seq_len_limit)
  const SEQ_LIMITS = {
    gpu_memory: "GPU memory",
    host_ram: "host RAM",
    context: "model context",
    planner: "planner range",
  };
  let planTimer = null;
  let planTicket = 0;
  async function refreshPlan() {
    const ticket = ++planTicket;
    try {
      const p = await api("/plan", { method: "POST", body: body() });
      if (ticket !== planTicket) return;
      const a = p.assumptions;
      const cpu = a.device === "cpu";
      const gpus = cpu
        ? "the workers report no GPU, so this plans one CPU worker (devices auto)"
        : a.detected.includes("GPU count")
          ? "GPUs as the workers report them"
          : "no worker is online, so this assumes 2 GPUs of 24 GB (POST /api/plan takes others)";
      const hw = `${gpus}${a.detected.length ? `; read off the workers: ${a.detected.join(", ")}` : ""}`;
      const rate = cpu
        ? `${number(1000 * a.gpu_tflops)} GFLOP/s fp32 on the CPU (an assumed rate per core, measured on a 2-core host)`
        : `${number(a.gpu_tflops)} TFLOPS per GPU at ${number(100 * a.efficiency)}% efficiency, ${number(a.link_gb_s)} GB/s host link`;
      const perSeq = a.tokens_from_data
        ? `${number(a.tokens_per_sequence)} tokens per sequence, from the dataset's token counts`
        : "every sequence max_length tokens long (pick a dataset for its real lengths)";
      planBox.replaceChildren(
        ...[
          el("h2", { text: "Fit and time" }),
          el("p", { id: "plan-hardware", class: "muted", text: a.hardware }),
          el("p", {
            id: "plan-fits",
            class: p.fits ? "fits" : "error",
            text: p.fits ? "Fits on this box." : "Does not fit.",
          }),
          p.problems.length
            ? el(
                "ul",
                { class: "errors" },
                p.problems.map((t) => el("li", { text: t })),
              )
            : null,
          p.suggestions.length
            ? el(
                "ul",
                {},
                p.suggestions.map((t) => el("li", { text: `Try: ${t}` })),
              )
            : null,
          el(
            "dl",
            { class: "stats" },
            el(
              "div",
              {},
              el("dt", { text: cpu ? "worker memory (largest stage)" : "GPU memory (largest stage)" }),
              el("dd", { text: `${number(p.gpu_memory_needed_gb)} of ${number(p.gpu_memory_gb)} GB` }),
            ),
            el("div", {}, el("dt", { text: "host RAM" }), el("dd", { text: `${number(p.host_ram.total_gb)} GB` })),
            el(
              "div",
              {},
              el("dt", { text: "longest sequence that fits" }),
              el("dd", {
                id: "plan-max-seq-len",
                text: `${p.max_seq_len.toLocaleString("en-US")} tokens (${SEQ_LIMITS[p.max_seq_len_limit] ?? p.max_seq_len_limit})`,
                title:
                  "the longest sequence whose plan fits, at this batch and micro-batch count, and what stops a longer one",
              }),
            ),
            el(
              "div",
              {},
              el("dt", { text: "predicted tokens/s" }),
              el("dd", { id: "plan-tokens", text: number(p.tokens_per_s) }),
            ),
            el("div", {}, el("dt", { text: "ETA" }), el("dd", { id: "plan-eta", text: duration(p.eta_s) })),
          ),
          el("p", {
            class: "muted small",
            text: `${p.partition ? `Stages ${p.partition}; ` : ""}${rate}; ${perSeq} (${hw}). An estimate: a finished job on this box calibrates it (POST /api/plan with calibrate_job_id).`,
          }),
        ].filter(Boolean),
      );
    } catch (err) {
      if (ticket === planTicket) planBox.replaceChildren(el("h2", { text: "Fit and time" }), errorBox(err));
    }
  }

  function update() {
    moeOptions.hidden = !isMoe();
    clearTimeout(planTimer);
    planTimer = setTimeout(refreshPlan, 300);
    const json = JSON.stringify(body(), null, 2);
    preview.textContent = `curl -X POST ${location.origin}/api/jobs \\\n  -H "Authorization: Bearer $ROUNDHOUSE_KEY" \\\n  -H "Content-Type: application/json" \\\n  -d '${json}'`;
  }

  const form = el(
    "form",
    { id: "new-job-form", class: "card" },
    field("job-name", "Name", name),
    field("base-model", "Base model", base),
    unsupported,
    field("dataset", "Training data", train, datasets.data.length ? null : "upload a dataset first"),
    field("validation-dataset", "Validation data", validation),
    field("held-out", "Held-out fraction", heldOut, "used when no validation data is chosen"),
    el(
      "fieldset",
      {},
      el("legend", { text: "Method" }),
      el("label", { for: "method-lora" }, lora, " LoRA (adapter; small download)"),
      el("label", { for: "method-full" }, full, " Full fine-tune"),
    ),
    moeOptions,
    el(
      "div",
      { class: "grid" },
      field("max-steps", "Max steps", maxSteps),
      field("epochs", "Epochs", epochs, "used when max steps is empty"),
      field("batch-size", "Batch size (sequences)", batch),
      field("learning-rate", "Learning rate", lr),
      field("schedule", "Schedule", schedule),
      field("warmup", "Warmup steps", warmup),
      field("lora-r", "LoRA rank", rank),
      field("max-length", "Max sequence length", maxLength),
      field("checkpoint-every", "Checkpoint every (steps)", every),
      field("eval-every", "Validate every (steps)", evalEvery),
    ),
    el(
      "details",
      { id: "advanced" },
      el("summary", { text: "Advanced: engine" }),
      el(
        "div",
        { class: "grid" },
        field("num-microbatches", "Micro-batches per step", microbatches, "at least the number of GPUs"),
        field(
          "optimizer-mode",
          "Optimizer step",
          mode,
          "async overlaps the CPU optimizer step with the next iteration",
        ),
        field("compute-dtype", "Compute dtype", dtype),
        field("devices", "Devices", devices),
        field("tf32", "TF32 matmuls", tf32, "float32 compute on GPUs: faster, ~10-bit products"),
      ),
    ),
    error,
    el("div", { class: "actions" }, el("button", { type: "submit", text: "Start fine-tune" })),
    el("h2", { text: "The same request from a script" }),
    preview,
    copy,
  );

  // the validation set follows the training set until the user picks one
  let validationPicked = false;
  validation.addEventListener("change", () => (validationPicked = true));
  train.addEventListener("change", () => {
    if (!validationPicked) validation.value = heldOutFor(datasets.data, train.value);
  });
  form.addEventListener("input", update);
  form.addEventListener("change", update);
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(preview.textContent);
      copy.textContent = "Copied";
    } catch {
      const range = document.createRange();
      range.selectNodeContents(preview);
      getSelection().removeAllRanges();
      getSelection().addRange(range);
      copy.textContent = "Selected: press Ctrl+C";
    }
  });
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    error.replaceChildren();
    for (const bad of form.querySelectorAll("[aria-invalid]")) bad.removeAttribute("aria-invalid");
    try {
      const job = await api("/jobs", { method: "POST", body: body() });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      error.replaceChildren(errorBox(err));
      const param = (err.param || "").split(".").pop().replace(/_/g, "-");
      const target = param && form.querySelector(`#${CSS.escape(param)}`);
      if (target) {
        target.setAttribute("aria-invalid", "true");
        target.focus();
      }
    }
  });
  main.append(el("h1", { text: "New fine-tune" }), planBox, form);
  update();
  return () => clearTimeout(planTimer);
}
