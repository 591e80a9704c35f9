// The new-job page's "Fit and time" card: POST /api/plan with the very body POST /api/jobs would
// get, shown as fit, memory, the longest sequence, tokens/s and ETA (a DPO job's with its
// reference pass, a GRPO job's with its rollouts). The ETA is the run end to end (total_s: its
// steps and what it costs besides them), and the card says what priced it (estimate).

import { api } from "../api.js";
import { duration, el, errorBox, number } from "../widgets.js";

// what stops a longer sequence (POST /api/plan's max_seq_len_limit)
const SEQ_LIMITS = {
  gpu_memory: "GPU memory",
  host_ram: "host RAM",
  context: "model context",
  planner: "planner range",
};
// A method of whole examples (DPO, ORPO: pairs; KTO: rows): each step trains its sequences per
// example (the batch counts examples; the plan's assumptions say what an example is and trains
// as); for a method with a reference, before the first step one forward over every example gives
// the reference log-probabilities (POST /api/plan's reference_s, part of the ETA; null when the
// example count is unknown).
function pairsNote(p) {
  const a = p.assumptions;
  const what = a.tuning === "lora" ? "the base model, adapter off" : "the initial weights";
  const pass = !a.needs_reference
    ? "no reference pass"
    : p.reference_s === null
      ? `the reference pass is not counted (pick a dataset for its ${a.example} count)`
      : `the reference pass over ${a.reference_pairs.toLocaleString("en-US")} ${a.example}s (${what}) takes ${duration(p.reference_s)}, in the ETA`;
  return `${a.objective.toUpperCase()}: ${a.example_sequences} per ${a.example}, ${a.sequences_per_step} a step; ${pass}.`;
}

// A GRPO job: each step first samples its completions, on the first GPU when the model fits there,
// else on the host's CPU (POST /api/plan's rollout: the worst case, every completion
// max_completion_tokens long), then trains on them; the ETA counts both. With num_iterations > 1
// a batch of completions trains that many steps, and a step counts that share of its sampling.
function rolloutNote(p) {
  const r = p.rollout;
  const copy = r.upload_s ? `, plus ${duration(r.upload_s)} copying the model there` : "";
  const kl = r.reference_s ? `, and ${duration(r.reference_s)} for the reference's log-probabilities (beta > 0)` : "";
  const reuse =
    r.iterations > 1 ? `, and ${duration(r.old_s)} for the policy's; each batch trains ${r.iterations} steps` : "";
  const when = r.iterations > 1 ? "a batch" : "a step";
  return (
    `GRPO: ${r.rows} completions of up to ${r.completion_tokens.toLocaleString("en-US")} tokens ${when}, ` +
    `sampled in ${duration(r.generation_s)} on ${r.reason} (~${number(r.tokens_per_s)} tokens/s, ${r.bound}-bound, ` +
    `assuming ${number(r.gflops)} GFLOP/s and ${number(r.memory_gb_s)} GB/s)${copy}${kl}${reuse}: ` +
    `${number(100 * p.rollout_share)}% of a ${duration(p.step_s)} step, in the ETA.`
  );
}

// Where the ETA comes from (POST /api/plan's estimate): a job of this model that ran on this box
// (its measured rate and, once it finished, its overheads), or the planner's assumptions.
function etaNote(p) {
  const steps = `${duration(p.eta_s)} of steps`;
  const besides = `${duration(p.overheads.total_s)} besides them`;
  if (p.estimate === "measured")
    return `ETA end to end from job ${p.calibrated_from}'s measured times on this box: ${steps} at its rate, plus ${besides} (its run less its steps: start, model load, data, warm-up, validation, checkpoints).`;
  const terms = "start, model load, data, first-step warm-up, validation, checkpoints, as assumed";
  if (p.estimate === "calibrated")
    return `ETA end to end: ${steps} at the rate job ${p.calibrated_from} measured on this box, plus ${besides} (${terms}).`;
  return `ETA end to end from the planner's assumptions: ${steps}, plus ${besides} (${terms}); once a job of this model has run on this box, its measured times price it.`;
}

