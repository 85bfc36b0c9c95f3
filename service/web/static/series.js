// Heads across training (SPEC section 11): on the page of a model that is a step of a series, one card with
// the series' head grid coloured by each head's formation step for a chosen role (the first step from which
// it holds the role to the last step; grey: it does not), the chosen head's score over the steps on a
// log-step axis with the model's repeat gain and losses (as its detection runs measured them) on the same
// axis, and the heads' types over the steps as a stacked band. Self-contained like detectors.js: it watches
// the page for a model view (app.js renders #grid) and reads GET /models/{name}, GET /series/{name} and
// GET /series/{name}/heads?score=ROLE. Uses el/svgEl/headGrid/withTooltip/escapeHtml/fmt/niceTicks/yTitle
// from plots.js, api()/colorFor()/typeLabel()/sortTypes() from app.js.
"use strict";

const SERIES_ROLES = ["induction", "duplicate_token", "previous_token", "sink"];
const NOT_FORMED = "#eeeeee";
// Early to late formation: viridis' ends and middle (dark purple, teal, yellow).
const FORMATION_STOPS = [[68, 1, 84], [33, 145, 140], [253, 231, 37]];
const seriesState = { model: null, token: 0, pending: false };

/** Where a step lies on the log-step axis: log10(1 + step), so that step 0 has a place. */
function logStep(step) {
  return Math.log10(1 + Math.max(0, step));
}

/** The colour of a head formed at `step` in a series running from `first` to `last`: dark (early) to yellow
 * (late) by the step's place on the log-step axis; NOT_FORMED (grey) when it has not formed (null). */
function formationColor(step, first, last) {
  if (step === null || step === undefined) return NOT_FORMED;
  const span = logStep(last) - logStep(first);
  const t = span > 0 ? Math.max(0, Math.min(1, (logStep(step) - logStep(first)) / span)) : 0;
  const scaled = t * (FORMATION_STOPS.length - 1);
  const i = Math.min(FORMATION_STOPS.length - 2, Math.floor(scaled));
  const f = scaled - i;
  const [a, b] = [FORMATION_STOPS[i], FORMATION_STOPS[i + 1]];
  const mix = (k) => Math.round(a[k] + (b[k] - a[k]) * f);
  return `rgb(${mix(0)}, ${mix(1)}, ${mix(2)})`;
}

/** Round ticks of a log-step axis over the steps [lo, hi]: 0 when the axis starts there, then the powers of
 * ten inside (1, 10, 100, ...), with 2 and 5 times them when the powers alone give fewer than three ticks;
 * round linear ticks when not even those fall inside. Pure; tests/service/test_series_web.py. */
function logStepTicks(lo, hi) {
  const start = lo <= 0 ? [0] : [];
  for (const multiples of [[1], [1, 2, 5]]) {
    const ticks = [...start];
    for (let power = 1; power <= Math.max(1, hi); power *= 10) {
      for (const m of multiples) if (m * power >= lo && m * power <= hi) ticks.push(m * power);
    }
    if (ticks.length >= 3 || (multiples.length === 3 && ticks.length >= 2)) return [...new Set(ticks)].sort((a, b) => a - b);
  }
  const round = typeof niceTicks === "function" ? niceTicks : require("./plots.js").niceTicks; // node: the tests
  return round(lo, hi, 3).ticks.filter((t) => t >= lo && t <= hi);
}

/** A step axis shared by the card's plots: x(step) in [left, right] on the log-step scale, and its ticks. */
function stepAxis(steps, left, right) {
  const lo = Math.min(...steps);
  const hi = Math.max(...steps);
  let [u0, u1] = [logStep(lo), logStep(hi)];
  if (u1 - u0 < 1e-9) [u0, u1] = [u0 - 0.5, u1 + 0.5];
  return { x: (step) => left + ((logStep(step) - u0) / (u1 - u0)) * (right - left), ticks: logStepTicks(lo, hi) };
}

