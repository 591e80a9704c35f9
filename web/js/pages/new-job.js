// New job: base model, dataset, method (LoRA, full, a preference method on pairs: DPO, ORPO, or
// reinforcement fine-tuning on prompts with a grader: GRPO, as GET /api/methods lists them) and the
// key hyperparameters (engine settings under "Advanced"); the equivalent API request is shown and
// can be copied.

import { api } from "../api.js";
import { bytes, el, errorBox, field, number } from "../widgets.js";
import { grpoOptions } from "./grpo-options.js";
import { planCard } from "./plan-card.js";

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
  return `${m.name} — ${m.family || m.architecture || "?"}${moe}, ${size}${m.quantization ? `, ${m.quantization}` : ""}`;
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

// The datasets to preselect: of those that fit the method (all, when none does), the newest one
// that is not a held-out set (else the newest), and its held-out set as validation. The list comes
// newest first.
export function suitableData(list, kind = "lora") {
  const fitting = list.filter((d) => fits(d, kind));
  const pool = fitting.length ? fitting : list;
  const train = pool.find((d) => !HELD_OUT.test(d.name)) ?? pool[0];
  return train ? [train.id, heldOutFor(list, train.id)] : ["", ""];
}

// The data format of each method that does not train on supervised rows (GET /api/methods:
// data_format "preference" or "prompts"), set when the page renders.
const methodFormats = new Map([
  ["dpo", "preference"],
  ["orpo", "preference"],
  ["grpo", "prompts"],
]);
const FORMATS = ["preference", "prompts"]; // a dataset format that is a method's data format

// Which datasets a method trains on: a preference method (DPO, ORPO) on preference datasets (a
// preferred and a rejected answer per prompt), GRPO on prompts datasets (a prompt and the fields
// its grader reads), the supervised methods on every other format. POST /api/jobs refuses the
// others.
export function fits(dataset, kind) {
  const has = FORMATS.includes(dataset.format) ? dataset.format : "supervised";
  return has === (methodFormats.get(kind) ?? "supervised");
}

function datasetLabel(d, kind) {
  const rows = d.format === "preference" ? `${d.rows} pairs, preference` : `${d.rows} rows, ${d.format}`;
  const wanted = methodFormats.get(kind);
  const why = wanted
    ? ` — not ${wanted === "preference" ? "preference pairs" : "prompts"}`
    : ` — for ${d.format === "prompts" ? "GRPO" : "preference methods"}`;
  return `${d.name} (${rows})${fits(d, kind) ? "" : why}`;
}

