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

// <rh-line-chart label="Loss">: chart.setSeries([{name, points: [[x, y], ...]}]) draws lines.
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
      h = 200,
      left = 52,
      right = 12,
      top = 12,
      bottom = 28;
    const all = series.flatMap((s) => s.points);
    const root = svg("svg", {
      viewBox: `0 0 ${w} ${h}`,
      role: "img",
      "aria-label": this.getAttribute("label") || "chart",
    });
    root.append(svg("rect", { x: left, y: top, width: w - left - right, height: h - top - bottom, class: "plot" }));
    if (!all.length) {
      const t = svg("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" });
      t.textContent = this.getAttribute("empty") || "no data yet";
      root.append(t);
    } else {
      let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
      let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
      if (this.hasAttribute("zero")) y0 = Math.min(0, y0);
      if (this.hasAttribute("ymax")) y1 = Math.max(y1, Number(this.getAttribute("ymax")));
      if (x1 === x0) x1 = x0 + 1;
      if (y1 === y0) {
        y1 += Math.abs(y1) * 0.05 || 1;
        y0 -= Math.abs(y0) * 0.05 || 0;
      }
      const sx = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - right);
      const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
      for (const [v, anchor, x, y] of [
        [y1, "end", left - 6, top + 10],
        [y0, "end", left - 6, h - bottom],
        [x0, "start", left, h - 8],
        [x1, "end", w - right, h - 8],
      ]) {
        const t = svg("text", { x, y, "text-anchor": anchor, class: "tick" });
        t.textContent = number(v);
        root.append(t);
      }
      const xl = svg("text", { x: (left + w - right) / 2, y: h - 8, "text-anchor": "middle", class: "tick" });
      xl.textContent = this.getAttribute("xlabel") || "step";
      root.append(xl);
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
