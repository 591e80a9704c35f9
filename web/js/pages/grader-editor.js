// The new-job page's editor of a method option named "grader" (GRPO's method.grader): the grader as
// JSON, checked as it is typed (POST /v1/fine_tuning/alpha/graders/validate) and tried on the
// first rows of the chosen dataset (POST /v1/fine_tuning/alpha/graders/run). The method's other
// options are rendered from its schema (method-options.js).

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

// ``property``: the option's JSON schema (its title and description); ``context()``:
// {baseModel, datasetId} of the form now.
export function graderEditor(property, context) {
  const grader = el("textarea", { rows: 8, spellcheck: false, class: "code" });
  grader.value = JSON.stringify(EXAMPLE_GRADER, null, 2);
  const check = el("p", { id: "grader-check", class: "hint", "aria-live": "polite" });
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
    "div",
    { class: "grader-editor" },
    field("grader", `${property.title ?? "Grader"} (JSON)`, grader, property.description),
    check,
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

  // the first rows of the chosen dataset (their prompts and grader fields), each graded with the
  // sample answer (or its own reference answer when the box is empty)
  tryButton.addEventListener("click", async () => {
    trialError.replaceChildren();
    const [spec, why] = parse(grader.value);
    const { baseModel, datasetId } = context();
    const fail = (text) => trialError.replaceChildren(el("p", { class: "error", role: "alert", text }));
    if (!spec) return fail(why);
    if (!datasetId) return fail("Pick a dataset first.");
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
    // the grader checked once it is first shown
    shown() {
      if (!check.textContent) validate();
    },
    // the grader as JSON when it parses, else as the text, which the API refuses naming method.grader
    value() {
      const [spec] = parse(grader.value);
      return spec ?? grader.value;
    },
  };
}
