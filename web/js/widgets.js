// Small shared pieces: element building, formatting, status badges, and the SVG chart custom elements.

import { STATUSES } from "./kinds.js";

const SVG = "http://www.w3.org/2000/svg";

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// A labelled form control (the control gets the id; a hint gets `<id>-hint`).
export function field(id, label, control, hint) {
  control.id = id;
  return el(
    "div",
    { class: "field" },
    el("label", { for: id, text: label }),
    control,
    hint ? el("span", { class: "hint", id: `${id}-hint`, text: hint }) : null,
  );
}

export function number(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toLocaleString("en-US");
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  const h = Math.floor(s / 3600);
  return h < 48 ? `${h} h ${Math.floor((s % 3600) / 60)} min` : `${Math.floor(h / 24)} d ${h % 24} h`;
}

// A moment as a clock time: "14:05:09" today, else "Dec 2, 14:05:09" (local time)
export function clock(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  const time = d.toLocaleTimeString("en-GB");
  return d.toDateString() === new Date().toDateString()
    ? time
    : `${d.toLocaleDateString("en-US", { month: "short", day: "numeric" })}, ${time}`;
}

export function age(iso) {
  if (!iso) return "–";
  return `${duration((Date.now() - new Date(iso).getTime()) / 1000)} ago`;
}

// A job status as a badge: <span class="status status-running">running</span>.
export function statusBadge(status, attrs = {}) {
  return showStatus(el("span", attrs), status);
}

// Turn an existing badge into the badge of `status`.
export function showStatus(node, status) {
  const known = STATUSES[status];
  node.textContent = known ? known.label : status;
  node.className = `status ${known ? known.css : `status-${status}`}`;
  return node;
}

export function errorBox(error) {
  const box = el("div", { class: "error", role: "alert" }, el("strong", { text: error.message }));
  if (error.details && error.details.length) {
    box.append(
      el(
        "ul",
        {},
        error.details
          .slice(0, 50)
          .map((d) => el("li", { text: d.line ? `line ${d.line}: ${d.message}` : `${d.param}: ${d.message}` })),
      ),
    );
  }
  return box;
}

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4b5563"];

// Charts draw in CSS pixels (the viewBox follows the element's width), so text keeps its size;
// they redraw when their width changes.
class SizedChart extends HTMLElement {
  connectedCallback() {
    this.observer = new ResizeObserver(() => {
      if (this.clientWidth && Math.abs(this.clientWidth - (this.drawnWidth || 0)) > 4 && this.args)
        this.draw(...this.args);
    });
    this.observer.observe(this);
    if (!this.args) this.empty();
  }

  disconnectedCallback() {
    if (this.observer) this.observer.disconnect();
  }

  width() {
    this.drawnWidth = this.clientWidth;
    return Math.max(260, this.clientWidth || 640);
  }
}

// "Nice" tick values covering [lo, hi]: about `count` of them, 1-2-5 steps (× a power of ten), or
// the steps of a clock when `time` (seconds: 1, 2, 5, 10, 15, 30 s, 1, 2, 5, 10, 15, 30 min, 1,
// 2, 3, 6, 12 h, days). `integer` keeps steps whole (training steps); `extend` widens [lo, hi] to
// the ticks around it. Returns {step, ticks, lo, hi}.
const CLOCK_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

export function niceTicks(lo, hi, { count = 5, integer = false, time = false, extend = false } = {}) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return { step: 1, ticks: [], lo, hi };
  if (hi < lo) [lo, hi] = [hi, lo];
  const raw = (hi - lo || Math.abs(hi) || 1) / Math.max(1, count);
  let step;
  if (time && raw <= 86400) step = CLOCK_STEPS.find((s) => s >= raw) || 86400;
  else if (time) step = 86400 * niceTicks(0, raw / 86400, { count: 1 }).step;
  else {
    const power = 10 ** Math.floor(Math.log10(raw));
    step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw * 0.999);
  }
  if (integer) step = Math.max(1, Math.round(step));
  if (extend) [lo, hi] = [Math.floor(lo / step + 1e-9) * step, Math.ceil(hi / step - 1e-9) * step];
  const ticks = [];
  const first = Math.ceil(lo / step - 1e-9);
  for (let i = first; i * step <= hi + step * 1e-9 && ticks.length < 100; i += 1)
    ticks.push(Number((i * step).toPrecision(12)));
  return { step, ticks, lo, hi };
}

