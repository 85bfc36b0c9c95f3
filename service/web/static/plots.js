// headcat's small plotting layer: hand-written SVG, no dependencies.
// Every function returns a DOM node; colours come from the caller (see colorFor in app.js).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

/** An HTML element: el("div", {class: "x", onclick: f}, child, "text", ...). */
function el(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, the same way. */
function svgEl(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// --- axes -----------------------------------------------------------------------------------------

/** Round ticks for an axis over [lo, hi]: a step of 1, 2 or 5 times a power of ten, the smallest that
 * gives at most about `count` ticks, and the axis widened to whole steps, so every tick is a round
 * value and the data's min and max fall inside. Returns {lo, hi, step, ticks, digits}: `digits` is
 * how many decimals a tick needs (`tick.toFixed(digits)`). Pure; tests/service/test_web_ticks.py. */
function niceTicks(lo, hi, count = 5) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) [lo, hi] = [0, 1];
  if (hi < lo) [lo, hi] = [hi, lo];
  if (hi === lo) {
    const pad = lo === 0 ? 1 : Math.abs(lo) / 10;
    [lo, hi] = [lo - pad, hi + pad];
  }
  const raw = (hi - lo) / Math.max(1, count - 1);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw * (1 - 1e-9));
  const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const first = Math.floor(lo / step + 1e-9);
  const last = Math.ceil(hi / step - 1e-9);
  const ticks = Array.from({ length: last - first + 1 }, (_, i) => Number(((first + i) * step).toFixed(digits)));
  return { lo: ticks[0], hi: ticks[ticks.length - 1], step, ticks, digits };
}

/** An axis title along the left edge, read bottom to top. */
function yTitle(text, x, yMid) {
  return svgEl("text", { x, y: yMid, class: "axis axis-title", "text-anchor": "middle", transform: `rotate(-90 ${x} ${yMid})` }, text);
}

// --- a tooltip shared by all plots -------------------------------------------------------------

const tooltip = {
  node: null,
  show(event, html) {
    if (!this.node) {
      this.node = el("div", { class: "tooltip", role: "tooltip" });
      document.body.append(this.node);
    }
    this.node.innerHTML = html;
    this.node.style.display = "block";
    const pad = 14;
    const { innerWidth: w } = window;
    const box = this.node.getBoundingClientRect();
    const left = event.clientX + pad + box.width > w ? event.clientX - pad - box.width : event.clientX + pad;
    this.node.style.left = `${left + window.scrollX}px`;
    this.node.style.top = `${event.clientY + pad + window.scrollY}px`;
  },
  hide() {
    if (this.node) this.node.style.display = "none";
  },
};

function withTooltip(node, html) {
  node.addEventListener("mousemove", (e) => tooltip.show(e, typeof html === "function" ? html() : html));
  node.addEventListener("mouseleave", () => tooltip.hide());
  return node;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}

/** "1 sample", "2 samples", "1 query", "3 queries": a count and its noun, singular for exactly one. */
function count(n, singular, plural = `${singular}s`) {
  return `${n.toLocaleString()} ${n === 1 ? singular : plural}`;
}

function pct(value, digits = 1) {
  return `${(100 * value).toFixed(digits)} %`;
}

// --- the layer x head grid (Guan et al. Fig. 3 / Fig. 5) ----------------------------------------

/**
 * One cell per head, rows = layers (0 on top), columns = heads.
 * cells: [{layer, head, type, color, changed?}]; options: {onClick, selected: [layer, head], title, shares}
 * shares (optional): per layer, [{type, color, count}] drawn as a stacked bar right of the row.
 */
// options.kvGroup: query heads per key/value head (grouped attention): brackets above the grid
// mark the heads that share one, and each cell's tooltip names its key/value head.
let hatchCount = 0;

