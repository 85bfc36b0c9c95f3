// What a head does on repeated random sequences (SPEC section 10): on a model's page, the grid of one
// stack coloured by a chosen detector's score (induction, duplicate_token, previous_token, sink) in the
// model's current detection run, a mark on every head with that role, the roles as badges, and the map
// of the run's first sequence for the head clicked. Self-contained like importance.js: it watches the
// page for a model view (app.js renders #grid) and adds one card, reading GET /models/{name}/detections
// and GET /models/{name}/detections/example. Uses el/headGrid/heatmap/fmt from plots.js, api() from app.js.
"use strict";

const DETECTORS = ["induction", "duplicate_token", "previous_token", "sink"];
const DETECTOR_COLORS = { induction: "#e15759", duplicate_token: "#f28e2b", previous_token: "#4e79a7", sink: "#59a14f" };
const detectorState = { model: null, token: 0, pending: false };

/** White (score 0) to the detector's colour (score 1): scores lie in [0, 1]. */
function detectorColor(score, detector) {
  if (score === null || score === undefined) return "#eeeeee";
  const t = Math.max(0, Math.min(1, score));
  const hex = DETECTOR_COLORS[detector];
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const mix = (c) => Math.round(255 + (c - 255) * t);
  return `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`;
}

function detectorGrid(data, stack, detector, onClick) {
  const heads = data.heads.filter((h) => h.stack === stack);
  const layers = Math.max(...heads.map((h) => h.layer)) + 1;
  const count = Math.max(...heads.map((h) => h.head)) + 1;
  const cells = heads.map((h) => ({
    layer: h.layer, head: h.head, stack: h.stack, type: null,
    color: detectorColor(h[detector], detector),
    changed: h.roles.includes(detector), // the mark: a head with this role
    label: `${detector} ${h[detector] === null ? "n/a" : fmt(h[detector])}; roles: ${h.roles.join(", ") || "none"}`,
  }));
  const grid = headGrid(layers, count, cells, { title: `${detector} score of ${data.model}`, stackLabel: stack, onClick });
  grid.classList.add("detector-grid");
  grid.dataset.detector = detector;
  return grid;
}

function roleBadges(data, thresholds) {
  const list = el("div", { class: "role-badges" });
  for (const detector of DETECTORS) {
    const heads = data.heads.filter((h) => h.roles.includes(detector));
    const names = heads.map((h) => `${h.stack} ${h.layer}-${h.head}`);
    const shown = names.slice(0, 12).join(", ") + (names.length > 12 ? ` and ${names.length - 12} more` : "");
    list.append(el("p", { class: "role-badge", dataset: { role: detector, count: heads.length } },
      el("b", { style: `color: ${DETECTOR_COLORS[detector]}` }, detector),
      ` (≥ ${thresholds[detector]}): ${heads.length ? shown : "no head"}`));
  }
  return list;
}

async function exampleFor(name, cell, holder) {
  const quoted = encodeURIComponent(name);
  const query = `stack=${encodeURIComponent(cell.stack)}&layer=${cell.layer}&head=${cell.head}`;
  const example = await api(`/models/${quoted}/detections/example?${query}`);
  const title = `${cell.stack} layer ${cell.layer}, head ${cell.head}: the first detection sequence`;
  holder.replaceChildren(el("figure", { class: "detector-example", dataset: { layer: cell.layer, head: cell.head } },
    heatmap(example.map, example.tokens, { size: 240, title }), el("figcaption", {}, title)));
}

async function detectorCard(name) {
  const token = ++detectorState.token;
  const data = await api(`/models/${encodeURIComponent(name)}/detections`).catch(() => null);
  if (token !== detectorState.token || !data || !data.runs.length) return null;
  const run = data.runs.find((r) => r.id === data.current_run_id);
  const stacks = [...new Set(data.heads.map((h) => h.stack))];
  const state = { detector: "induction", stack: stacks.includes("decoder") ? "decoder" : stacks[0] };
  const holder = el("div", { class: "detector-grid-holder" });
  const example = el("div", { class: "detector-example-holder" });
  const draw = () => holder.replaceChildren(detectorGrid(data, state.stack, state.detector,
    (cell) => exampleFor(name, cell, example)));
  const pick = el("select", { id: "detector-select", "aria-label": "detector" },
    ...DETECTORS.map((d) => el("option", { value: d }, d)));
  pick.addEventListener("change", () => { state.detector = pick.value; draw(); });
  const controls = [el("label", {}, "colour by ", pick)];
  if (stacks.length > 1) {
    const stackPick = el("select", { id: "detector-stack", "aria-label": "stack" },
      ...stacks.map((s) => el("option", { value: s }, s)));
    stackPick.value = state.stack;
    stackPick.addEventListener("change", () => { state.stack = stackPick.value; draw(); });
    controls.push(el("label", {}, " stack ", stackPick));
  }
  draw();
  const gain = run.repeat_gain === null ? "No repeat gain (not a causal LM)"
    : `Repeat gain ${fmt(run.repeat_gain)} nats (loss ${fmt(run.loss_first)} on the first copy, ${fmt(run.loss_later)} on the later ones)`;
  const checks = run.checks.map((c) => c.without === null ? `no ${c.role} head to prune`
    : `without the ${c.role} heads: ${fmt(c.without.repeat_gain)} nats`);
  return el("section", { class: "card detector-card", id: "detector-card" },
    el("h2", {}, "What a head does"), el("p", {}, ...controls), holder, roleBadges(data, run.config.thresholds), example,
    el("p", { class: "hint" }, `Detection run #${run.id}: ${count(run.num_sequences, "sequence")} of ${run.config.length} random ids × ${count(run.config.copies, "copy", "copies")} (seed ${run.config.seed}); ` +
      `a score is the attention mass on the detector's pattern (SPEC 10); a dot marks a head with the role. ${gain}${checks.length ? `; ${checks.join("; ")}` : ""}. Click a head for its map.`));
}

async function maybeAddDetectors() {
  const match = (location.hash || "").match(/^#\/model\/([^/?]+)/);
  const grid = document.getElementById("grid");
  if (!match || !grid || document.getElementById("detector-card")) return;
  const name = decodeURIComponent(match[1]);
  if (detectorState.model === name && detectorState.pending) return;
  detectorState.model = name;
  detectorState.pending = true;
  try {
    const card = await detectorCard(name);
    const app = document.getElementById("app");
    if (card && !document.getElementById("detector-card") && app) app.append(card);
  } finally {
    detectorState.pending = false;
  }
}

if (typeof document !== "undefined" && document.getElementById("app")) {
  new MutationObserver(() => { maybeAddDetectors(); }).observe(document.getElementById("app"), { childList: true });
  window.addEventListener("hashchange", () => { detectorState.model = null; });
}
if (typeof module !== "undefined") module.exports = { detectorColor, DETECTORS };
