// New job: base model, dataset, method (as GET /api/methods lists them: supervised fine-tuning as
// the two radios LoRA and full fine-tune, every other method one radio with its options rendered
// from its schema, method-options.js) and the key hyperparameters (engine settings under
// "Advanced"); the equivalent API request is shown and can be copied.

import { api } from "../api.js";
import { bytes, el, errorBox, field, number } from "../widgets.js";
import { methodOptions, resolved } from "./method-options.js";
import { placementFields } from "./placement-fields.js";
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

// Which datasets a method trains on: those whose format (GET /api/datasets/formats) is of the
// method's data_format (GET /api/methods). POST /api/jobs refuses the others. ``families``: each
// format's data_format.
export function fits(dataset, dataFormat, families) {
  return families.get(dataset.format) === dataFormat;
}

// The datasets to preselect: of those that fit the method (all, when none does), the newest one
// that is not a held-out set (else the newest), and its held-out set as validation. The list comes
// newest first.
export function suitableData(list, dataFormat, families) {
  const fitting = list.filter((d) => fits(d, dataFormat, families));
  const pool = fitting.length ? fitting : list;
  const train = pool.find((d) => !HELD_OUT.test(d.name)) ?? pool[0];
  return train ? [train.id, heldOutFor(list, train.id)] : ["", ""];
}

// "a, b or c"
function either(words) {
  return words.length > 1 ? `${words.slice(0, -1).join(", ")} or ${words.at(-1)}` : (words[0] ?? "");
}

// a method's name in a phrase: its title up to a parenthesis ("DPO", "Supervised fine-tuning")
const shortTitle = (m) => m.title.split(" (")[0];

