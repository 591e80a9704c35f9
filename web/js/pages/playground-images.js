// The playground's images: those attached to the next message (picked, dropped or pasted; shown as
// removable thumbnails), a message's content with them as the chat completions' image_url parts
// (data URLs), and a user turn that shows them.

import { el } from "../widgets.js";

const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // the server's limit for one image

// A file's bytes as a data URL.
function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error || new Error(`${file.name}: could not be read`));
    reader.readAsDataURL(file);
  });
}

// The images attached to the next message: thumbnails with a remove button until it is sent.
export class Attachments {
  constructor(onError) {
    this.urls = [];
    this.onError = onError;
    this.tray = el("ul", {
      class: "attachments",
      id: "playground-attachments",
      "aria-label": "Images for the next message",
    });
  }

  async add(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        this.onError(new Error(`${file.name}: not an image (${file.type || "unknown type"})`));
        continue;
      }
      if (file.size > MAX_IMAGE_BYTES) {
        this.onError(new Error(`${file.name}: larger than the ${MAX_IMAGE_BYTES / 1024 / 1024} MiB an image may be`));
        continue;
      }
      this.urls.push(await dataUrl(file));
    }
    this.show();
  }

  show() {
    this.tray.replaceChildren(
      ...this.urls.map((url, i) =>
        el(
          "li",
          { class: "attachment" },
          el("img", { src: url, alt: `image ${i + 1} for the next message` }),
          el("button", {
            type: "button",
            class: "secondary small",
            "aria-label": `Remove image ${i + 1}`,
            text: "×",
            onclick: () => {
              this.urls.splice(i, 1);
              this.show();
            },
          }),
        ),
      ),
    );
  }

  // The images taken for a message (the tray is emptied).
  take() {
    const urls = this.urls;
    this.urls = [];
    this.show();
    return urls;
  }
}

// A message's content: its text, or its images (image_url parts) then its text.
export function content(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? [...parts, { type: "text", text }] : parts;
}

// A user turn: its images, then its text.
export function userTurn(message) {
  const turn = el("li", { class: "turn user" });
  if (typeof message.content === "string") {
    turn.textContent = message.content;
    return turn;
  }
  const images = message.content.filter((p) => p.type === "image_url");
  if (images.length)
    turn.append(
      el(
        "div",
        { class: "turn-images" },
        images.map((p, i) => el("img", { src: p.image_url.url, alt: `image ${i + 1}` })),
      ),
    );
  const text = message.content
    .filter((p) => p.type === "text")
    .map((p) => p.text)
    .join("");
  if (text) turn.append(el("span", { text }));
  return turn;
}