/** Per step, how many heads have each type: [{step, counts: {type: n}}] (a head without a type is not counted). */
function typeCounts(items, steps) {
  const rows = steps.map((step) => ({ step, counts: {} }));
  const at = new Map(rows.map((r) => [r.step, r]));
  for (const head of items) {
    for (const v of head.values) {
      if (v.type === null || v.type === undefined || !at.has(v.step)) continue;
      const counts = at.get(v.step).counts;
      counts[v.type] = (counts[v.type] || 0) + 1;
    }
  }
  return rows;
}

const PLOT = { width: 500, left: 58, right: 16, top: 14, bottom: 40 };

function stepFrame(svg, axis, height, yAxis, y, yLabel, marks) {
  const bottom = height - PLOT.bottom;
  for (const t of axis.ticks) {
    svg.append(svgEl("line", { x1: axis.x(t), x2: axis.x(t), y1: PLOT.top, y2: bottom, class: "gridline" }));
    svg.append(svgEl("text", { x: axis.x(t), y: bottom + 14, class: "axis tick x-tick", "text-anchor": "middle" }, t.toLocaleString("en-US")));
  }
  for (const v of yAxis.ticks) {
    svg.append(svgEl("line", { x1: PLOT.left, x2: PLOT.width - PLOT.right, y1: y(v), y2: y(v), class: "gridline" }));
    svg.append(svgEl("text", { x: PLOT.left - 6, y: y(v) + 4, class: "axis tick y-tick", "text-anchor": "end" }, v.toFixed(yAxis.digits)));
  }
  svg.append(svgEl("text", { x: PLOT.left + (PLOT.width - PLOT.left - PLOT.right) / 2, y: height - 6, class: "axis axis-title x-title", "text-anchor": "middle" },
    "training step (log scale)"));
  svg.append(yTitle(yLabel, 12, PLOT.top + (bottom - PLOT.top) / 2));
  for (const mark of marks) {
    if (mark.step === null || mark.step === undefined) continue;
    svg.append(withTooltip(svgEl("line", { x1: axis.x(mark.step), x2: axis.x(mark.step), y1: PLOT.top, y2: bottom, class: `step-mark ${mark.kind}`,
      stroke: mark.color, "stroke-dasharray": "4 3", dataset: { step: mark.step } }), escapeHtml(mark.label)));
  }
}