// A LoRA job with either base (POST /api/plan's base_variants): the host RAM each needs against
// the host's, then PCIe bytes an iteration and the longest sequence that fits with each.
function baseNote(p) {
  const [b16, b4] = [16, 4].map((bits) => p.base_variants.find((v) => v.base_bits === bits));
  if (!b16 || !b4) return null;
  const ram = p.assumptions.host_ram_gb;
  const gb = (v) => `${number(v.host_ram_gb)} GB`;
  const ramFits = (v) => v.limit !== "host_ram";
  let lead;
  if (ram === null || ram === undefined) lead = `Host RAM: ${gb(b4)} with a 4-bit base, ${gb(b16)} without.`;
  else if (ramFits(b4) && !ramFits(b16))
    lead = `Fits in ${number(ram)} GB of RAM with a 4-bit base, needs ${gb(b16)} without.`;
  else if (!ramFits(b4))
    lead = `Needs ${gb(b4)} of RAM with a 4-bit base, ${gb(b16)} without: the host has ${number(ram)} GB.`;
  else lead = `Host RAM: ${gb(b4)} with a 4-bit base, ${gb(b16)} without (the host has ${number(ram)} GB).`;
  const pcie = (v) => (v.pcie_gb_per_iteration === null ? "–" : `${number(v.pcie_gb_per_iteration)} GB`);
  const seq = (v) => v.max_seq_len.toLocaleString("en-US");
  return (
    `${lead} PCIe per iteration: ${pcie(b4)} with a 4-bit base, ${pcie(b16)} without. ` +
    `Longest sequence: ${seq(b4)} tokens with a 4-bit base, ${seq(b16)} without.`
  );
}

// A vision-language model's images (POST /api/plan's assumptions.vision): the image tokens a row
// the plan assumed, from the images of the dataset's rows (their count and mean size) and what the
// model's image processor makes of one image; none without a dataset of images.
export function imageNote(v) {
  const size = v.image_size.join("x");
  const tower = `vision tower ${v.vision_tower}, projector ${v.projector}`;
  if (!v.images_from_data || !v.images_per_row)
    return `No images assumed (pick a dataset with images for their count and size); one ${size} image would be ${v.image_tokens_per_image.toLocaleString("en-US")} image tokens (${tower}).`;
  const images = `${number(v.images_per_row)} image${v.images_per_row === 1 ? "" : "s"}`;
  return `${number(v.image_tokens_per_row)} image tokens a row: ${images} a row of ${size} pixels on average (from the dataset's rows), each ${v.patches_per_image.toLocaleString("en-US")} patches and ${v.image_tokens_per_image.toLocaleString("en-US")} image tokens by the model's image processor (${tower}).`;
}

// decimal sizes, as the planner counts them: "98.3 kB", "168 MB", "32.1 GB"
const size = (n) => (n >= 1e9 ? `${number(n / 1e9)} GB` : n >= 1e6 ? `${number(n / 1e6)} MB` : `${number(n / 1e3)} kB`);
// a short time: "0.293 ms", "158 ms", "30.2 s"
const seconds = (s) => (s < 1 ? `${number(1000 * s)} ms` : `${number(s)} s`);

// where the link between the boxes comes from (POST /api/plan's assumptions.link_source)
const LINKS = {
  measured: "measured between these hosts by their last job together",
  nic: "the hosts' network cards' nominal speed, at 85% for TCP",
  nominal: "nominal: no host reports its link, so 10 Gbit/s at 85% is assumed",
};

// A job on several boxes (POST /api/plan's exchange): each box trains its share of every batch,
// then the boxes sum their gradients (a ring all-reduce of the fp32 gradients of the trained
// weights) before the optimizer step; the synchronous optimizer waits for that, the asynchronous
// one hides it behind the next iteration when it fits there. The scaling: the job's rate over one
// box's with the whole batch.
export function exchangeNote(p) {
  const ex = p.exchange;
  const a = p.assumptions;
  const link = LINKS[a.link_source] ?? (ex.link_measured ? "measured" : "nominal");
  const time = seconds(ex.seconds);
  const shown = seconds(ex.exposed_s);
  const cost = ex.hidden
    ? "hidden behind the next iteration (async optimizer)"
    : ex.exposed_s < ex.seconds
      ? `partly hidden behind the next iteration (async optimizer): it adds ${shown} to each step`
      : `it adds ${shown} to each ${seconds(p.step_s)} step`;
  const one = p.one_box;
  const scale =
    p.scaling === null
      ? one && !one.fits
        ? " The whole batch does not fit one box: no single-box rate to compare with."
        : ""
      : ` ${number(p.scaling)}x one box's ${number(one.tokens_per_s)} tokens/s with the whole batch.`;
  return (
    `Gradient exchange on ${p.hosts} boxes, each training ${a.rows_per_host.toLocaleString("en-US")} of each batch's ${a.batch_size.toLocaleString("en-US")} ${a.example}s: ` +
    `${size(ex.bytes_per_step)} a box a step over ${number(ex.link_gbps)} Gbit/s (${link}), ${time}; ${cost}.${scale}`
  );
}