export async function render(main) {
  const [models, datasets, workers, methods] = await Promise.all([
    api("/models"),
    api("/datasets"),
    api("/gpus").catch(() => ({ hosts: [] })),
    api("/methods"),
  ]);
  const preference = methods.data.filter((m) => m.data_format === "preference");
  const reinforcement = methods.data.filter((m) => m.data_format === "prompts");
  methodFormats.clear();
  for (const m of [...preference, ...reinforcement]) methodFormats.set(m.name, m.data_format);
  const [base, unsupported] = modelPicker(models.data);
  const [trainPick, validationPick] = suitableData(datasets.data);
  const train = choice(
    datasets.data.map((d) => [d.id, datasetLabel(d, "lora")]),
    trainPick,
  );
  const dataHint = el("p", { id: "dataset-fit", class: "hint", "aria-live": "polite" });
  const validation = choice(
    [["", "none (hold out a fraction instead)"], ...datasets.data.map((d) => [d.id, d.name])],
    validationPick,
  );
  const heldOut = num(0, { min: 0, max: 0.5, step: 0.01 });
  const lora = el("input", { type: "radio", name: "method", value: "lora", id: "method-lora", checked: true });
  const full = el("input", { type: "radio", name: "method", value: "full", id: "method-full" });
  // one radio per preference method of the listing: #method-dpo, #method-orpo
  const prefRadios = preference.map((m) =>
    el("input", { type: "radio", name: "method", value: m.name, id: `method-${m.name}` }),
  );
  // one radio per prompts method of the listing (#method-grpo), with its options (grpo-options.js)
  const rlRadios = reinforcement.map((m) =>
    el("input", { type: "radio", name: "method", value: m.name, id: `method-${m.name}` }),
  );
  const rlOptions = new Map(
    reinforcement.map((m) => [
      m.name,
      grpoOptions(
        m,
        () => ({ baseModel: base.value, datasetId: train.value }),
        () => update(),
      ),
    ]),
  );
  const shortName = (m) => m.title.split(" ")[0];
  // a preference method: what it trains (method.dpo_tuning) and its beta (method.beta)
  const dpoTuning = choice(
    [
      ["lora", "LoRA adapter"],
      ["full", "every weight"],
    ],
    "lora",
  );
  const beta = num(0.1, { min: 0.001, max: 100, step: "any" });
  const prefLegend = el("legend", { text: "Preference tuning" });
  const prefHint = el("p", { class: "hint" });
  const betaField = field("dpo-beta", "Beta", beta, preference[0]?.config_fields.beta ?? " ");
  const dpoOptions = el(
    "fieldset",
    { id: "dpo-options", hidden: true },
    prefLegend,
    prefHint,
    field("dpo-tuning", "Trains", dpoTuning),
    betaField,
  );
  const kind = () => [...prefRadios, ...rlRadios].find((r) => r.checked)?.value ?? (full.checked ? "full" : "lora");
  const chosenMethod = () => preference.find((m) => m.name === kind());
  const chosenRl = () => rlOptions.get(kind());
  const usesLora = () =>
    lora.checked || (Boolean(chosenMethod()) && dpoTuning.value === "lora") || Boolean(chosenRl()?.usesLora());
  // the fieldset says what the chosen preference method is and what its fields mean
  function describeMethod(m) {
    prefLegend.textContent = `Preference tuning (${shortName(m)})`;
    prefHint.textContent = `${m.title}: ${m.description}. It needs a preference dataset.`;
    const help = betaField.querySelector(".hint");
    if (help) help.textContent = m.config_fields.beta ?? "";
    dpoTuning.options[0].textContent = m.needs_reference
      ? "LoRA adapter (the reference is the base model)"
      : "LoRA adapter";
    dpoTuning.options[1].textContent = m.needs_reference
      ? "every weight (reference computed once, first)"
      : "every weight";
  }
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
  // placement: a job runs on one host's GPUs (GET /api/gpus lists the hosts)
  const placeHost = choice([
    ["", "Any host"],
    ...(workers.hosts || []).map((h) => [
      h.hostname,
      `${h.hostname} — ${h.online ? (h.gpus ? `${h.gpus} GPU${h.gpus === 1 ? "" : "s"}` : "no GPU") : "offline"}`,
    ]),
  ]);
  const placeGpus = num("", { min: 1, step: 1, placeholder: "any" });
  const rankField = field("lora-r", "LoRA rank", rank);
  // a LoRA base in 4 bits (NF4): the block weights in host RAM and on PCIe at about a quarter
  const fourBit = el("input", { type: "checkbox", id: "base-4bit" });
  const fourBitField = el(
    "label",
    { for: "base-4bit", id: "base-4bit-field" },
    fourBit,
    " 4-bit base (QLoRA): the frozen weights in about a quarter of the host RAM and PCIe traffic",
  );
  // a checkpoint stored quantized (bitsandbytes 4-bit, MXFP4): kept packed as stored with a
  // 4-bit base, so the box starts checked when such a model is picked
  const storedHint = el("small", { id: "base-4bit-stored", class: "hint" });
  fourBitField.append(storedHint);
  let hintedModel = null;
  function showStored() {
    const q = byName.get(base.value)?.quantization;
    storedHint.hidden = !q;
    storedHint.textContent = q
      ? ` · stored ${q}: checked, its quantized weights stay packed as stored; unchecked, they are decoded to 16 bits on load`
      : "";
    if (q && hintedModel !== base.value) fourBit.checked = true;
    hintedModel = base.value;
  }
  // hyper.batch_size counts a DPO job's pairs (2 sequences each, as the plan card says)
  const batchField = field("batch-size", "Batch size (sequences)", batch);
  const preview = el("pre", { id: "request-preview", class: "code" });
  const error = el("div", { id: "form-error", "aria-live": "polite" });
  const copy = el("button", { type: "button", class: "secondary", text: "Copy request" });
  // The POST /api/jobs body; POST /api/plan takes the very same one, so the plan is of this job.
  function body() {
    const b = {
      base_model: base.value,
      ...(train.value ? { dataset_id: train.value } : {}),
      data: { max_length: Number(maxLength.value) },
      method: lora.checked
        ? { kind: "lora", lora_r: Number(rank.value), ...(fourBit.checked ? { base_bits: 4 } : {}) }
        : chosenRl()
          ? { ...chosenRl().method(), ...(usesLora() ? { lora_r: Number(rank.value) } : {}) }
          : chosenMethod()
            ? {
                kind: kind(),
                dpo_tuning: dpoTuning.value,
                beta: Number(beta.value),
                ...(usesLora() ? { lora_r: Number(rank.value) } : {}),
                ...(usesLora() && fourBit.checked ? { base_bits: 4 } : {}),
              }
            : { kind: "full" },
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
    if (placeHost.value || placeGpus.value)
      b.placement = { host: placeHost.value || null, gpus: placeGpus.value ? Number(placeGpus.value) : null };
    if (validation.value) b.validation_dataset_id = validation.value;
    else if (Number(heldOut.value) > 0) b.data.validation_fraction = Number(heldOut.value);
    if (maxSteps.value) b.hyper.max_steps = Number(maxSteps.value);
    if (epochs.value) b.hyper.epochs = Number(epochs.value);
    if (evalEvery.value) b.eval = { every_steps: Number(evalEvery.value) };
    if (isMoe()) {
      if (usesLora() && expertsLora.checked) b.method.target_parameters = ["experts"];
      if (routerLoss.checked) b.hyper.router_aux_loss = true;
    }
    return b;
  }

  // only the fields of the chosen method; the dataset pickers say which datasets fit it
  function showMethod() {
    const k = kind();
    const m = chosenMethod();
    const rl = chosenRl();
    dpoOptions.hidden = !m;
    if (m) describeMethod(m);
    for (const [name, options] of rlOptions) options.show(name === k);
    rankField.hidden = !usesLora();
    fourBitField.hidden = !usesLora() || Boolean(rl); // GRPO samples with the base's own weights
    batchField.querySelector("label").textContent = `Batch size (${m ? "pairs" : rl ? "prompts" : "sequences"})`;
    for (const [picker, offset] of [
      [train, 0],
      [validation, 1],
    ])
      datasets.data.forEach((d, i) => {
        const option = picker.options[i + offset];
        option.textContent = offset ? `${d.name}${fits(d, k) ? "" : " (does not fit)"}` : datasetLabel(d, k);
        option.dataset.fits = String(fits(d, k));
      });
    const chosen = datasets.data.find((d) => d.id === train.value);
    const wanted = m
      ? "a preference dataset (a preferred and a rejected answer per prompt)"
      : rl
        ? "a prompts dataset (a prompt per row, with the fields its grader reads)"
        : "a chat, instruction, prompt/completion or text dataset";
    const fitting = datasets.data.filter((d) => fits(d, k)).length;
    dataHint.textContent =
      chosen && !fits(chosen, k)
        ? `${chosen.name} is ${chosen.format === "preference" ? "preference pairs" : chosen.format}: this method needs ${wanted}.`
        : `This method trains on ${wanted}; ${fitting} of ${datasets.data.length} fit.`;
    dataHint.classList.toggle("error", Boolean(chosen && !fits(chosen, k)));
  }

  function update() {
    moeOptions.hidden = !isMoe();
    showStored();
    showMethod();
    plan.schedule();
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
    dataHint,
    field("validation-dataset", "Validation data", validation),
    field("held-out", "Held-out fraction", heldOut, "used when no validation data is chosen"),
    el(
      "fieldset",
      {},
      el("legend", { text: "Method" }),
      el("label", { for: "method-lora" }, lora, " LoRA (adapter; small download)"),
      el("label", { for: "method-full" }, full, " Full fine-tune"),
      ...preference.map((m, i) =>
        el(
          "label",
          { for: `method-${m.name}`, title: m.description },
          prefRadios[i],
          ` ${shortName(m)} (preference pairs)`,
        ),
      ),
      ...reinforcement.map((m, i) =>
        el(
          "label",
          { for: `method-${m.name}`, title: m.description },
          rlRadios[i],
          ` ${shortName(m)} (prompts, scored by a grader)`,
        ),
      ),
    ),
    dpoOptions,
    ...[...rlOptions.values()].map((o) => o.element),
    moeOptions,
    el(
      "div",
      { class: "grid" },
      field("max-steps", "Max steps", maxSteps),
      field("epochs", "Epochs", epochs, "used when max steps is empty"),
      batchField,
      field("learning-rate", "Learning rate", lr),
      field("schedule", "Schedule", schedule),
      field("warmup", "Warmup steps", warmup),
      rankField,
      fourBitField,
      field("max-length", "Max sequence length", maxLength),
      field("checkpoint-every", "Checkpoint every (steps)", every),
      field("eval-every", "Validate every (steps)", evalEvery),
    ),
    el(
      "fieldset",
      { id: "placement" },
      el("legend", { text: "Placement" }),
      el(
        "div",
        { class: "grid" },
        field("placement-host", "Host", placeHost, "runs only there (a job runs on one host's GPUs)"),
        field("placement-gpus", "GPUs", placeGpus, "a host with at least this many"),
      ),
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
  // a method change moves the training set to one that fits it, when the chosen one does not
  for (const radio of [lora, full, ...prefRadios, ...rlRadios])
    radio.addEventListener("change", () => {
      const chosen = datasets.data.find((d) => d.id === train.value);
      const [better] = suitableData(datasets.data, kind());
      const fitting = datasets.data.find((d) => d.id === better);
      if (!chosen || fits(chosen, kind()) || !fitting || !fits(fitting, kind())) return;
      train.value = better;
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
      const last = /^method\.grader\b/.test(err.param || "")
        ? "grader" // a field inside the grader: its text box
        : (err.param || "").split(".").pop().replace(/_/g, "-");
      // the error's field -> the control's id where they differ
      const param =
        {
          "dataset-id": "dataset",
          "validation-dataset-id": "validation-dataset",
          beta: chosenRl() ? "grpo-beta" : "dpo-beta",
          "group-size": "grpo-group-size",
          "max-completion-tokens": "grpo-max-completion-tokens",
          temperature: "grpo-temperature",
          "loss-type": "grpo-loss-type",
          "num-iterations": "grpo-num-iterations",
          host: "placement-host",
          gpus: "placement-gpus",
        }[last] || last;
      const target = param && form.querySelector(`#${CSS.escape(param)}`);
      if (target) {
        target.setAttribute("aria-invalid", "true");
        target.focus();
      }
    }
  });
  const plan = planCard(body);
  main.append(el("h1", { text: "New fine-tune" }), plan.element, form);
  update();
  return () => plan.stop();
}
