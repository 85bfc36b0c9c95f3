// What a head is worth (SPEC section 7): on a model's page, each head's current importance on the
// grid and the pruning curves (metric against share of heads pruned, one line per ranking).
// Self-contained: it watches the page for a model view (app.js renders #grid) and adds one card,
// reading GET /models/{name}/importance and GET /models/{name}/pruning-curves. Uses el/svgEl/
// headGrid/withTooltip/escapeHtml/fmt from plots.js and api() from app.js.
"use strict";

const IMPORTANCE_COLORS = { importance: "#4e79a7", type: "#f28e2b", random: "#76b7b2", "-importance": "#e15759" };
const importanceState = { model: null, token: 0 };

/** White (least important in its run) to deep blue (most), on the normalised scores. */
function importanceColor(value, max) {
  const t = max > 0 ? Math.max(0, Math.min(1, value / max)) : 0;
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(247, 33)}, ${mix(251, 102)}, ${mix(255, 172)})`;
}

function importanceGrid(detail, run) {
  const scores = run.scores.filter((s) => s.stack === run.scores[0].stack);
  const max = Math.max(...scores.map((s) => s.normalized));
  const cells = scores.map((s) => ({
    layer: s.layer, head: s.head, type: null, color: importanceColor(s.normalized, max),
    label: `importance ${fmt(s.normalized)} (raw ${fmt(s.raw, 4)})`,
  }));
  return headGrid(detail.num_layers, detail.num_heads, cells, { title: `head importance of ${detail.name}` });
}

/** Metric against share of heads pruned, one line per ranking, the shared baseline dashed. */
function curvesPlot(curve, { width = 470, height = 270 } = {}) {
  const base = curve.baseline[curve.metric];
  const values = curve.curves.flatMap((c) => c.points.map((p) => p.metrics[curve.metric])).filter((v) => typeof v === "number");
  const yAxis = niceTicks(Math.min(...values, ...(typeof base === "number" ? [base] : [])),
    Math.max(...values, ...(typeof base === "number" ? [base] : [])));
  // Room on the left for the longest tick label (about 6.5 px a character) beside the axis title.
  const longest = Math.max(...yAxis.ticks.map((v) => v.toFixed(yAxis.digits).length));
  const pad = { left: Math.max(54, 30 + Math.ceil(6.5 * longest)), right: 110, top: 12, bottom: 44 };
  width += pad.left - 54;
  const xAxis = niceTicks(0, curve.max_share, 6);
  const x = (share) => pad.left + (share / xAxis.hi) * (width - pad.left - pad.right);
  const y = (v) => pad.top + (1 - (v - yAxis.lo) / (yAxis.hi - yAxis.lo)) * (height - pad.top - pad.bottom);
  const svg = svgEl("svg", { class: "curves", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${curve.metric} against share of heads pruned` });
  for (const share of xAxis.ticks) {
    svg.append(svgEl("text", { x: x(share), y: height - pad.bottom + 14, class: "axis tick x-tick", "text-anchor": "middle" },
      `${(share * 100).toFixed(Math.max(0, xAxis.digits - 2))}%`));
  }
  for (const v of yAxis.ticks) {
    svg.append(svgEl("line", { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v), class: "gridline" }));
    svg.append(svgEl("text", { x: pad.left - 6, y: y(v) + 4, class: "axis tick y-tick", "text-anchor": "end" }, v.toFixed(yAxis.digits)));
  }
  svg.append(svgEl("text", { x: pad.left + (width - pad.left - pad.right) / 2, y: height - 6, class: "axis axis-title x-title", "text-anchor": "middle" },
    "share of heads pruned"));
  svg.append(yTitle(curve.metric, 12, pad.top + (height - pad.top - pad.bottom) / 2));
  if (typeof base === "number") {
    svg.append(svgEl("line", { x1: x(0), x2: x(curve.max_share), y1: y(base), y2: y(base), stroke: "#999", "stroke-dasharray": "4 3" }));
  }
  curve.curves.forEach((line, i) => {
    const color = IMPORTANCE_COLORS[line.ranking] || "#888";
    const points = line.points.map((p) => `${x(p.share).toFixed(1)},${y(p.metrics[curve.metric]).toFixed(1)}`).join(" ");
    svg.append(svgEl("polyline", { points, fill: "none", stroke: color, "stroke-width": 2 }));
    for (const p of line.points) {
      svg.append(withTooltip(svgEl("circle", { cx: x(p.share), cy: y(p.metrics[curve.metric]), r: 3, fill: color }),
        `<b>${escapeHtml(line.ranking)}</b>: ${p.pruned} heads (${Math.round(p.share * 100)}%) pruned<br>` +
        `${escapeHtml(curve.metric)} ${fmt(p.metrics[curve.metric], 2)} (${p.delta >= 0 ? "+" : ""}${fmt(p.delta, 2)})`));
    }
    const ly = pad.top + 14 + i * 16;
    svg.append(svgEl("line", { x1: width - pad.right + 10, x2: width - pad.right + 26, y1: ly - 4, y2: ly - 4, stroke: color, "stroke-width": 2 }));
    svg.append(svgEl("text", { x: width - pad.right + 30, y: ly, class: "axis" }, line.ranking));
  });
  return svg;
}

async function importanceCard(name) {
  const token = ++importanceState.token;
  const quoted = encodeURIComponent(name);
  const [detail, curves] = await Promise.all([
    api(`/models/${quoted}`),
    api(`/models/${quoted}/pruning-curves?limit=1`).catch(() => []),
  ]);
  const id = detail.current_runs.importance;  // the run the catalog serves
  const runs = id ? [await api(`/importance/${id}`).catch(() => null)].filter(Boolean) : [];
  if (token !== importanceState.token || (!runs.length && !curves.length)) return null;
  const parts = [el("h2", {}, "What a head is worth")];
  if (runs.length) {
    const run = runs[0];
    parts.push(importanceGrid(detail, run),
      el("p", { class: "hint" }, `Importance run #${run.id}: mean |dLoss/dξ| over ${run.n_examples} examples (${run.loss} loss), normalised per layer (Michel et al. 2019). Darker is more important.`));
  }
  if (curves.length) {
    const curve = curves[0];
    parts.push(curvesPlot(curve),
      el("p", { class: "hint" }, `Pruning curves #${curve.id}: ${curve.metric} on ${curve.n_examples} examples as heads are pruned in each ranking's order${curve.iterative ? " (iterative)" : ""}; dashed: the shared baseline.`));
  }
  return el("section", { class: "card importance-card", id: "importance-card" }, ...parts);
}

async function maybeAddImportance() {
  const match = (location.hash || "").match(/^#\/model\/([^/?]+)/);
  const grid = document.getElementById("grid");
  if (!match || !grid || document.getElementById("importance-card")) return;
  const name = decodeURIComponent(match[1]);
  if (importanceState.model === name && importanceState.pending) return;
  importanceState.model = name;
  importanceState.pending = true;
  try {
    const card = await importanceCard(name);
    const app = document.getElementById("app");
    if (card && !document.getElementById("importance-card") && app) app.append(card);
  } finally {
    importanceState.pending = false;
  }
}

new MutationObserver(() => { maybeAddImportance(); }).observe(document.getElementById("app"), { childList: true });
window.addEventListener("hashchange", () => { importanceState.model = null; });