/** One line per series [{name, color, points: [[step, value]]}] over the step axis; `fixed` pins the y range. */
function stepLines(lines, steps, { title, yLabel, fixed = null, height = 190, marks = [], threshold = null }) {
  const values = lines.flatMap((l) => l.points.map((p) => p[1]));
  const yAxis = fixed ? niceTicks(fixed[0], fixed[1], 5) : niceTicks(Math.min(0, ...values), Math.max(...values), 5);
  const bottom = height - PLOT.bottom;
  const y = (v) => PLOT.top + (1 - (v - yAxis.lo) / (yAxis.hi - yAxis.lo)) * (bottom - PLOT.top);
  const axis = stepAxis(steps, PLOT.left, PLOT.width - PLOT.right);
  const svg = svgEl("svg", { class: "step-plot", width: PLOT.width, height, viewBox: `0 0 ${PLOT.width} ${height}`, role: "img", "aria-label": title });
  stepFrame(svg, axis, height, yAxis, y, yLabel, marks);
  if (threshold !== null) {
    svg.append(withTooltip(svgEl("line", { x1: PLOT.left, x2: PLOT.width - PLOT.right, y1: y(threshold), y2: y(threshold), class: "threshold",
      stroke: "#999", "stroke-dasharray": "2 3" }), `threshold ${fmt(threshold, 2)}`));
  }
  lines.forEach((line, i) => {
    const drawn = line.points.filter((p) => p[1] !== null && p[1] !== undefined);
    svg.append(svgEl("polyline", { points: drawn.map(([s, v]) => `${axis.x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
      fill: "none", stroke: line.color, "stroke-width": 2, class: "line", dataset: { line: line.name } }));
    for (const [s, v] of drawn) {
      svg.append(withTooltip(svgEl("circle", { cx: axis.x(s), cy: y(v), r: 3, fill: line.color, class: "point", dataset: { line: line.name, step: s, value: v } }),
        `<b>${escapeHtml(line.name)}</b> at step ${s.toLocaleString("en-US")}: ${fmt(v)}`));
    }
    if (lines.length > 1) {
      const lx = PLOT.left + 8 + i * 130;
      svg.append(svgEl("line", { x1: lx, x2: lx + 14, y1: 6, y2: 6, stroke: line.color, "stroke-width": 2 }));
      svg.append(svgEl("text", { x: lx + 18, y: 10, class: "axis" }, line.name));
    }
  });
  return svg;
}

/** The heads' types over the steps as a stacked band: at each step, the share of the heads with each type. */
function typeBand(rows, steps, { height = 170, marks = [] } = {}) {
  const axis = stepAxis(steps, PLOT.left, PLOT.width - PLOT.right);
  const yAxis = niceTicks(0, 1, 5);
  const bottom = height - PLOT.bottom;
  const y = (v) => PLOT.top + (1 - v) * (bottom - PLOT.top);
  const svg = svgEl("svg", { class: "type-band", width: PLOT.width, height, viewBox: `0 0 ${PLOT.width} ${height}`, role: "img", "aria-label": "head types over the steps" });
  const xs = steps.map((s) => axis.x(s));
  const edges = xs.map((x, i) => [i === 0 ? x - 6 : (xs[i - 1] + x) / 2, i === xs.length - 1 ? x + 6 : (x + xs[i + 1]) / 2]);
  rows.forEach((row, i) => {
    const total = Object.values(row.counts).reduce((a, b) => a + b, 0);
    if (!total) return;
    let acc = 0;
    for (const type of sortTypes(Object.keys(row.counts))) {
      const share = row.counts[type] / total;
      svg.append(withTooltip(svgEl("rect", { x: edges[i][0], width: Math.max(1, edges[i][1] - edges[i][0]), y: y(acc + share), height: y(acc) - y(acc + share),
        fill: colorFor(type), class: "band", dataset: { step: row.step, type, count: row.counts[type] } }),
        `<b>step ${row.step.toLocaleString("en-US")}</b><br>${escapeHtml(typeLabel(type))}: ${row.counts[type]} of ${total} heads`));
      acc += share;
    }
  });
  stepFrame(svg, axis, height, yAxis, y, "share of heads", marks);
  return svg;
}

function formationLegend(steps) {
  const [first, last] = [steps[0], steps[steps.length - 1]];
  const shown = steps.length <= 8 ? steps : [0, 1, 2, 3, 4, 5, 6, 7].map((i) => steps[Math.round((i * (steps.length - 1)) / 7)]);
  return el("p", { class: "legend formation-legend muted" }, "formed at step: ",
    [...new Set(shown)].map((s) => el("span", { class: "legend-item", dataset: { step: s } },
      el("span", { class: "swatch", style: `background:${formationColor(s, first, last)}` }), s.toLocaleString("en-US"))),
    el("span", { class: "legend-item", dataset: { step: "none" } }, el("span", { class: "swatch", style: `background:${NOT_FORMED}` }), "not formed"));
}

function headPlots(head, role, series, model) {
  const steps = series.items.map((i) => i.step); // every plot of the card on one axis: the series' steps
  const formed = head.formed_at[role];
  const marks = [{ step: formed, kind: "formed", color: "#e15759", label: `${role} formed at step ${formed}` },
    { step: model.step, kind: "this-step", color: "#555", label: `this model: step ${model.step}` }];
  const thresholds = series.items.map((i) => i.detection_run?.config?.thresholds?.[role]).filter((t) => typeof t === "number");
  const threshold = thresholds.length && thresholds.every((t) => t === thresholds[0]) ? thresholds[0] : null;
  const where = `${head.stack} layer ${head.layer}, head ${head.head}`;
  const scores = head.values.filter((v) => v.value !== null).map((v) => [v.step, v.value]);
  const parts = [el("h3", {}, `${where}: ${role} score over the steps`)];
  if (scores.length) {
    parts.push(stepLines([{ name: role, color: DETECTOR_COLORS[role] || "#4e79a7", points: scores }], steps,
      { title: `${role} score of ${where} by step`, yLabel: `${role} score`, fixed: [0, 1], marks, threshold }));
    if (scores.length < steps.length) {
      const have = new Set(scores.map((p) => p[0]));
      const missing = steps.filter((s) => !have.has(s)).map((s) => s.toLocaleString("en-US"));
      parts.push(el("p", { class: "hint" }, `${role} score measured at ${scores.length} of ${steps.length} steps; not measured at step ${missing.join(", ")}.`));
    }
  } else {
    parts.push(el("p", { class: "muted not-measured", dataset: { what: "score" } }, `${role} score: not measured (no detection run at any step)`));
  }
  const measured = series.items.filter((i) => i.detection_run && i.detection_run.repeat_gain !== null);
  if (measured.length) {
    const line = (name, key, color) => ({ name, color, points: measured.map((i) => [i.step, i.detection_run[key]]) });
    parts.push(stepLines([line("repeat gain", "repeat_gain", "#59a14f"), line("loss, first copy", "loss_first", "#bab0ac"),
      line("loss, later copies", "loss_later", "#4e79a7")], steps,
    { title: "repeat gain and loss by step", yLabel: "nats", marks: marks.slice(1) }));
    if (measured.length < series.items.length) {
      const missing = series.items.filter((i) => !measured.includes(i)).map((i) => i.step.toLocaleString("en-US"));
      parts.push(el("p", { class: "hint" }, `Repeat gain and loss measured at ${measured.length} of ${series.items.length} steps; not measured at step ${missing.join(", ")}.`));
    }
  } else {
    parts.push(el("p", { class: "muted not-measured", dataset: { what: "gain" } },
      "Repeat gain and loss: not measured (no step has a detection run with a causal LM's loss)."));
  }
  return el("div", { class: "series-head", id: "series-head", dataset: { stack: head.stack, layer: head.layer, head: head.head, role } }, ...parts);
}

async function seriesCard(name) {
  const token = ++seriesState.token;
  const model = await api(`/models/${encodeURIComponent(name)}`).catch(() => null);
  if (token !== seriesState.token || !model || !model.series) return null;
  const quoted = encodeURIComponent(model.series);
  const series = await api(`/series/${quoted}`);
  const byRole = {};
  const headsFor = async (role) => (byRole[role] ||= await api(`/series/${quoted}/heads?score=${encodeURIComponent(role)}`));
  const first = await headsFor("induction");
  if (token !== seriesState.token || !first.items.length) return null;
  const stacks = [...new Set(first.items.map((h) => h.stack))];
  const state = { role: "induction", stack: stacks.includes("decoder") ? "decoder" : stacks[0], selected: null };
  const gridHolder = el("div", { class: "series-grid-holder" });
  const headHolder = el("div", { class: "series-head-holder" });
  const bandHolder = el("div", { class: "series-band-holder" });
  const allSteps = series.items.map((i) => i.step);
  const draw = async () => {
    const heads = await headsFor(state.role);
    const items = heads.items.filter((h) => h.stack === state.stack);
    const steps = heads.steps.length ? heads.steps : allSteps;
    const [lo, hi] = [steps[0], steps[steps.length - 1]];
    const layers = Math.max(...items.map((h) => h.layer)) + 1;
    const width = Math.max(...items.map((h) => h.head)) + 1;
    if (!state.selected || !items.some((h) => h.layer === state.selected[0] && h.head === state.selected[1])) {
      const formed = items.filter((h) => h.formed_at[state.role] !== null).sort((a, b) => a.formed_at[state.role] - b.formed_at[state.role]);
      state.selected = formed.length ? [formed[0].layer, formed[0].head] : [items[0].layer, items[0].head];
    }
    const cells = items.map((h) => {
      const at = h.formed_at[state.role];
      return { layer: h.layer, head: h.head, stack: h.stack, type: null, color: formationColor(at, lo, hi),
        label: at === null ? `${state.role}: not formed (it does not hold the role to the last step)` : `${state.role} formed at step ${at.toLocaleString("en-US")}` };
    });
    const grid = headGrid(layers, width, cells, { title: `formation step of ${state.role} in ${model.series}`, stackLabel: state.stack, selected: state.selected,
      onClick: (cell) => { state.selected = [cell.layer, cell.head]; draw(); } });
    grid.classList.add("series-grid");
    grid.dataset.role = state.role;
    gridHolder.replaceChildren(grid, formationLegend(steps));
    const head = items.find((h) => h.layer === state.selected[0] && h.head === state.selected[1]);
    headHolder.replaceChildren(headPlots(head, state.role, series, model));
    const rows = typeCounts(items, allSteps);
    const typed = rows.some((r) => Object.keys(r.counts).length);
    const types = sortTypes([...new Set(rows.flatMap((r) => Object.keys(r.counts)))]);
    bandHolder.replaceChildren(el("h3", {}, `Types of the ${state.stack} heads over the steps`), ...(typed
      ? [typeBand(rows, allSteps, { marks: [{ step: model.step, kind: "this-step", color: "#555", label: `this model: step ${model.step}` }] }),
        legend(types)]
      : [el("p", { class: "muted not-measured", dataset: { what: "types" } }, "Types: not clustered at any step (headcat cluster --series NAME fits one clustering over every step).")]));
  };
  const pick = el("select", { id: "series-role", "aria-label": "role" }, ...SERIES_ROLES.map((r) => el("option", { value: r }, r)));
  pick.addEventListener("change", () => { state.role = pick.value; state.selected = null; draw(); });
  const controls = [el("label", {}, "colour by the formation step of ", pick)];
  if (stacks.length > 1) {
    const stackPick = el("select", { id: "series-stack", "aria-label": "stack" }, ...stacks.map((s) => el("option", { value: s }, s)));
    stackPick.value = state.stack;
    stackPick.addEventListener("change", () => { state.stack = stackPick.value; state.selected = null; draw(); });
    controls.push(el("label", {}, " stack ", stackPick));
  }
  await draw();
  return el("section", { class: "card series-card", id: "series-card", dataset: { series: model.series } },
    el("h2", {}, "Across training"),
    el("p", {}, `${name} is step ${model.step.toLocaleString("en-US")} of series `, el("b", {}, model.series), ` (${count(series.items.length, "step")}, ${allSteps[0].toLocaleString("en-US")} to ${allSteps[allSteps.length - 1].toLocaleString("en-US")}).`),
    el("p", {}, ...controls), gridHolder, headHolder, bandHolder,
    el("p", { class: "hint" }, "A head's formation step for a role is the first step from which it has the role (its score at or above the detection run's threshold) at every later step (SPEC 11); grey: it does not hold to the last step. Click a head for its score over the steps; the repeat gain and losses are each step's detection run on repeated random sequences (SPEC 10), shown only where measured."));
}

async function maybeAddSeries() {
  const match = (location.hash || "").match(/^#\/model\/([^/?]+)/);
  const grid = document.getElementById("grid");
  if (!match || !grid || document.getElementById("series-card")) return;
  const name = decodeURIComponent(match[1]);
  if (seriesState.model === name && seriesState.pending) return;
  seriesState.model = name;
  seriesState.pending = true;
  try {
    const card = await seriesCard(name);
    const app = document.getElementById("app");
    if (card && !document.getElementById("series-card") && app) app.append(card);
  } finally {
    seriesState.pending = false;
  }
}

if (typeof document !== "undefined" && document.getElementById("app")) {
  new MutationObserver(() => { maybeAddSeries(); }).observe(document.getElementById("app"), { childList: true });
  window.addEventListener("hashchange", () => { seriesState.model = null; });
}
if (typeof module !== "undefined") module.exports = { formationColor, logStepTicks, logStep, typeCounts, NOT_FORMED };