// A tick's label: as many decimals as the step needs; `time`: seconds as "45 s", "10 min", "2 h".
export function tickLabel(v, step, { time = false } = {}) {
  if (time) {
    if (v === 0) return "0";
    if (step >= 3600) return `${number(v / 3600)} h`;
    if (step >= 60) return `${number(v / 60)} min`;
    return `${number(v)} s`;
  }
  if (v === 0) return "0";
  if (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e7) {
    return v.toExponential(Math.min(6, Math.max(0, Math.ceil(-Math.log10(step / Math.abs(v)) - 1e-9))));
  }
  const decimals = Math.min(8, Math.max(0, Math.ceil(-Math.log10(step) - 1e-9)));
  return v.toLocaleString("en-US", { minimumFractionDigits: decimals, maximumFractionDigits: decimals });
}

// <rh-line-chart label="Loss" xlabel="step" ylabel="loss">: chart.setSeries([{name, points:
// [[x, y], ...]}]) draws lines over labelled tick marks and grid lines on both axes. Attributes:
// `xtime` (x is seconds: clock ticks), `zero` (the y axis starts at 0 or below), `ymax` (it reaches
// at least this), `empty` (the text without data).
class LineChart extends SizedChart {
  empty() {
    this.setSeries([]);
  }

  setSeries(series) {
    this.args = [series];
    this.draw(series);
  }

  draw(series) {
    const w = this.width(),
      h = 220,
      left = 64,
      right = 14,
      top = 12,
      bottom = 44;
    const all = series.flatMap((s) => s.points);
    const root = svg("svg", {
      viewBox: `0 0 ${w} ${h}`,
      role: "img",
      "aria-label": this.getAttribute("label") || "chart",
    });
    root.append(svg("rect", { x: left, y: top, width: w - left - right, height: h - top - bottom, class: "plot" }));
    const text = (content, attrs) => {
      const t = svg("text", attrs);
      t.textContent = content;
      root.append(t);
      return t;
    };
    if (!all.length) {
      text(this.getAttribute("empty") || "no data yet", {
        x: w / 2,
        y: h / 2,
        "text-anchor": "middle",
        class: "empty",
      });
    } else {
      const time = this.hasAttribute("xtime");
      let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
      let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
      if (time) x0 = Math.min(0, x0); // time since a start: the axis begins at it
      if (this.hasAttribute("zero")) y0 = Math.min(0, y0);
      if (this.hasAttribute("ymax")) y1 = Math.max(y1, Number(this.getAttribute("ymax")));
      if (x1 === x0) x1 = x0 + 1;
      if (y1 === y0) {
        y1 += Math.abs(y1) * 0.05 || 1;
        y0 -= Math.abs(y0) * 0.05 || 0;
      }
      // the y axis ends on ticks; the x axis spans the data, with ticks within it
      const yt = niceTicks(y0, y1, { count: 5, extend: true });
      [y0, y1] = [yt.lo, yt.hi];
      const xcount = Math.max(2, Math.floor((w - left - right) / 90));
      const xt = niceTicks(x0, x1, { count: xcount, integer: !time && all.every((p) => Number.isInteger(p[0])), time });
      const sx = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - right);
      const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
      for (const v of yt.ticks) {
        const y = sy(v);
        root.append(svg("line", { x1: left, x2: w - right, y1: y, y2: y, class: "grid", stroke: "#e5e7eb" }));
        root.append(svg("line", { x1: left - 4, x2: left, y1: y, y2: y, class: "tick-mark", stroke: "#9ca3af" }));
        text(tickLabel(v, yt.step), { x: left - 7, y: y + 4, "text-anchor": "end", class: "tick y-tick" });
      }
      for (const v of xt.ticks.filter((t) => t >= x0 - 1e-9 && t <= x1 + 1e-9)) {
        const x = sx(v);
        root.append(svg("line", { x1: x, x2: x, y1: top, y2: h - bottom, class: "grid", stroke: "#f0f1f3" }));
        root.append(
          svg("line", { x1: x, x2: x, y1: h - bottom, y2: h - bottom + 4, class: "tick-mark", stroke: "#9ca3af" }),
        );
        text(tickLabel(v, xt.step, { time }), { x, y: h - bottom + 16, "text-anchor": "middle", class: "tick x-tick" });
      }
      text(this.getAttribute("xlabel") || "step", {
        x: (left + w - right) / 2,
        y: h - 6,
        "text-anchor": "middle",
        class: "tick axis-label x-label",
      });
      if (this.hasAttribute("ylabel")) {
        const cy = (top + h - bottom) / 2;
        text(this.getAttribute("ylabel"), {
          x: 12,
          y: cy,
          "text-anchor": "middle",
          transform: `rotate(-90 12 ${cy})`,
          class: "tick axis-label y-label",
        });
      }
      series.forEach((s, i) => {
        if (!s.points.length) return;
        if (s.points.length === 1) {
          const [x, y] = s.points[0];
          root.append(svg("circle", { cx: sx(x), cy: sy(y), r: 3.5, fill: COLORS[i % COLORS.length], class: "point" }));
        }
        const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
        root.append(
          svg("path", {
            d,
            class: "series",
            stroke: COLORS[i % COLORS.length],
            "data-name": s.name,
            "data-count": s.points.length,
          }),
        );
      });
    }
    const legend = el(
      "div",
      { class: "legend" },
      series.map((s, i) => el("span", {}, el("i", { style: `background:${COLORS[i % COLORS.length]}` }), ` ${s.name}`)),
    );
    this.replaceChildren(root, legend);
  }
}