// The card (``element``); ``schedule()`` plans ``body()`` 300 ms after the last call, a newer
// answer replacing an older one; ``stop()`` when the page goes. ``onPlan(plan, sent)``: each
// answer, with the body it planned (the page learns from it whether the base model is a VLM).
export function planCard(body, { onPlan = () => {} } = {}) {
  const planBox = el(
    "section",
    { id: "plan", class: "card", "aria-live": "polite" },
    el("h2", { text: "Fit and time" }),
    el("p", { class: "muted", text: "Planning…" }),
  );
  let planTimer = null;
  let planTicket = 0;
  async function refreshPlan() {
    const ticket = ++planTicket;
    try {
      const sent = body();
      const p = await api("/plan", { method: "POST", body: sent });
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
          el("p", {
            id: "plan-hardware",
            class: "muted",
            text: p.hosts > 1 ? `${p.hosts} boxes, each ${a.hardware}` : a.hardware,
          }),
          el("p", {
            id: "plan-fits",
            class: p.fits ? "fits" : "error",
            text: p.fits ? (p.hosts > 1 ? "Fits on each box." : "Fits on this box.") : "Does not fit.",
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
            p.assumptions.needs_reference
              ? el(
                  "div",
                  {},
                  el("dt", { text: "reference pass" }),
                  el("dd", { id: "plan-reference", text: duration(p.reference_s) }),
                )
              : null,
            a.vision
              ? el(
                  "div",
                  {},
                  el("dt", { text: "image tokens a row" }),
                  el("dd", { id: "plan-image-tokens", text: number(a.vision.image_tokens_per_row) }),
                )
              : null,
            p.rollout
              ? el(
                  "div",
                  {},
                  el("dt", { text: "rollouts a step" }),
                  el("dd", {
                    id: "plan-rollout",
                    text: `${duration(p.rollout_s)} (${number(100 * p.rollout_share)}% of the step)`,
                  }),
                )
              : null,
            p.exchange
              ? el(
                  "div",
                  {},
                  el("dt", { text: "gradient exchange a step" }),
                  el("dd", {
                    id: "plan-exchange-time",
                    text: `${seconds(p.exchange.seconds)}${p.exchange.hidden ? " (hidden)" : ""}`,
                  }),
                )
              : null,
            p.exchange
              ? el(
                  "div",
                  {},
                  el("dt", { text: "scaling" }),
                  el("dd", {
                    id: "plan-scaling",
                    text: p.scaling === null ? `– on ${p.hosts} boxes` : `${number(p.scaling)}x on ${p.hosts} boxes`,
                    title: "the job's tokens/s over one box's with the whole batch",
                  }),
                )
              : null,
            el(
              "div",
              {},
              el("dt", { text: "ETA" }),
              el("dd", { id: "plan-eta", text: duration(p.total_s), title: "the run end to end" }),
            ),
          ),
          p.total_s === null ? null : el("p", { id: "plan-eta-source", class: "muted small", text: etaNote(p) }),
          p.exchange ? el("p", { id: "plan-exchange", text: exchangeNote(p) }) : null,
          baseNote(p) ? el("p", { id: "plan-base-bits", text: baseNote(p) }) : null,
          el("p", {
            class: "muted small",
            text: `${p.partition ? `Stages ${p.partition}; ` : ""}${rate}; ${perSeq} (${hw}). An estimate: a finished job of this model on this box calibrates it (or the one POST /api/plan's calibrate_job_id names).`,
          }),
          a.vision ? el("p", { id: "plan-images", class: "muted small", text: imageNote(a.vision) }) : null,
          p.rollout ? el("p", { id: "plan-grpo", class: "muted small", text: rolloutNote(p) }) : null,
          p.assumptions.objective !== "sft" && !p.rollout
            ? el("p", { id: "plan-dpo", class: "muted small", text: pairsNote(p) })
            : null,
        ].filter(Boolean),
      );
      onPlan(p, sent);
    } catch (err) {
      if (ticket === planTicket) planBox.replaceChildren(el("h2", { text: "Fit and time" }), errorBox(err));
    }
  }
  return {
    element: planBox,
    schedule() {
      clearTimeout(planTimer);
      planTimer = setTimeout(refreshPlan, 300);
    },
    stop: () => clearTimeout(planTimer),
  };
}