// A cell's type is uncertain (drawn hatched) when `c.uncertain`: see `confidence` in app.js.
function headGrid(numLayers, numHeads, cells, options = {}) {
  const cell = Math.max(12, Math.min(30, Math.floor(420 / numHeads)));
  const gap = 2;
  const left = 58;
  const top = options.kvGroup ? 54 : 34;
  const barWidth = options.shares ? 150 : 0;
  const barGap = options.shares ? 16 : 0;
  const width = left + numHeads * (cell + gap) + barGap + barWidth + 4;
  const height = top + numLayers * (cell + gap) + 4;
  const svg = svgEl("svg", {
    class: "grid",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": options.title || "head types by layer and head",
    "data-layers": numLayers,
    "data-heads": numHeads,
  });
  for (let h = 0; h < numHeads; h++) {
    if (numHeads <= 16 || h % 2 === 0) {
      svg.append(svgEl("text", { x: left + h * (cell + gap) + cell / 2, y: 28, class: "axis", "text-anchor": "middle" }, h));
    }
  }
  svg.append(svgEl("text", { x: left, y: 12, class: "axis axis-title" }, "head →"));
  const hatchId = `hatch-${++hatchCount}`;
  if (cells.some((c) => c.uncertain)) {
    const pattern = svgEl("pattern", { id: hatchId, width: 5, height: 5, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
    pattern.append(svgEl("line", { x1: 0, y1: 0, x2: 0, y2: 5, class: "hatch-line" }));
    const defs = svgEl("defs", {});
    defs.append(pattern);
    svg.append(defs);
  }
  if (options.kvGroup) {
    for (let g = 0; g * options.kvGroup < numHeads; g++) {
      const x0 = left + g * options.kvGroup * (cell + gap);
      const x1 = x0 + options.kvGroup * (cell + gap) - gap;
      svg.append(svgEl("text", { x: (x0 + x1) / 2, y: 41, class: "axis kv-label", "text-anchor": "middle" }, `kv ${g}`));
      svg.append(svgEl("path", { d: `M${x0} 50 V45 H${x1} V50`, class: "kv-group", dataset: { kv: g } }));
    }
  }
  svg.append(svgEl("text", { x: 2, y: 28, class: "axis axis-title" }, "layer ↓"));
  for (let layer = 0; layer < numLayers; layer++) {
    const y = top + layer * (cell + gap);
    svg.append(svgEl("text", { x: left - 8, y: y + cell / 2 + 4, class: "axis", "text-anchor": "end" }, layer));
  }
  for (const c of cells) {
    const x = left + c.head * (cell + gap);
    const y = top + c.layer * (cell + gap);
    const selected = options.selected && options.selected[0] === c.layer && options.selected[1] === c.head;
    const rect = svgEl("rect", {
      class: `cell${selected ? " selected" : ""}${c.changed ? " changed" : ""}${options.onClick ? " clickable" : ""}${c.uncertain ? " uncertain" : ""}`,
      x, y, width: cell, height: cell, rx: 3,
      fill: c.color,
      dataset: { layer: c.layer, head: c.head, type: c.type ?? "", stack: c.stack ?? "", kv: c.kv ?? "" },
    });
    const where = `${options.stackLabel ? `${options.stackLabel} ` : ""}layer ${c.layer}, head ${c.head}`;
    const kv = c.kv === null || c.kv === undefined ? "" : `<br>key/value head ${c.kv}`;
    const sure = c.confidence ? `<br>${escapeHtml(c.confidence)}` : "";
    withTooltip(rect, () => `<b>${where}</b><br>${escapeHtml(c.label ?? c.type ?? "no type yet")}${kv}${sure}`);
    if (options.onClick) {
      rect.setAttribute("tabindex", "0");
      rect.setAttribute("role", "button");
      rect.setAttribute("aria-label", `layer ${c.layer}, head ${c.head}: ${c.label ?? c.type ?? "no type yet"}`);
      rect.addEventListener("click", () => options.onClick(c));
      rect.addEventListener("keydown", (e) => {
        if (e.key === "Enter" || e.key === " ") {
          e.preventDefault();
          options.onClick(c);
        }
      });
    }
    svg.append(rect);
    if (c.uncertain) {
      svg.append(svgEl("rect", { x, y, width: cell, height: cell, rx: 3, fill: `url(#${hatchId})`, class: "hatch", dataset: { layer: c.layer, head: c.head } }));
    }
    if (c.changed) {
      svg.append(svgEl("circle", { cx: x + cell / 2, cy: y + cell / 2, r: Math.max(2.5, cell / 7), class: "changed-mark" }));
    }
  }
  if (options.shares) {
    const x0 = left + numHeads * (cell + gap) + barGap;
    options.shares.forEach((parts, layer) => {
      const total = parts.reduce((s, p) => s + p.count, 0) || 1;
      let x = x0;
      const y = top + layer * (cell + gap) + 2;
      for (const p of parts) {
        const w = (barWidth * p.count) / total;
        if (w <= 0) continue;
        svg.append(withTooltip(
          svgEl("rect", { class: "share", x, y, width: w, height: cell - 4, fill: p.color }),
          `<b>layer ${layer}</b><br>${escapeHtml(p.type)}: ${p.count} of ${total} heads (${pct(p.count / total, 0)})`,
        ));
        x += w;
      }
    });
    svg.append(svgEl("text", { x: x0, y: 28, class: "axis" }, "share of each type"));
  }
  return svg;
}

// --- stacked share bar (one row) ----------------------------------------------------------------

function shareBar(parts, width = 220, height = 12) {
  const total = parts.reduce((s, p) => s + p.value, 0) || 1;
  const svg = svgEl("svg", { class: "sharebar", width, height, viewBox: `0 0 ${width} ${height}` });
  let x = 0;
  for (const p of parts) {
    const w = (width * p.value) / total;
    if (w <= 0) continue;
    svg.append(withTooltip(svgEl("rect", { x, y: 0, width: w, height, fill: p.color }), `${escapeHtml(p.label)}: ${pct(p.value / total)}`));
    x += w;
  }
  return svg;
}

// --- t-SNE scatter ------------------------------------------------------------------------------

/** points: [{x, y, color, own, label, onClick}]; own points are filled, the others hollow. */
function scatter(points, { width = 440, height = 340 } = {}) {
  const shown = points.filter((p) => p.x !== null && p.y !== null);
  const svg = svgEl("svg", { class: "scatter", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "t-SNE of the heads" });
  if (!shown.length) return svg;
  const pad = 14;
  const xs = shown.map((p) => p.x);
  const ys = shown.map((p) => p.y);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (width - 2 * pad);
  const sy = (v) => height - pad - ((v - y0) / (y1 - y0 || 1)) * (height - 2 * pad);
  svg.append(svgEl("rect", { x: 0.5, y: 0.5, width: width - 1, height: height - 1, class: "frame" }));
  // others first, so the model's own heads are drawn on top
  for (const p of [...shown.filter((q) => !q.own), ...shown.filter((q) => q.own)]) {
    const dot = svgEl("circle", {
      cx: sx(p.x), cy: sy(p.y), r: p.own ? 4.5 : 3.5,
      class: p.own ? "dot own" : "dot other",
      fill: p.own ? p.color : "none",
      stroke: p.color,
    });
    withTooltip(dot, p.label);
    if (p.onClick) {
      dot.classList.add("clickable");
      dot.addEventListener("click", p.onClick);
    }
    svg.append(dot);
  }
  return svg;
}

// --- box plots of the features per type (Guan et al. Fig. 1, bottom) ----------------------------

function quantile(sorted, q) {
  if (!sorted.length) return NaN;
  const pos = (sorted.length - 1) * q;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

/** rows: list of {featureName: value}; one box per feature (Tukey whiskers, 1.5 IQR). */
function boxPlot(names, rows, color, { width = 480, height = 240, yMax = 1, title = "" } = {}) {
  const left = 44;
  const bottom = 46;
  const top = 18;
  const plotH = height - top - bottom;
  const step = (width - left - 6) / names.length;
  const sy = (v) => top + plotH - (Math.min(v, yMax) / yMax) * plotH;
  const svg = svgEl("svg", { class: "boxplot", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title });
  svg.append(svgEl("text", { x: left, y: 12, class: "plot-title" }, title));
  const axis = niceTicks(0, yMax);
  for (const t of axis.ticks.filter((v) => v <= yMax + 1e-9)) {
    svg.append(svgEl("line", { x1: left, x2: width - 4, y1: sy(t), y2: sy(t), class: "gridline" }));
    svg.append(svgEl("text", { x: left - 5, y: sy(t) + 3, class: "axis", "text-anchor": "end" }, t.toFixed(axis.digits)));
  }
  svg.append(yTitle("feature value", 9, top + plotH / 2));
  names.forEach((name, i) => {
    const values = rows.map((r) => r[name]).filter((v) => v !== null && v !== undefined).sort((a, b) => a - b);
    const cx = left + i * step + step / 2;
    const label = svgEl("text", { x: cx, y: height - bottom + 12, class: "axis tick", "text-anchor": "end", transform: `rotate(-55 ${cx} ${height - bottom + 12})` }, name);
    svg.append(label);
    if (!values.length) return;
    const [q1, med, q3] = [quantile(values, 0.25), quantile(values, 0.5), quantile(values, 0.75)];
    const iqr = q3 - q1;
    const lo = values.find((v) => v >= q1 - 1.5 * iqr);
    const hi = [...values].reverse().find((v) => v <= q3 + 1.5 * iqr);
    const w = Math.max(4, step * 0.6);
    const g = withTooltip(svgEl("g", { class: "box" }),
      `<b>${escapeHtml(name)}</b> (${values.length} heads)<br>median ${fmt(med)}<br>quartiles ${fmt(q1)} – ${fmt(q3)}<br>range ${fmt(values[0])} – ${fmt(values[values.length - 1])}`);
    g.append(svgEl("line", { x1: cx, x2: cx, y1: sy(hi), y2: sy(lo), class: "whisker" }));
    g.append(svgEl("rect", { x: cx - w / 2, y: sy(q3), width: w, height: Math.max(1, sy(q1) - sy(q3)), fill: color, class: "iqr" }));
    g.append(svgEl("line", { x1: cx - w / 2, x2: cx + w / 2, y1: sy(med), y2: sy(med), class: "median" }));
    for (const v of values) {
      if (v < lo || v > hi) g.append(svgEl("circle", { cx, cy: sy(v), r: 1.8, class: "outlier" }));
    }
    svg.append(g);
  });
  return svg;
}

// --- feature bars of one head, with its cluster's centroid ---------------------------------------

function featureBars(names, values, centroid, color, { width = 470, height = 176 } = {}) {
  const left = 44;
  const bottom = 46;
  const top = 8;
  const plotH = height - top - bottom;
  const axis = niceTicks(0, Math.max(0.05, ...names.map((n) => values[n]), ...(centroid ? names.map((n) => centroid[n]) : [])), 4);
  const yMax = axis.hi;
  const step = (width - left - 6) / names.length;
  const sy = (v) => top + plotH - (v / yMax) * plotH;
  const svg = svgEl("svg", { class: "features", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "the head's distance features" });
  for (const t of axis.ticks) {
    svg.append(svgEl("line", { x1: left, x2: width - 4, y1: sy(t), y2: sy(t), class: "gridline" }));
    svg.append(svgEl("text", { x: left - 5, y: sy(t) + 3, class: "axis", "text-anchor": "end" }, t.toFixed(axis.digits)));
  }
  svg.append(yTitle("feature value", 9, top + plotH / 2));
  names.forEach((name, i) => {
    const x = left + i * step;
    const v = values[name];
    svg.append(withTooltip(
      svgEl("rect", { x: x + step * 0.15, y: sy(v), width: step * 0.7, height: sy(0) - sy(v), fill: color, class: "bar", dataset: { feature: name } }),
      `<b>${escapeHtml(name)}</b>: ${fmt(v, 4)}${centroid ? `<br>centroid: ${fmt(centroid[name], 4)}` : ""}`,
    ));
    if (centroid) {
      svg.append(svgEl("line", { x1: x + step * 0.05, x2: x + step * 0.95, y1: sy(centroid[name]), y2: sy(centroid[name]), class: "centroid" }));
    }
    const cx = x + step / 2;
    svg.append(svgEl("text", { x: cx, y: height - bottom + 12, class: "axis tick", "text-anchor": "end", transform: `rotate(-55 ${cx} ${height - bottom + 12})` }, name));
  });
  return svg;
}

// --- an attention heatmap (canvas; rows = queries, columns = keys) -------------------------------

function heatmap(map, labels, { size = 150, color = "#e15759", title = "" } = {}) {
  const m = map.length;
  const scale = Math.max(1, Math.floor(size / m));
  const canvas = el("canvas", { class: "heatmap", width: m * scale, height: m * scale, "aria-label": title, role: "img" });
  const ctx = canvas.getContext("2d");
  const max = Math.max(1e-9, ...map.flat());
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
  for (let i = 0; i < m; i++) {
    for (let j = 0; j < m; j++) {
      const a = Math.sqrt(map[i][j] / max); // sqrt: faint structure stays visible
      ctx.fillStyle = `rgb(${Math.round(255 - a * (255 - r) * 1.0)}, ${Math.round(255 - a * (255 - g))}, ${Math.round(255 - a * (255 - b))})`;
      ctx.fillRect(j * scale, i * scale, scale, scale);
    }
  }
  canvas.addEventListener("mousemove", (e) => {
    const box = canvas.getBoundingClientRect();
    const j = Math.min(m - 1, Math.floor(((e.clientX - box.left) / box.width) * m));
    const i = Math.min(m - 1, Math.floor(((e.clientY - box.top) / box.height) * m));
    const q = labels[i] ?? i;
    const k = labels[j] ?? j;
    tooltip.show(e, `${title ? `<b>${escapeHtml(title)}</b><br>` : ""}query <code>${escapeHtml(q)}</code><br>key <code>${escapeHtml(k)}</code><br>attention ${fmt(map[i][j], 3)}`);
  });
  canvas.addEventListener("mouseleave", () => tooltip.hide());
  return canvas;
}

if (typeof module !== "undefined") module.exports = { niceTicks, count };
