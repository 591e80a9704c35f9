// The new-job page's GRPO options (a method of GET /api/methods whose data_format is "prompts"):
// the grader as JSON, checked as it is typed (POST /v1/fine_tuning/alpha/graders/validate), tried
// on the first rows of the chosen prompts dataset (POST /v1/fine_tuning/alpha/graders/run), and
// the sampling and loss settings (method.group_size, max_completion_tokens, temperature, beta,
// loss_type, num_iterations) with what trains (method.tuning).

import { api } from "../api.js";
import { el, field, number } from "../widgets.js";

// the example a new job starts from: an exact match against the row's reference answer
export const EXAMPLE_GRADER = {
  type: "string_check",
  name: "exact",
  input: "{{sample.output_text}}",
  reference: "{{item.reference_answer}}",
  operation: "eq",
};
const TRIAL_ROWS = 5;
const V1 = { root: "/v1" };

// the grader's text as JSON: [value, null], or [null, "why not"]
function parse(text) {
  try {
    const value = JSON.parse(text);
    if (value === null || typeof value !== "object" || Array.isArray(value))
      return [null, "the grader is a JSON object, such as the example"];
    return [value, null];
  } catch (e) {
    return [null, `not JSON: ${e.message}`];
  }
}

const num = (value, attrs) => el("input", { type: "number", value, ...attrs });

