// The shell: checks the login (the session cookie), then renders one page per hash route. Each page
// module exports render(main, params) and may return a cleanup function (closing its streams and
// timers). A 401 (the session expired, or its key was revoked) shows the login notice.

import { api } from "./api.js";
import * as compare from "./pages/compare.js";
import * as datasets from "./pages/datasets.js";
import * as gpus from "./pages/gpus.js";
import * as job from "./pages/job.js";
import * as jobs from "./pages/jobs.js";
import * as models from "./pages/models.js";
import * as newJob from "./pages/new-job.js";
import * as playground from "./pages/playground.js";
import * as sweeps from "./pages/sweeps.js";

const ROUTES = [
  [/^#\/jobs\/new$/, newJob, "new"],
  [/^#\/jobs\/([0-9a-f]+)$/, job, "jobs"],
  [/^#\/sweeps(?:\/([0-9a-f]+))?$/, sweeps, "sweeps"],
  [/^#\/compare\/([0-9a-f,]+)$/, compare, "jobs"],
  [/^#\/datasets$/, datasets, "datasets"],
  [/^#\/models$/, models, "models"],
  [/^#\/gpus$/, gpus, "gpus"],
  [/^#\/playground(?:\/([0-9a-f]+))?$/, playground, "playground"],
  [/^(#\/jobs)?$/, jobs, "jobs"],
];

let cleanup = null;

async function route() {
  if (cleanup) cleanup();
  cleanup = null;
  const main = document.getElementById("app");
  const hash = location.hash || "";
  const found = ROUTES.find(([re]) => re.test(hash)) || ROUTES[ROUTES.length - 1];
  const [re, page, nav] = found;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  main.replaceChildren();
  const params = (hash.match(re) || []).slice(1);
  try {
    cleanup = (await page.render(main, ...params)) || null;
  } catch (error) {
    if (error.status === 401) return loginNeeded();
    main.replaceChildren(
      Object.assign(document.createElement("p"), { className: "error", textContent: error.message }),
    );
  }
}

function loginNeeded() {
  document.getElementById("app").hidden = true;
  document.querySelector("header nav").hidden = true;
  document.getElementById("login-needed").hidden = false;
}

async function start() {
  const health = await api("/health");
  if (!health.authenticated) return loginNeeded();
  window.addEventListener("hashchange", route);
  await route();
}

start();
