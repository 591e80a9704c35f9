// The public JSON API, as the pages use it: fetch with the session cookie (set by a one-time login
// link; the page never sees a key), one error type, uploads with progress, and server-sent event
// streams (same-origin EventSource sends the cookie too: no ?token= in URLs).

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || "http_error";
    this.param = e.param || null;
    this.details = e.details || [];
    this.detailsTotal = e.errors_total ?? this.details.length; // details may list only the first ones
  }
}

// root: "/api" (ours), or "/v1" (the OpenAI-compatible API, e.g. its graders), which takes the
// session cookie too and answers errors in the same {"error": {message, param, code}} shape
function url(path, query, root = "/api") {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query || {})) {
    if (v === undefined || v === null || v === "") continue;
    if (Array.isArray(v)) v.forEach((x) => q.append(k, x));
    else q.set(k, String(v));
  }
  const s = q.toString();
  return `${root}${path}${s ? `?${s}` : ""}`;
}

export async function api(path, { method = "GET", body, query, root } = {}) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(url(path, query, root), init);
  if (r.status === 204) return null;
  const data = await r.json().catch(() => null);
  if (!r.ok) throw new ApiError(r.status, data);
  return data;
}

export function downloadUrl(path, query) {
  return url(path, query);
}

// POST a file as multipart form data; onProgress(fraction) while it is sent.
export function upload(path, file, fields, onProgress) {
  return new Promise((resolve, reject) => {
    const form = new FormData();
    form.append("file", file, file.name);
    for (const [k, v] of Object.entries(fields || {})) if (v) form.append(k, v);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url(path));
    xhr.responseType = "json";
    xhr.upload.onprogress = (e) => e.lengthComputable && onProgress && onProgress(e.loaded / e.total);
    xhr.onload = () => (xhr.status < 300 ? resolve(xhr.response) : reject(new ApiError(xhr.status, xhr.response)));
    xhr.onerror = () => reject(new ApiError(0, { error: { message: "the upload failed (network)" } }));
    xhr.send(form);
  });
}

// An EventSource on an API stream; handlers maps event names to callbacks(data, id).
// The stream's "end" event closes it, so the browser does not reconnect to a finished job.
export function stream(path, handlers, query) {
  const es = new EventSource(url(path, query));
  for (const [kind, fn] of Object.entries(handlers)) {
    es.addEventListener(kind, (e) => fn(JSON.parse(e.data), e.lastEventId));
  }
  es.addEventListener("end", () => es.close());
  return es;
}
