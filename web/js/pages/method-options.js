// The new-job page's fieldset of one training method (not supervised fine-tuning, whose two radios
// are the form's own), rendered from its entry of GET /api/methods: what trains (method.tuning)
// and each of its own options (those not in common_fields) from its options_schema, with the
// schema's title as the label, its description as the hint, its default as the value and its
// bounds as the input's. An option named "grader" gets the grader editor (grader-editor.js).

import { el, field } from "../widgets.js";
import { graderEditor } from "./grader-editor.js";

// how the form names method.tuning's values (the listing's tunings); another is shown as it is
const TUNING_LABELS = { lora: "LoRA adapter", full: "every weight" };
const REFERENCE_NOTES = { lora: "the reference is the base model", full: "reference computed once, first" };

// An option's schema with a nullable one (anyOf [X, {type: "null"}]) resolved to X's constraints
// under the option's own title, description and default: [schema, nullable].
export function resolved(property) {
  const { anyOf, ...own } = property;
  if (!anyOf) return [own, false];
  const nullable = anyOf.some((b) => b.type === "null");
  const kinds = anyOf.filter((b) => b.type !== "null");
  return [{ ...(kinds.length === 1 ? kinds[0] : {}), ...own }, nullable];
}

// a number input's min, max and step from the schema: an integer's exclusive bound is the next
// integer; a float's has no attribute to say it (exclusive() checks it)
function bounds(p) {
  const integer = p.type === "integer";
  const attrs = { type: "number", step: integer ? 1 : "any" };
  if (p.minimum !== undefined) attrs.min = p.minimum;
  else if (integer && p.exclusiveMinimum !== undefined) attrs.min = Math.floor(p.exclusiveMinimum) + 1;
  if (p.maximum !== undefined) attrs.max = p.maximum;
  else if (integer && p.exclusiveMaximum !== undefined) attrs.max = Math.ceil(p.exclusiveMaximum) - 1;
  return attrs;
}

// a float's exclusive bounds as the input's validity (the browser then refuses to submit it)
function exclusive(input, p) {
  if (p.type === "integer" || (p.exclusiveMinimum === undefined && p.exclusiveMaximum === undefined)) return;
  const check = () => {
    const v = input.value === "" ? null : Number(input.value);
    let why = "";
    if (v !== null && p.exclusiveMinimum !== undefined && v <= p.exclusiveMinimum)
      why = `must be greater than ${p.exclusiveMinimum}`;
    else if (v !== null && p.exclusiveMaximum !== undefined && v >= p.exclusiveMaximum)
      why = `must be less than ${p.exclusiveMaximum}`;
    input.setCustomValidity(why);
  };
  input.addEventListener("input", check);
  check();
}

// The control of one option and how to read its value for the request: [control, read]. Empty
// means null where the option is nullable (and is sent as null, for the API to refuse, where not).
function control(p, nullable) {
  const empty = nullable ? "none" : "required";
  if (p.enum) {
    const values = nullable ? [null, ...p.enum] : p.enum;
    const select = el(
      "select",
      {},
      values.map((v) =>
        el("option", {
          value: v === null ? "" : String(v),
          text: v === null ? "none" : String(v),
          selected: v === p.default,
        }),
      ),
    );
    return [select, () => values[select.selectedIndex]];
  }
  if (p.type === "boolean") {
    const box = el("input", { type: "checkbox", checked: Boolean(p.default) });
    return [box, () => box.checked];
  }
  if (p.type === "integer" || p.type === "number") {
    const input = el("input", { ...bounds(p), value: p.default ?? "", placeholder: nullable ? empty : null });
    exclusive(input, p);
    return [input, () => (input.value === "" ? null : Number(input.value))];
  }
  if (p.type === "array") {
    const input = el("input", { type: "text", value: (p.default ?? []).join(", "), placeholder: "comma-separated" });
    const read = () =>
      input.value
        .split(",")
        .map((s) => s.trim())
        .filter(Boolean);
    return [input, read];
  }
  if (p.type === "string") {
    const input = el("input", { type: "text", value: p.default ?? "", placeholder: nullable ? empty : null });
    return [input, () => (input.value === "" && nullable ? null : input.value)];
  }
  // anything else (an object): JSON, sent as the text when it does not parse, for the API to refuse
  const text = el("textarea", { rows: 4, spellcheck: false, class: "code", placeholder: nullable ? empty : null });
  if (p.default !== undefined && p.default !== null) text.value = JSON.stringify(p.default, null, 2);
  const read = () => {
    if (text.value.trim() === "") return null;
    try {
      return JSON.parse(text.value);
    } catch {
      return text.value;
    }
  };
  return [text, read];
}

// ``method``: its entry of GET /api/methods; ``data``: the datasets it trains on, in words;
// ``context()``: {baseModel, datasetId} of the form now (the grader's trial reads them).
export function methodOptions(method, { data, context }) {
  const schema = method.options_schema;
  const common = new Set(method.common_fields);
  const idOf = (name) => (name === "grader" ? "grader" : `${method.name}-${name.replace(/_/g, "-")}`);
  const [tuningSchema] = resolved(schema.properties.tuning ?? {});
  const tuning = el(
    "select",
    {},
    (tuningSchema.enum ?? method.tunings).map((t) => {
      const label = TUNING_LABELS[t] ?? t;
      const note = method.needs_reference ? REFERENCE_NOTES[t] : null;
      return el("option", {
        value: t,
        text: note ? `${label} (${note})` : label,
        selected: t === tuningSchema.default,
      });
    }),
  );
  let grader = null;
  const reads = []; // [option, read()] of each own option, in the schema's order
  const fields = [];
  for (const [name, property] of Object.entries(schema.properties)) {
    if (common.has(name)) continue;
    const [p, nullable] = resolved(property);
    if (p.const !== undefined) continue;
    if (name === "grader") {
      grader = graderEditor(p, context);
      reads.push([name, grader.value]);
      continue;
    }
    const [input, read] = control(p, nullable);
    fields.push(field(idOf(name), p.title ?? name, input, p.description));
    reads.push([name, read]);
  }
  const about = method.description.charAt(0).toUpperCase() + method.description.slice(1);
  const element = el(
    "fieldset",
    { id: `${method.name}-options`, class: "method-options", hidden: true },
    el("legend", { text: method.title }),
    el("p", { class: "hint", text: `${about}. It trains on ${data}.` }),
    grader?.element,
    el(
      "div",
      { class: "grid" },
      field(idOf("tuning"), tuningSchema.title ?? "Trains", tuning, tuningSchema.description),
      ...fields,
    ),
  );
  return {
    element,
    show(visible) {
      const first = element.hidden && visible;
      element.hidden = !visible;
      if (first && grader) grader.shown();
    },
    // the method section of the job (and of its plan): the objective, what trains, its own options
    method: () => ({
      objective: method.name,
      tuning: tuning.value,
      ...Object.fromEntries(reads.map(([n, r]) => [n, r()])),
    }),
    usesLora: () => tuning.value === "lora",
    // the control of a method.* field an API error names, when it is one of this fieldset's
    controlId: (name) => (name === "tuning" || reads.some(([n]) => n === name) ? idOf(name) : null),
  };
}