// ``entry``: the method's listing; ``context()``: {baseModel, datasetId} of the form now;
// ``changed()``: called when a field changes what the job would be.
export function grpoOptions(entry, context, changed) {
  const help = (name) => entry.config_fields[name] ?? "";
  const grader = el("textarea", { rows: 8, spellcheck: false, class: "code" });
  grader.value = JSON.stringify(EXAMPLE_GRADER, null, 2);
  const check = el("p", { id: "grader-check", class: "hint", "aria-live": "polite" });
  const tuning = el(
    "select",
    {},
    el("option", { value: "lora", text: "LoRA adapter" }),
    el("option", { value: "full", text: "every weight" }),
  );
  const groupSize = num(4, { min: 2, max: 64 });
  const maxTokens = num(64, { min: 1, max: 32768 });
  const temperature = num(1.0, { min: 0.01, max: 10, step: "any" });
  const beta = num(0.04, { min: 0, max: 100, step: "any" });
  const iterations = num(1, { min: 1, max: 16 });
  const lossType = el(
    "select",
    {},
    [
      ["grpo", "grpo: per completion, then over completions"],
      ["dapo", "dapo: over every token of the batch"],
      ["dr_grpo", "dr_grpo: no length bias"],
    ].map(([v, t]) => el("option", { value: v, text: t })),
  );
  const sample = el("input", { type: "text", placeholder: "empty: each row's reference_answer" });
  const tryButton = el("button", {
    type: "button",
    id: "try-grader",
    class: "secondary",
    text: `Try the grader on ${TRIAL_ROWS} samples`,
  });
  const trialError = el("div", { id: "grader-trial-error", "aria-live": "polite" });
  const trialRows = el("tbody");
  const trial = el(
    "table",
    { id: "grader-trial", hidden: true },
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        ["Line", "Prompt", "Sample", "Reward"].map((h) => el("th", { text: h })),
      ),
    ),
    trialRows,
  );
  const element = el(
    "fieldset",
    { id: "grpo-options", hidden: true },
    el("legend", { text: "Reinforcement fine-tuning (GRPO)" }),
    el("p", { class: "hint", text: `${entry.title}: ${entry.description}. It needs a prompts dataset.` }),
    field("grader", "Grader (JSON)", grader, help("grader")),
    check,
    el(
      "div",
      { class: "grid" },
      field(
        "grpo-tuning",
        "Trains",
        tuning,
        "the KL term's reference: LoRA's base, or a full fine-tune's initial weights (a copy in host RAM)",
      ),
      field("grpo-group-size", "Group size", groupSize, help("group_size")),
      field("grpo-max-completion-tokens", "Max completion tokens", maxTokens, help("max_completion_tokens")),
      field("grpo-temperature", "Temperature", temperature, help("temperature")),
      field("grpo-beta", "Beta (KL)", beta, help("beta")),
      field("grpo-loss-type", "Loss", lossType, help("loss_type")),
      field("grpo-num-iterations", "Steps per batch", iterations, help("num_iterations")),
    ),
    el(
      "div",
      { class: "grader-trial" },
      field("grader-sample", "Sample answer", sample, "graded against each of the first rows"),
      tryButton,
      trialError,
      trial,
    ),
  );

  // the grader checked by the API as it is typed (300 ms after the last key); a newer check wins
  let timer = null;
  let ticket = 0;
  function say(text, ok) {
    check.textContent = text;
    check.classList.toggle("error", !ok);
    check.classList.toggle("fits", ok);
    if (ok) grader.removeAttribute("aria-invalid");
    else grader.setAttribute("aria-invalid", "true");
  }
  async function validate() {
    const mine = ++ticket;
    const [spec, why] = parse(grader.value);
    if (!spec) return say(why, false);
    try {
      await api("/fine_tuning/alpha/graders/validate", { method: "POST", body: { grader: spec }, ...V1 });
      if (mine === ticket) say(`Valid ${spec.type} grader.`, true);
    } catch (err) {
      if (mine === ticket) say(err.param ? `${err.message}` : `The grader was not checked: ${err.message}`, false);
    }
  }
  grader.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(validate, 300);
  });
  tuning.addEventListener("change", changed);

  // the first rows of the chosen dataset (their prompts and grader fields), each graded with the
  // sample answer (or its own reference answer when the box is empty)
  tryButton.addEventListener("click", async () => {
    trialError.replaceChildren();
    const [spec, why] = parse(grader.value);
    const { baseModel, datasetId } = context();
    const fail = (text) => trialError.replaceChildren(el("p", { class: "error", role: "alert", text }));
    if (!spec) return fail(why);
    if (!datasetId) return fail("Pick a prompts dataset first.");
    tryButton.disabled = true;
    try {
      const { rows } = await api(`/datasets/${datasetId}/preview`, {
        query: { model: baseModel, limit: TRIAL_ROWS },
      });
      const samples = rows.map((r) => ({
        model_sample: sample.value || String(r.item?.reference_answer ?? ""),
        item: r.item ?? {},
      }));
      const result = await api("/fine_tuning/alpha/graders/run", {
        method: "POST",
        body: { grader: spec, samples },
        ...V1,
      });
      const errors = result.sample_errors ?? [];
      trialRows.replaceChildren(
        ...rows.map((r, i) => {
          const prompt = r.tokens.map((t) => t.text).join("");
          const error = typeof errors[i] === "string" ? errors[i] : "";
          return el(
            "tr",
            { class: "trial-row", dataset: { line: r.line } },
            el("td", { class: "trial-line", text: String(r.line) }),
            el("td", { class: "trial-prompt", title: prompt, text: prompt.slice(-120) }),
            el("td", { class: "trial-sample", text: samples[i].model_sample || "(empty)" }),
            el("td", {
              class: "trial-reward",
              title: error,
              text: result.rewards?.[i] === undefined ? "–" : number(result.rewards[i]),
            }),
          );
        }),
      );
      trial.hidden = false;
    } catch (err) {
      fail(err.message);
    } finally {
      tryButton.disabled = false;
    }
  });

  return {
    element,
    // the grader checked once the options are first shown
    show(visible) {
      const first = element.hidden && visible;
      element.hidden = !visible;
      if (first && !check.textContent) validate();
    },
    // the method section of the job (and of its plan): the grader as JSON when it parses, else
    // as the text, which the API refuses naming method.grader
    method() {
      const [spec] = parse(grader.value);
      return {
        objective: entry.name,
        tuning: tuning.value,
        grader: spec ?? grader.value,
        group_size: Number(groupSize.value),
        max_completion_tokens: Number(maxTokens.value),
        temperature: Number(temperature.value),
        beta: Number(beta.value),
        loss_type: lossType.value,
        num_iterations: Number(iterations.value),
      };
    },
    usesLora: () => tuning.value === "lora",
  };
}