export async function render(main) {
  const [models, datasets, workers, methods, formats] = await Promise.all([
    api("/models"),
    api("/datasets"),
    api("/gpus").catch(() => ({ hosts: [] })),
    api("/methods"),
    api("/datasets/formats"),
  ]);
  // each dataset format's data_format, and what a method's data_format reads, in words
  const families = new Map(formats.data.map((f) => [f.name, f.family]));
  const wanted = (family) => {
    const titles = formats.data.filter((f) => f.family === family).map((f) => f.title);
    return `a ${titles.length ? either(titles) : family} dataset`;
  };
  // the methods that train on a data format, for the datasets that do not fit the chosen one
  const trainedBy = (family) => either(methods.data.filter((m) => m.data_format === family).map(shortTitle));
  const sft = methods.data.find((m) => m.name === "sft");
  const others = methods.data.filter((m) => m !== sft);
  const [base, unsupported] = modelPicker(models.data);
  const [trainPick, validationPick] = suitableData(datasets.data, sft?.data_format, families);
  const train = choice(
    datasets.data.map((d) => [d.id, d.name]),
    trainPick,
  );
  const dataHint = el("p", { id: "dataset-fit", class: "hint", "aria-live": "polite" });
  const validation = choice(
    [["", "none (hold out a fraction instead)"], ...datasets.data.map((d) => [d.id, d.name])],
    validationPick,
  );
  const heldOut = num(0, { min: 0, max: 0.5, step: 0.01 });
  // supervised fine-tuning: two radios, LoRA (#method-lora) and full (#method-full)
  const lora = el("input", { type: "radio", name: "method", value: "lora", id: "method-lora", checked: true });
  const full = el("input", { type: "radio", name: "method", value: "full", id: "method-full" });
  // every other method of the listing: a radio (#method-<name>) and its options (method-options.js)
  const radios = others.map((m) =>
    el("input", { type: "radio", name: "method", value: m.name, id: `method-${m.name}` }),
  );
  const options = new Map(
    others.map((m) => [
      m.name,
      methodOptions(m, {
        data: wanted(m.data_format),
        context: () => ({ baseModel: base.value, datasetId: train.value }),
      }),
    ]),
  );
  const chosen = () => others.find((m) => m.name === radios.find((r) => r.checked)?.value) ?? sft;
  const chosenOptions = () => options.get(chosen()?.name);
  const usesLora = () => lora.checked || Boolean(chosenOptions()?.usesLora());
  // a 4-bit base where the chosen method's schema allows method.base_bits=4
  const allowsFourBits = () => (chosen()?.options_schema.properties.base_bits?.enum ?? []).includes(4);
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
  // a vision-language model: how its vision tower and projector train (method.vision_tower,
  // method.projector: the common fields' schema, from GET /api/methods); shown only for a VLM.
  // GET /api/models does not say which models are VLMs: the plan of the chosen one does (its
  // assumptions.vision), so the fields appear once the base model's first plan answers.
  const visionModels = new Map(); // base model -> whether its plan priced a vision tower
  const isVlm = () => visionModels.get(base.value) === true;
  const visionSelect = (option) => {
    const [p] = resolved(sft?.options_schema.properties[option] ?? { enum: ["frozen"], default: "frozen" });
    const select = choice(
      p.enum.map((v) => [v, v]),
      p.default,
    );
    return [select, p];
  };
  const [towerSelect, towerSchema] = visionSelect("vision_tower");
  const [projectorSelect, projectorSchema] = visionSelect("projector");
  const visionOptions = el(
    "fieldset",
    { id: "vision-options", hidden: true },
    el("legend", { text: "Vision-language model" }),
    el(
      "div",
      { class: "grid" },
      field("vision-tower", towerSchema.title ?? "Vision tower", towerSelect, towerSchema.description),
      field("projector", projectorSchema.title ?? "Vision projector", projectorSelect, projectorSchema.description),
    ),
  );
  const name = el("input", { type: "text", placeholder: "defaults to model on dataset", maxlength: 255 });
  // placement: one host, or several boxes at once (GET /api/gpus lists the hosts)
  const placement = placementFields(workers.hosts || []);
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
  // hyper.batch_size counts a dataset's rows: sequences, or a preference job's pairs (2 sequences
  // each, as the plan card says)
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
      method: {
        ...(chosenOptions()?.method() ?? { objective: "sft", tuning: lora.checked ? "lora" : "full" }),
        ...(usesLora() ? { lora_r: Number(rank.value) } : {}),
        ...(usesLora() && allowsFourBits() && fourBit.checked ? { base_bits: 4 } : {}),
      },
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
    const where = placement.value();
    if (where) b.placement = where;
    if (validation.value) b.validation_dataset_id = validation.value;
    else if (Number(heldOut.value) > 0) b.data.validation_fraction = Number(heldOut.value);
    if (maxSteps.value) b.hyper.max_steps = Number(maxSteps.value);
    if (epochs.value) b.hyper.epochs = Number(epochs.value);
    if (evalEvery.value) b.eval = { every_steps: Number(evalEvery.value) };
    if (isMoe()) {
      if (usesLora() && expertsLora.checked) b.method.target_parameters = ["experts"];
      if (routerLoss.checked) b.hyper.router_aux_loss = true;
    }
    if (isVlm()) {
      b.method.vision_tower = towerSelect.value;
      b.method.projector = projectorSelect.value;
    }
    return b;
  }

  // only the fields of the chosen method; the dataset pickers say which datasets fit it
  function showMethod() {
    const m = chosen();
    const family = m?.data_format;
    for (const [name, o] of options) o.show(name === m?.name);
    rankField.hidden = !usesLora();
    fourBitField.hidden = !usesLora() || !allowsFourBits();
    batchField.querySelector("label").textContent =
      `Batch size (${(m?.sequences_per_example ?? 1) > 1 ? "rows" : "sequences"})`;
    datasets.data.forEach((d, i) => {
      const ok = fits(d, family, families);
      const other = families.get(d.format);
      const option = train.options[i];
      option.textContent = `${d.name} (${d.rows} rows, ${d.format})${ok ? "" : ` — for ${trainedBy(other) || "no method"}`}`;
      option.dataset.fits = String(ok);
      const held = validation.options[i + 1];
      held.textContent = `${d.name}${ok ? "" : " (does not fit)"}`;
      held.dataset.fits = String(ok);
    });
    const picked = datasets.data.find((d) => d.id === train.value);
    const misfit = Boolean(picked && !fits(picked, family, families));
    const fitting = datasets.data.filter((d) => fits(d, family, families)).length;
    dataHint.textContent = misfit
      ? `${picked.name} is ${wanted(families.get(picked.format))}: this method needs ${wanted(family)}.`
      : `This method trains on ${wanted(family)}; ${fitting} of ${datasets.data.length} fit.`;
    dataHint.title = formats.data
      .filter((f) => f.family === family)
      .map((f) => `${f.title}: ${f.description}`)
      .join("\n");
    dataHint.classList.toggle("error", misfit);
  }

  function update() {
    moeOptions.hidden = !isMoe();
    visionOptions.hidden = !isVlm();
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
      ...others.map((m, i) =>
        el(
          "label",
          { for: `method-${m.name}`, title: `${m.title}: ${m.description}` },
          radios[i],
          ` ${shortTitle(m)} (${m.data_format})`,
        ),
      ),
    ),
    ...[...options.values()].map((o) => o.element),
    moeOptions,
    visionOptions,
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
    placement.element,
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
  for (const radio of [lora, full, ...radios])
    radio.addEventListener("change", () => {
      const family = chosen()?.data_format;
      const picked = datasets.data.find((d) => d.id === train.value);
      const [better] = suitableData(datasets.data, family, families);
      const fitting = datasets.data.find((d) => d.id === better);
      if (!picked || fits(picked, family, families) || !fitting || !fits(fitting, family, families)) return;
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
      const path = (err.param || "").split(".");
      // a field of the chosen method's own: its control (a field inside the grader: its text box)
      const own = path[0] === "method" && path.length > 1 ? chosenOptions()?.controlId(path[1]) : null;
      const last = path.at(-1).replace(/_/g, "-");
      // the error's field -> the control's id where they differ
      const param =
        own ||
        {
          "dataset-id": "dataset",
          "validation-dataset-id": "validation-dataset",
          "base-bits": "base-4bit",
          ...placement.controls,
        }[last] ||
        last;
      const target = param && form.querySelector(`#${CSS.escape(param)}`);
      if (target) {
        target.setAttribute("aria-invalid", "true");
        target.focus();
      }
    }
  });
  // a plan of a base model not seen before says whether it is a VLM: its fields show or hide
  const plan = planCard(body, {
    onPlan(p, sent) {
      const vlm = Boolean(p.assumptions.vision);
      const shown = visionModels.get(sent.base_model) === true;
      visionModels.set(sent.base_model, vlm);
      if (shown !== vlm) update();
    },
  });
  main.append(el("h1", { text: "New fine-tune" }), plan.element, form);
  update();
  return () => plan.stop();
}
