// Playground: one prompt, two answers side by side, streamed: a base model's and a job checkpoint's.
// Each side keeps its own conversation (each model sees its own earlier answers). Answers come from
// POST /api/generate (server-sent events over a fetch: EventSource cannot POST), generated on the
// API host's CPU, so a job training on the GPUs is not disturbed. A message may carry images for a
// vision-language model (dropped on the message box, pasted, or picked): they go as the chat
// completions' image_url parts (data URLs) and show in the conversation; a text-only model refuses
// them with an error naming the part.

import { ApiError, api } from "../api.js";
import { el, errorBox, field, number } from "../widgets.js";
import { Attachments, content, userTurn } from "./playground-images.js";

// The events of a text/event-stream body: calls onEvent(name, data) for each.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

// One side of the comparison: its conversation, its column, its running answer.
class Side {
  constructor(key, title) {
    this.key = key;
    this.history = [];
    this.controller = null;
    this.name = el("span", { class: "muted small", id: `${key}-model-name` });
    this.chat = el("ol", { class: "chat", id: `${key}-chat`, "aria-live": "polite" });
    this.column = el(
      "section",
      { class: "card chat-column", id: `${key}-column`, "aria-labelledby": `${key}-title` },
      el("h2", { id: `${key}-title` }, `${title} `, this.name),
      this.chat,
    );
  }

