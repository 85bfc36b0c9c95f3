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
function curvesPlot(curve, { width = 460, height = 260 } = {}) {
  const pad = { left: 44, right: 110, top: 12, bottom: 34 };
  const values = curve.curves.flatMap((c) => c.points.map((p) => p.metrics[curve.metric])).filter((v) => typeof v === "number");
  const lo = Math.min(...values);
  const hi = Math.max(...values);
  const span = hi - lo || 1;
  const x = (share) => pad.left + (share / curve.max_share) * (width - pad.left - pad.right);
  const y = (v) => pad.top + (1 - (v - lo) / span) * (height - pad.top - pad.bottom);
  const svg = svgEl("svg", { class: "curves", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${curve.metric} against share of heads pruned` });
  for (let i = 0; i <= 5; i++) {
    const share = (curve.max_share * i) / 5;
    svg.append(svgEl("text", { x: x(share), y: height - 18, class: "axis", "text-anchor": "middle" }, `${Math.round(share * 100)}%`));
  }
  for (const v of [lo, (lo + hi) / 2, hi]) {
    svg.append(svgEl("text", { x: pad.left - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" }, v.toFixed(1)));
  }
  svg.append(svgEl("text", { x: pad.left, y: height - 3, class: "axis axis-title" }, "share of heads pruned →"));
  const base = curve.baseline[curve.metric];
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