// <rh-histogram label="Token lengths">: histogram.setBins([{lo, hi, count}]) draws bars.
class Histogram extends SizedChart {
  empty() {}

  setBins(bins, marker) {
    this.args = [bins, marker];
    this.draw(bins, marker);
  }

  draw(bins, marker) {
    const w = this.width(),
      h = 160,
      left = 40,
      bottom = 28,
      top = 10;
    const max = Math.max(1, ...bins.map((b) => b.count));
    const root = svg("svg", {
      viewBox: `0 0 ${w} ${h}`,
      role: "img",
      "aria-label": this.getAttribute("label") || "histogram",
    });
    const bw = (w - left - 8) / Math.max(1, bins.length);
    bins.forEach((b, i) => {
      const bh = ((h - top - bottom) * b.count) / max;
      const r = svg("rect", {
        x: left + i * bw + 1,
        y: h - bottom - bh,
        width: Math.max(1, bw - 2),
        height: bh,
        class: "bar",
      });
      const tip = svg("title");
      tip.textContent = `${b.lo}–${b.hi} tokens: ${b.count} rows`;
      r.append(tip);
      root.append(r);
    });
    const last = bins.length ? bins[bins.length - 1].hi : 0;
    if (marker && last && marker <= last) {
      const x = left + (marker / last) * (w - left - 8);
      root.append(svg("line", { x1: x, x2: x, y1: top, y2: h - bottom, class: "marker" }));
    }
    for (const [text, x, anchor] of [
      ["0", left, "start"],
      [String(last), w - 8, "end"],
    ]) {
      const t = svg("text", { x, y: h - 8, "text-anchor": anchor, class: "tick" });
      t.textContent = text;
      root.append(t);
    }
    const ym = svg("text", { x: left - 6, y: top + 10, "text-anchor": "end", class: "tick" });
    ym.textContent = String(max);
    root.append(ym);
    this.replaceChildren(root);
  }
}

customElements.define("rh-line-chart", LineChart);
customElements.define("rh-histogram", Histogram);