  reset() {
    this.stop();
    this.history = [];
    this.chat.replaceChildren();
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  note(text) {
    this.chat.append(el("li", { class: "turn note muted", text }));
  }

  // Ask for the answer to the conversation plus `prompt` (text, or image and text parts); resolves
  // when it is complete.
  async ask(target, prompt, sampling) {
    const user = { role: "user", content: prompt };
    this.chat.append(userTurn(user));
    const text = el("div", { class: "text" });
    const meta = el("div", { class: "meta muted small", text: "waiting…" });
    const turn = el("li", { class: "turn assistant", dataset: { state: "running" } }, text, meta);
    this.chat.append(turn);
    turn.scrollIntoView({ block: "nearest" });
    const controller = new AbortController();
    this.controller = controller;
    const body = { ...target, messages: [...this.history, user], ...sampling };
    let answer = "";
    let finish = null;
    try {
      const r = await fetch("/api/generate", {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) throw new ApiError(r.status, await r.json().catch(() => null));
      await readEvents(r, (name, data) => {
        if (name === "status")
          meta.textContent =
            { waiting: "waiting for the model…", loading: "loading the model…" }[data.state] || "generating…";
        else if (name === "delta") {
          answer += data.text;
          text.textContent = answer;
        } else if (name === "done") finish = data;
        else if (name === "error") throw new ApiError(422, data);
      });
      if (!finish) throw new ApiError(0, { error: { message: "the answer ended early (connection closed)" } });
      this.history.push(user, { role: "assistant", content: answer });
      turn.dataset.state = "done";
      turn.dataset.finish = finish.finish_reason;
      const why = { stop: "end of turn", length: "max tokens", cancelled: "stopped" }[finish.finish_reason];
      meta.textContent = `${why || finish.finish_reason} · ${number(finish.completion_tokens)} tokens`;
    } catch (error) {
      if (error.name === "AbortError") {
        this.history.push(user, { role: "assistant", content: answer });
        turn.dataset.state = "done";
        turn.dataset.finish = "cancelled";
        meta.textContent = "stopped";
      } else {
        turn.dataset.state = "error";
        meta.replaceChildren(errorBox(error));
      }
    } finally {
      if (this.controller === controller) this.controller = null;
    }
  }
}

function supportedModels(models) {
  return models.filter((m) => m.supported);
}

export async function render(main, jobParam) {
  const [modelsPage, jobsPage] = await Promise.all([api("/models"), api("/jobs", { query: { limit: 200 } })]);
  const models = supportedModels(modelsPage.data);
  const jobs = jobsPage.data;

  const jobSelect = el(
    "select",
    {},
    jobs.length
      ? jobs.map((j) => el("option", { value: j.id, text: `${j.name} · ${j.status}` }))
      : el("option", { value: "", text: "no jobs yet" }),
  );
  const stepSelect = el("select", {});
  const baseSelect = el(
    "select",
    {},
    models.map((m) => el("option", { value: m.name, text: m.name })),
  );
  const temperature = el("input", { type: "number", min: 0, max: 2, step: 0.1, value: 0.7 });
  const topP = el("input", { type: "number", min: 0.05, max: 1, step: 0.05, value: 0.95 });
  const maxTokens = el("input", { type: "number", min: 1, max: 2048, step: 1, value: 128 });
  const seed = el("input", { type: "number", min: 0, step: 1, placeholder: "random" });
  const prompt = el("textarea", { rows: 3, placeholder: "Ask both models the same thing…" });
  const send = el("button", { type: "submit", id: "playground-send", text: "Send" });
  const stop = el("button", {
    type: "button",
    id: "playground-stop",
    class: "secondary",
    text: "Stop",
    disabled: true,
  });
  const reset = el("button", { type: "button", id: "playground-reset", class: "secondary", text: "New conversation" });
  const formError = el("div", { id: "playground-error" });
  const attachments = new Attachments((error) => formError.replaceChildren(errorBox(error)));
  const picker = el("input", { type: "file", accept: "image/*", multiple: true });
  picker.addEventListener("change", () => {
    formError.replaceChildren();
    attachments.add([...picker.files]).catch((e) => formError.replaceChildren(errorBox(e)));
    picker.value = "";
  });

  const base = new Side("base", "Base model");
  const tuned = new Side("tuned", "Fine-tuned");

  async function loadSteps() {
    stepSelect.replaceChildren();
    const job = jobs.find((j) => j.id === jobSelect.value);
    if (!job) {
      stepSelect.append(el("option", { value: "", text: "no checkpoint" }));
      stepSelect.disabled = true;
      return;
    }
    if (models.some((m) => m.name === job.base_model)) baseSelect.value = job.base_model;
    const found = (await api(`/jobs/${job.id}/checkpoints`)).data;
    stepSelect.disabled = !found.length;
    if (!found.length) stepSelect.append(el("option", { value: "", text: "no checkpoint yet" }));
    for (const c of found) stepSelect.append(el("option", { value: c.step, text: `step ${c.step} (${c.kind})` }));
    if (found.length) stepSelect.value = String(found[found.length - 1].step);
    names();
  }

  function names() {
    base.name.textContent = baseSelect.value ? `(${baseSelect.value})` : "(none)";
    const job = jobs.find((j) => j.id === jobSelect.value);
    tuned.name.textContent =
      job && stepSelect.value ? `(${job.name}, step ${stepSelect.value})` : "(pick a checkpoint)";
  }

  function sampling() {
    const s = {
      temperature: Number(temperature.value),
      top_p: Number(topP.value),
      max_tokens: Number(maxTokens.value),
    };
    if (seed.value !== "") s.seed = Number(seed.value);
    return s;
  }

  async function submit(event) {
    event.preventDefault();
    formError.replaceChildren();
    const text = prompt.value.trim();
    if (!text && !attachments.urls.length) {
      prompt.focus();
      return;
    }
    for (const input of [temperature, topP, maxTokens, seed]) {
      if (!input.checkValidity()) {
        input.setAttribute("aria-invalid", "true");
        formError.replaceChildren(errorBox(new Error(`${input.labels[0].textContent}: ${input.validationMessage}`)));
        input.focus();
        return;
      }
      input.removeAttribute("aria-invalid");
    }
    prompt.value = "";
    const message = content(text, attachments.take());
    send.disabled = true;
    stop.disabled = false;
    const asks = [];
    if (baseSelect.value) asks.push(base.ask({ model: baseSelect.value }, message, sampling()));
    else base.note("No base model to ask.");
    if (jobSelect.value && stepSelect.value) {
      const checkpoint = { job_id: jobSelect.value, step: Number(stepSelect.value) };
      asks.push(tuned.ask({ checkpoint }, message, sampling()));
    } else tuned.note("Pick a job with a checkpoint to compare with.");
    await Promise.all(asks);
    send.disabled = false;
    stop.disabled = true;
    prompt.focus();
  }

  const form = el(
    "form",
    { id: "playground-form", class: "card", onsubmit: submit },
    field("playground-prompt", "Message", prompt, "Enter sends; Shift+Enter starts a new line."),
    field(
      "playground-image",
      "Image",
      picker,
      "for a vision-language model: pick images, or drop or paste them on the message box",
    ),
    attachments.tray,
    el("div", { class: "actions" }, send, stop, reset),
    formError,
  );
  // images dropped anywhere on the form, or pasted into the message box
  form.addEventListener("dragover", (e) => {
    if (![...e.dataTransfer.types].includes("Files")) return;
    e.preventDefault();
    form.classList.add("dropping");
  });
  form.addEventListener("dragleave", (e) => {
    if (!form.contains(e.relatedTarget)) form.classList.remove("dropping");
  });
  form.addEventListener("drop", (e) => {
    e.preventDefault();
    form.classList.remove("dropping");
    formError.replaceChildren();
    attachments.add([...e.dataTransfer.files]).catch((err) => formError.replaceChildren(errorBox(err)));
  });
  prompt.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    if (!files.length) return;
    e.preventDefault();
    attachments.add(files).catch((err) => formError.replaceChildren(errorBox(err)));
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  stop.addEventListener("click", () => {
    base.stop();
    tuned.stop();
  });
  reset.addEventListener("click", () => {
    base.reset();
    tuned.reset();
    prompt.focus();
  });
  jobSelect.addEventListener("change", () => loadSteps().catch((e) => formError.replaceChildren(errorBox(e))));
  stepSelect.addEventListener("change", names);
  baseSelect.addEventListener("change", names);

  main.append(
    el("h1", { text: "Playground" }),
    el("p", {
      class: "muted",
      text: "The same prompt to a base model and to a fine-tuned checkpoint, answered side by side. Answers are generated on the API host's CPU: jobs training on the GPUs go on undisturbed. A vision-language model also takes images: drop them on the message box.",
    }),
    el(
      "section",
      { class: "card", id: "playground-settings", "aria-label": "Models and sampling" },
      el(
        "div",
        { class: "grid" },
        field("playground-job", "Job", jobSelect),
        field("playground-step", "Checkpoint", stepSelect),
        field("playground-base", "Base model", baseSelect),
      ),
      el(
        "div",
        { class: "grid" },
        field("playground-temperature", "Temperature", temperature, "0: always the likeliest token"),
        field("playground-top-p", "Top-p", topP, "sample among the likeliest tokens of this mass"),
        field("playground-max-tokens", "Max tokens", maxTokens, "at most 2048"),
        field("playground-seed", "Seed", seed, "the same seed gives the same answer"),
      ),
    ),
    el("div", { class: "side-by-side" }, base.column, tuned.column),
    form,
  );
  const preferred = jobs.find((j) => j.id === jobParam) || jobs.find((j) => j.status === "succeeded");
  if (preferred) jobSelect.value = preferred.id;
  if (!jobs.length) jobSelect.disabled = true;
  await loadSteps();
  names();
  return () => {
    base.stop();
    tuned.stop();
  };
}
