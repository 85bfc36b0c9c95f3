// headcat's page: the models, one model's heads (grid, shares, t-SNE, features, attention maps,
// stability, ablations, exports) and a comparison of models. Routes live in the URL's hash:
//   #/                         the models
//   #/model/NAME               one model        #/model/NAME/head/L/H   ... with one head open
//   #/compare?models=A,B,C     A compared with B and C
"use strict";

const TYPE_ORDER = ["dense", "diagonal", "dense_vertical", "vertical"];
const state = { palette: null, paths: new Set(), model: null, headToken: 0 };

/** Replace the page's content; null children (sections that do not apply) are skipped. */
function mount(...children) {
  document.getElementById("app").replaceChildren(...children.flat().filter(Boolean));
}

// --- data --------------------------------------------------------------------------------------

// Reads are open unless the server sets HEADCAT_READS_REQUIRE_KEY; then the page asks for an API
// key once and keeps it in this tab's sessionStorage (never in localStorage or a cookie).
const KEY_ITEM = "headcat-api-key";

async function api(path, retried = false) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { headers });
  if ((response.status === 401 || response.status === 403) && !retried) {
    const stored = sessionStorage.getItem(KEY_ITEM);
    if (stored && stored !== key) return api(path, true); // another request was just given a key
    sessionStorage.removeItem(KEY_ITEM);
    const entered = window.prompt("This catalog needs an API key to read (headcat keys create NAME):");
    if (entered && entered.trim()) {
      sessionStorage.setItem(KEY_ITEM, entered.trim());
      return api(path, true);
    }
  }
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const body = await response.json();
      detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (_) { /* not JSON */ }
    const error = new Error(detail);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

async function allHeads(model) {
  const items = [];
  for (let offset = 0; ; offset += 1000) {
    const page = await api(`/heads?model=${encodeURIComponent(model)}&limit=1000&offset=${offset}`);
    items.push(...page.items);
    if (items.length >= page.total || !page.items.length) return items;
  }
}

// --- colours: the same rule as service/web/palette.py --------------------------------------------

function nameHash(name) {
  let value = 0;
  for (const char of name) value = (value * 31 + char.codePointAt(0)) % 1000003;
  return value;
}

function colorFor(type) {
  const p = state.palette;
  if (type === null || type === undefined || type === "") return p.untyped;
  if (p.types[type]) return p.types[type];
  const numbered = /^cluster_(\d+)$/.exec(type);
  const index = numbered ? Number(numbered[1]) : nameHash(type);
  return p.fallback[index % p.fallback.length];
}

function sortTypes(types) {
  const rank = (t) => (TYPE_ORDER.includes(t) ? TYPE_ORDER.indexOf(t) : TYPE_ORDER.length);
  return [...new Set(types)].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

function typeLabel(type) {
  return type ? type.replace("dense_vertical", "dense & vertical") : "no type yet";
}

function swatch(type) {
  return el("span", { class: "swatch", style: `background:${colorFor(type)}` });
}

function legend(types, counts, total) {
  return el("div", { class: "legend" },
    types.map((t) => el("span", { class: "legend-item", dataset: { type: t } },
      swatch(t), typeLabel(t),
      counts ? el("span", { class: "muted" }, ` ${counts[t] || 0} (${pct((counts[t] || 0) / (total || 1), 0)})`) : null)));
}

// --- layout helpers ----------------------------------------------------------------------------

function card(title, ...children) {
  return el("section", { class: "card" }, title ? el("h2", {}, title) : null, ...children);
}

function fixedCard(title, ...children) {
  const node = card(title, ...children);
  node.classList.add("fixed");
  return node;
}

function hint(...children) {
  return el("p", { class: "hint" }, ...children);
}

function showError(error) {
  mount(el("div", { class: "error" }, el("b", {}, "Could not load this view. "), error.message));
}

// A head is [layer, head] or [layer, head, stack]; the stack goes in the URL when it is given.
function modelHref(name, head) {
  const base = `#/model/${encodeURIComponent(name)}`;
  if (!head) return base;
  return `${base}/head/${head[0]}/${head[1]}${head[2] ? `?stack=${encodeURIComponent(head[2])}` : ""}`;
}

const STACK_ORDER = ["encoder", "decoder", "cross"];

// [[stack, {layers, heads, kv_heads}], ...] in encoder, decoder, cross order; a record without
// stacks is one stack of num_layers x num_heads.
function stacksOf(detail) {
  const stacks = Object.entries(detail.stacks || {}).sort((a, b) => STACK_ORDER.indexOf(a[0]) - STACK_ORDER.indexOf(b[0]));
  return stacks.length ? stacks : [["encoder", { layers: detail.num_layers, heads: detail.num_heads, kv_heads: null }]];
}

// query heads per key/value head when a stack's heads are grouped, else null
function kvGroup(shape) {
  const kv = shape.kv_heads;
  return kv && kv < shape.heads && shape.heads % kv === 0 ? shape.heads / kv : null;
}

function headStack(data, h) {
  return h.stack || stacksOf(data.detail)[0][0];
}

// --- the models --------------------------------------------------------------------------------

async function showModels() {
  document.title = "headcat: models";
  const models = await api("/models");
  if (!models.length) {
    mount(card("No models yet",
      hint("Ingest one and cluster it, e.g. ", el("code", {}, "headcat quickstart"), ", or ",
        el("code", {}, "headcat ingest bert-base-uncased --name bert && headcat cluster bert"), ".")));
    return;
  }
  const checked = new Set();
  const compareButton = el("button", { class: "button", disabled: true, onclick: () => {
    location.hash = `#/compare?models=${[...checked].map(encodeURIComponent).join(",")}`;
  } }, "Compare selected");
  const rows = models.map((m) => {
    const shares = el("td", { class: "shares" });
    const box = el("input", { type: "checkbox", "aria-label": `select ${m.name}`, onchange: (e) => {
      if (e.target.checked) checked.add(m.name); else checked.delete(m.name);
      compareButton.disabled = checked.size < 2;
    } });
    return { m, shares, row: el("tr", { dataset: { model: m.name } },
      el("td", {}, box),
      el("td", {}, el("a", { href: modelHref(m.name), class: "model-link" }, m.name)),
      el("td", {}, m.architecture),
      el("td", { class: "num" }, `${m.num_layers} × ${m.num_heads}`),
      el("td", {}, m.current_clustering_id ? `#${m.current_clustering_id}` : el("span", { class: "muted" }, "not clustered")),
      shares,
      el("td", { class: "muted source", title: m.source }, m.source)) };
  });
  mount(
    el("div", { class: "page-head" }, el("h1", {}, "Models"), el("p", { class: "muted" },
      `${models.length} model${models.length === 1 ? "" : "s"} in the catalog. Open one to see its heads, or tick two or more of one shape to compare them.`)),
    card(null,
      el("table", { class: "models" },
        el("thead", {}, el("tr", {}, ["", "name", "architecture", "layers × heads", "clustering", "head types", "source"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows.map((r) => r.row))),
      typeLegend(models.some((m) => m.current_clustering_id)),
      el("div", { class: "actions" }, compareButton)));
  await Promise.all(rows.map(async ({ m, shares }) => {
    if (!m.current_clustering_id) return;
    const detail = await api(`/models/${encodeURIComponent(m.name)}`);
    const clusters = detail.clustering ? detail.clustering.clusters : [];
    shares.append(shareBar(sortTypes(clusters.map((c) => c.name)).map((t) => {
      const c = clusters.find((x) => x.name === t);
      return { label: typeLabel(t), value: c.share, color: colorFor(t) };
    }), 200, 12));
  }));
}

/** What the colours of the "head types" bars mean (the four types of the paper; others are named in their tooltips). */
function typeLegend(shown) {
  if (!shown) return null;
  return el("p", { class: "legend type-legend muted" }, "head types: ",
    TYPE_ORDER.map((t) => el("span", { class: "legend-item", dataset: { type: t } }, swatch(t), typeLabel(t))));
}

// --- one model ---------------------------------------------------------------------------------

async function loadModel(name) {
  const detail = await api(`/models/${encodeURIComponent(name)}`);
  const [heads, clustering, examples, ablations] = await Promise.all([
    allHeads(name),
    detail.current_clustering_id ? api(`/clusterings/${detail.current_clustering_id}`) : null,
    api(`/models/${encodeURIComponent(name)}/type-examples?per_type=3`),
    // ablation runs are shown when this catalog's API serves them
    state.paths.has("/models/{name}/ablations") ? api(`/models/${encodeURIComponent(name)}/ablations`).catch(() => null) : null,
  ]);
  return { name, detail, heads, clustering, examples, ablations };
}

async function showModel(name, head) {
  if (!state.model || state.model.name !== name) {
    mount(el("p", { class: "loading" }, `Loading ${name}…`));
    state.model = await loadModel(name);
    renderModel(state.model);
  }
  selectHead(head);
}

function renderModel(data) {
  const { detail, heads, clustering } = data;
  document.title = `headcat: ${detail.name}`;
  const typed = heads.some((h) => h.type);
  const types = sortTypes(heads.map((h) => h.type).filter(Boolean));
  const counts = {};
  for (const h of heads) if (h.type) counts[h.type] = (counts[h.type] || 0) + 1;

  const joint = clustering ? clustering.models.map((m) => m.model).filter((m) => m !== detail.name) : [];
  // the runs the catalog serves (GET /models/{name}: current_runs; a clustering's current_stability_run_id)
  const stability = clustering ? clustering.stability.find((s) => s.id === clustering.current_stability_run_id) ?? null : null;
  const run = detail.feature_runs.find((r) => r.id === detail.current_runs.features) ?? null;

  const gridHolder = el("div", { class: "grid-holder", id: "grid" });
  const headPanel = el("section", { class: "card head-panel", id: "head-panel" },
    el("h2", {}, "Head"), hint("Click a head in the grid (or a dot in the t-SNE) to see its features and attention."));

  mount(
    el("div", { class: "page-head" },
      el("h1", {}, detail.name),
      el("p", { class: "muted" },
        `${detail.architecture} · ${stacksOf(detail).map(([s, shape]) => `${stacksOf(detail).length > 1 ? `${s} ` : ""}${shape.layers} layers × ${shape.heads} heads${kvGroup(shape) ? ` (${shape.kv_heads} key/value heads)` : ""}`).join(", ")} · `,
        el("span", { class: "source", title: detail.source }, detail.source)),
      el("p", { class: "facts" },
        run ? el("span", {}, `features: ${run.num_samples} samples of ${run.corpus.name} (${run.num_tokens.toLocaleString()} tokens, max ${run.max_length})`) : null,
        clustering
          ? el("span", {}, `clustering #${clustering.id}: ${clustering.algorithm}, k = ${clustering.k}, seed ${clustering.seed}`,
            joint.length ? el("span", {}, " · joint with ", joint.map((m, i) => [i ? ", " : "", el("a", { href: modelHref(m) }, m)])) : null)
          : el("span", { class: "muted" }, "not clustered yet"),
        stability ? el("span", {}, `stability ${pct(stability.score)} (R = ${stability.n_runs})`) : null),
      typed ? legend(types, counts, heads.length) : null),
    el("div", { class: "row" },
      fixedCard(stacksOf(detail).length > 1 ? "Head types by layer, one grid per stack" : "Head types by layer", gridHolder,
        typed ? null : hint("This model has not been clustered yet, so its heads have no type. Run ",
          el("code", {}, `headcat cluster ${detail.name}`), " (or cluster it jointly with other models)."),
        typed ? hint(heads.some((h) => h.agreement !== null && h.agreement !== undefined)
          ? `Hatched: uncertain type, given by fewer than ${pct(CERTAIN_AGREEMENT, 0)} of the current stability run's fits; solid: certain. Hover for agreement and margin.`
          : `Hatched: uncertain type, margin below ${CERTAIN_MARGIN} (near the border between two centroids); run a stability job for per-head agreement.`) : null),
      headPanel),
    el("div", { class: "row" },
      typed ? fixedCard("t-SNE of the clustering", tsneView(data),
        joint.length ? hint("Filled dots: this model's heads; rings: the other models of the joint clustering.") : null) : null,
      el("div", { class: "stack" },
        typed ? stabilityCard(clustering, stability) : null,
        ablationCard(data.ablations),
        exportCard(detail.name, types, detail.num_layers))),
    typed ? card("Distance features per type", featureBoxes(heads, types),
      hint("Box plots of the 21 features (Guan et al. 2020, Fig. 1) over this model's heads of each type: w0…w15 are distance windows, then self and the special tokens.")) : null,
    typed ? card("Attention maps per type", exampleMaps(data.examples),
      hint("The heads nearest their type's centroid, on the feature run's example sentence (downsampled; rows are queries). Hover for tokens.")) : null,
  );
  drawGrid(null);
  if (window.headcatExtras) window.headcatExtras.model(data); // attribution and syntax cards (attribution.js)
}

// Confidence in a head's type: with a stability run, its agreement (share of the run's fits giving
// it this type) below CERTAIN_AGREEMENT is uncertain; without one, its margin ((d2 - d1) / max(d1, d2),
// distances to its own and to the nearest other centroid) below CERTAIN_MARGIN. Uncertain cells are hatched.
const CERTAIN_AGREEMENT = 0.9;
const CERTAIN_MARGIN = 0.2;

function confidence(h) {
  if (!h.type) return { uncertain: false, text: null };
  const parts = [];
  if (h.agreement !== null && h.agreement !== undefined) parts.push(`agreement ${pct(h.agreement, 0)} of stability fits`);
  if (h.margin !== null && h.margin !== undefined) parts.push(`margin ${h.margin.toFixed(2)}`);
  const uncertain = h.agreement !== null && h.agreement !== undefined ? h.agreement < CERTAIN_AGREEMENT
    : h.margin !== null && h.margin !== undefined ? h.margin < CERTAIN_MARGIN : false;
  return { uncertain, text: parts.length ? `${uncertain ? "uncertain" : "certain"} type: ${parts.join(", ")}` : null };
}

// One grid per stack (encoder, decoder, cross; layers count within each); grouped key/value
// heads are marked above the grid. `selected` is [layer, head, stack] or null.
function drawGrid(selected) {
  const data = state.model;
  const holder = document.getElementById("grid");
  if (!data || !holder) return;
  const typed = data.heads.some((h) => h.type);
  const types = sortTypes(data.heads.map((h) => h.type).filter(Boolean));
  const stacks = stacksOf(data.detail);
  const many = stacks.length > 1;
  holder.replaceChildren(...stacks.map(([stack, shape]) => {
    const heads = data.heads.filter((h) => headStack(data, h) === stack);
    const perLayer = Array.from({ length: shape.layers }, () => ({}));
    for (const h of heads) if (h.type && perLayer[h.layer]) perLayer[h.layer][h.type] = (perLayer[h.layer][h.type] || 0) + 1;
    const group = kvGroup(shape);
    const cells = heads.map((h) => {
      const sure = confidence(h);
      return { stack, layer: h.layer, head: h.head, type: h.type, color: colorFor(h.type), label: typeLabel(h.type),
        kv: group ? Math.floor(h.head / group) : null, uncertain: sure.uncertain, confidence: sure.text };
    });
    const mine = selected && (selected[2] || stacks[0][0]) === stack ? selected : null;
    const grid = headGrid(shape.layers, shape.heads, cells, {
      selected: mine,
      kvGroup: group,
      stackLabel: many ? stack : null,
      title: `${many ? `${stack} ` : ""}head types of ${data.detail.name}`,
      onClick: (c) => { location.hash = modelHref(data.name, many ? [c.layer, c.head, stack] : [c.layer, c.head]); },
      shares: typed ? perLayer.map((c) => types.map((t) => ({ type: typeLabel(t), color: colorFor(t), count: c[t] || 0 }))) : null,
    });
    return el("figure", { class: "stack-grid", dataset: { stack } },
      many || group ? el("figcaption", {}, many ? el("b", {}, stack) : null,
        many ? ` · ${shape.layers} layers × ${shape.heads} heads` : "",
        group ? el("span", { class: "muted" }, ` · every ${group} query heads share one key/value head (marked above the grid)`) : null) : null,
      grid);
  }));
}

function tsneView(data) {
  const points = data.clustering.tsne.map((p) => ({
    x: p.x, y: p.y, color: colorFor(p.type), own: p.model === data.name,
    label: `<b>${escapeHtml(p.model)}</b> layer ${p.layer}, head ${p.head}<br>${escapeHtml(typeLabel(p.type))}`,
    onClick: () => { location.hash = modelHref(p.model, [p.layer, p.head, p.stack]); },
  }));
  return scatter(points);
}

function stabilityCard(clustering, latest) {
  if (!latest) {
    return card("Stability", hint("No stability run for this clustering yet: ", el("code", {}, `headcat stability ${clustering.id}`),
      " refits it on random halves of the heads (Von Luxburg 2010; Guan et al. Table 1)."));
  }
  return card("Stability",
    el("p", { class: "big" }, pct(latest.score)),
    hint(`of the clustering's ${clustering.num_heads} heads keep their type in all ${latest.n_runs} fits on random ${pct(latest.fraction, 0)} subsets (Guan et al. report 94–96 %).`),
    clustering.stability.length > 1
      ? el("table", { class: "compact" }, el("tbody", {}, clustering.stability.map((s) =>
        el("tr", {}, el("td", {}, `run #${s.id}`), el("td", { class: "num" }, pct(s.score)), el("td", { class: "muted" }, `R = ${s.n_runs}`)))))
      : null);
}

function ablationCard(runs) {
  if (!Array.isArray(runs) || !runs.length) return null;
  const signed = (v) => `${v >= 0 ? "+" : ""}${fmt(v, 3)}`;
  // The API lists runs newest first; show the three newest.
  return card("Ablations", runs.slice(0, 3).map((run) => {
    const baseline = (run.baseline && run.baseline.metrics) || {};
    const metrics = Object.keys(baseline).filter((k) => typeof baseline[k] === "number");
    const outcomes = (run.outcomes || []).filter((o) => o.heads > 0);  // the baseline has its own row
    return el("div", { class: "ablation-run" },
      el("h3", {}, `run #${run.id}: ${run.task} on ${(run.data && run.data.source) || "?"}, ${run.n_examples} examples`),
      el("table", { class: "compact" },
        el("thead", {}, el("tr", {}, el("th", {}, "ablated"), el("th", { class: "num" }, "heads"), metrics.map((m) => el("th", { class: "num" }, m)))),
        el("tbody", {},
          el("tr", {}, el("td", { class: "muted" }, "nothing (baseline)"), el("td", { class: "num" }, 0),
            metrics.map((m) => el("td", { class: "num" }, fmt(baseline[m], 3)))),
          outcomes.map((o) => el("tr", {}, el("td", {}, o.label || o.row_id), el("td", { class: "num" }, o.heads),
            metrics.map((m) => el("td", { class: "num" },
              fmt((o.metrics || {})[m], 3), (o.deltas || {})[m] !== undefined ? el("span", { class: "muted" }, ` (${signed(o.deltas[m])})`) : null)))))));
  }));
}

function exportCard(name, types, numLayers) {
  const format = el("select", { "aria-label": "format" },
    ["prune_heads", "head_mask", "head_mask.npy", "scores", "pairs", "csv"].map((f) => el("option", { value: f }, f)));
  const boxes = types.map((t) => el("label", { class: "check" }, el("input", { type: "checkbox", value: t }), swatch(t), typeLabel(t)));
  const from = el("input", { type: "number", min: 0, max: numLayers - 1, value: 0, "aria-label": "from layer" });
  const to = el("input", { type: "number", min: 0, max: numLayers - 1, value: numLayers - 1, "aria-label": "to layer" });
  const link = el("a", { class: "export-link" });
  const command = el("code", { class: "command" });
  const update = () => {
    const chosen = boxes.map((b) => b.querySelector("input")).filter((i) => i.checked).map((i) => i.value);
    const params = new URLSearchParams({ format: format.value });
    if (chosen.length) params.set("type", chosen.join(","));
    if (Number(from.value) > 0) params.set("layer_ge", from.value);
    if (Number(to.value) < numLayers - 1) params.set("layer_le", to.value);
    const url = `/models/${encodeURIComponent(name)}/export?${params}`;
    link.href = url;
    link.textContent = decodeURIComponent(url);
    const flags = [`--format ${format.value}`, chosen.length ? `--type ${chosen.join(",")}` : "",
      Number(from.value) > 0 ? `--layer-ge ${from.value}` : "", Number(to.value) < numLayers - 1 ? `--layer-le ${to.value}` : ""];
    command.textContent = `headcat export ${name} ${flags.filter(Boolean).join(" ")}`;
  };
  for (const input of [format, from, to, ...boxes.map((b) => b.querySelector("input"))]) input.addEventListener("input", update);
  update();
  return card("Export heads to prune",
    el("div", { class: "export-form" }, el("label", {}, "format ", format), boxes.length ? el("div", { class: "checks" }, boxes) : null,
      el("label", {}, "layers ", from, " to ", to)),
    el("p", {}, link), el("p", {}, command),
    hint("The selection is the heads to prune: head_mask has 0 there and 1 elsewhere."));
}

function featureBoxes(heads, types) {
  const names = Object.keys(heads[0].features);
  const max = Math.max(...heads.flatMap((h) => names.map((n) => h.features[n])));
  const yMax = Math.min(1, Math.ceil(max * 4) / 4);
  return el("div", { class: "panels" }, types.map((t) => {
    const rows = heads.filter((h) => h.type === t).map((h) => h.features);
    return el("figure", { dataset: { type: t } },
      boxPlot(names, rows, colorFor(t), { yMax, title: `${typeLabel(t)} (${rows.length} heads)` }));
  }));
}

function exampleMaps(examples) {
  const types = sortTypes(Object.keys(examples.types));
  if (!types.length) return hint("No example maps were stored with this model's features.");
  return el("div", { class: "panels maps" }, types.map((t) => el("figure", { class: "type-maps", dataset: { type: t } },
    el("figcaption", {}, swatch(t), typeLabel(t)),
    el("div", { class: "map-row" }, examples.types[t].map((e) => el("a", { href: modelHref(examples.model, [e.layer, e.head, e.stack]), class: "map-link" },
      heatmap(e.map, examples.labels, { size: 120, color: colorFor(t), title: `layer ${e.layer}, head ${e.head}` }),
      el("span", { class: "muted" }, `L${e.layer} H${e.head}`)))))));
}

// --- one head ----------------------------------------------------------------------------------

async function selectHead(head) {
  drawGrid(head);
  if (window.headcatExtras && state.model) window.headcatExtras.head(state.model.name, head);
  const panel = document.getElementById("head-panel");
  if (!panel || !head) return;
  const token = ++state.headToken;
  const name = state.model.name;
  let h;
  try {
    const stack = head[2] || stacksOf(state.model.detail)[0][0];
    h = await api(`/models/${encodeURIComponent(name)}/heads/${head[0]}/${head[1]}?stack=${encodeURIComponent(stack)}`);
  } catch (error) {
    panel.replaceChildren(el("h2", {}, "Head"), el("div", { class: "error" }, error.message));
    return;
  }
  if (token !== state.headToken) return; // a later click won
  const names = Object.keys(h.features);
  const color = colorFor(h.type);
  panel.replaceChildren(...[ // a section that does not apply is null: skipped, never printed as "null"
    el("h2", { id: "head-title" }, `${stacksOf(state.model.detail).length > 1 ? `${h.stack} · ` : ""}Layer ${h.layer}, head ${h.head}`,
      el("span", { class: "type-tag", style: `background:${color}` }, typeLabel(h.type))),
    el("p", { class: "facts" },
      h.clustering_id ? el("span", {}, `clustering #${h.clustering_id}`) : null,
      h.centroid_distance !== null ? el("span", {}, `distance to centroid ${fmt(h.centroid_distance)}`) : null,
      h.stable === null ? null : el("span", {}, h.stable ? "stable in all fits" : "not stable: changed type in some fits"),
      h.kv_head === null || h.kv_head === undefined ? null : el("span", { class: "kv-share" },
        `key/value head ${h.kv_head} of ${h.kv_heads}, shared with query heads ${h.kv_head * (h.num_heads / h.kv_heads)}–${(h.kv_head + 1) * (h.num_heads / h.kv_heads) - 1}`)),
    featureBars(names, h.features, h.centroid, color),
    hint("Bars: this head's features; black ticks: its type's centroid."),
    el("div", { class: "head-detail" },
      el("div", {},
        el("table", { class: "compact scalars" }, el("tbody", {},
          Object.entries(h.scalars).map(([k, v]) => el("tr", {}, el("th", {}, k.replace(/_/g, " ")), el("td", { class: "num" }, fmt(v)))))),
        el("details", {}, el("summary", {}, `all ${names.length} features`),
          el("table", { class: "compact features-table" }, el("tbody", {},
            names.map((n) => el("tr", { class: "feature-row", dataset: { feature: n } }, el("th", {}, n),
              el("td", { class: "num" }, fmt(h.features[n], 4)),
              h.centroid ? el("td", { class: "num muted" }, fmt(h.centroid[n], 4)) : null)))))),
      h.example ? el("figure", { class: "head-map" },
        heatmap(h.example.map, h.example.labels, { size: 224, color, title: `layer ${h.layer}, head ${h.head}` }),
        el("figcaption", { class: "muted" }, `attention on the example (${h.example.tokens.length} tokens in ${h.example.map.length} bins): `,
          el("span", { class: "tokens" }, h.example.tokens.slice(0, 40).join(" "), h.example.tokens.length > 40 ? " …" : ""))) : null),
    h.history.length > 1 || (h.history.length === 1 && h.history[0].models.length > 1) ? el("div", {},
      el("h3", {}, "Type in each clustering"),
      el("table", { class: "compact" }, el("tbody", {}, h.history.map((c) => el("tr", {},
        el("td", {}, `#${c.clustering_id}${c.current ? " (current)" : ""}`),
        el("td", {}, swatch(c.type), typeLabel(c.type)),
        el("td", { class: "muted" }, clusteringSummary(c))))))) : null,
  ].filter(Boolean));
}

/** One clustering in a head's history: what was clustered (attention features, or the global vectors
 * of attribution), how, and on which models (several: a joint clustering). */
function clusteringSummary(c) {
  const what = c.vector === "global" ? "global vectors (attribution)" : "attention features";
  const on = c.models.length > 1 ? `joint: ${c.models.join(", ")}` : c.models.join(", ");
  return `${c.algorithm}, k = ${c.k}, seed ${c.seed}, on ${what}; ${on}`;
}

// --- comparing models ----------------------------------------------------------------------------

async function showCompare(selected) {
  document.title = "headcat: compare";
  const models = await api("/models");
  const chosen = selected ? selected.split(",").filter(Boolean) : [];
  const order = [...chosen, ...models.map((m) => m.name).filter((n) => !chosen.includes(n))];
  const checks = order.map((n) => {
    const m = models.find((x) => x.name === n);
    return el("label", { class: "check" }, el("input", { type: "checkbox", value: n, checked: chosen.includes(n) }),
      n, m ? el("span", { class: "muted" }, ` ${m.num_layers}×${m.num_heads}`) : null);
  });
  const go = el("button", { class: "button", onclick: () => {
    const names = checks.map((c) => c.querySelector("input")).filter((i) => i.checked).map((i) => i.value);
    location.hash = `#/compare?models=${names.map(encodeURIComponent).join(",")}`;
  } }, "Compare");
  const picker = card("Compare models",
    hint("Tick a pre-trained model first (the baseline) and then its fine-tuned versions; models must have the same layers × heads."),
    el("div", { class: "checks" }, checks), el("div", { class: "actions" }, go));
  if (chosen.length < 2) {
    mount(el("div", { class: "page-head" }, el("h1", {}, "Compare")), picker);
    return;
  }
  const result = await api(`/compare?models=${chosen.map(encodeURIComponent).join(",")}`);
  const types = sortTypes(Object.values(result.types).flat(2));
  const grids = result.models.map((m) => {
    const base = result.types[result.baseline];
    const own = result.types[m.name];
    const cells = [];
    own.forEach((row, layer) => row.forEach((t, head) => cells.push({
      layer, head, type: t, color: colorFor(t),
      changed: m.name !== result.baseline && t !== base[layer][head],
      label: m.name === result.baseline || t === base[layer][head] ? typeLabel(t) : `${typeLabel(base[layer][head])} → ${typeLabel(t)}`,
    })));
    const counts = result.counts.find((c) => c.model === m.name);
    return el("figure", { class: "compare-grid", dataset: { model: m.name } },
      el("figcaption", {}, el("a", { href: modelHref(m.name) }, m.name),
        m.name === result.baseline ? el("span", { class: "muted" }, " (baseline)")
          : el("span", { class: "muted" }, ` ${counts.changed} of ${counts.total} heads changed type (${pct(counts.changed / counts.total, 0)})`)),
      headGrid(m.num_layers, m.num_heads, cells, { title: `head types of ${m.name}`, onClick: (c) => { location.hash = modelHref(m.name, [c.layer, c.head]); } }));
  });
  mount(
    el("div", { class: "page-head" }, el("h1", {}, `${result.baseline} vs ${result.models.slice(1).map((m) => m.name).join(", ")}`),
      el("p", { class: "muted" }, result.joint
        ? `All types come from one joint clustering (#${result.models[0].clustering_id}), so every head is named by the same centroids.`
        : "These models were clustered separately; their types are named by the same rule, but a joint clustering compares them more fairly."),
      legend(types)),
    card("Head types, with changed heads marked", el("div", { class: "panels" }, grids),
      hint("A dot marks a head whose type differs from the baseline's. Click a head to open it.")),
    el("div", { class: "row" }, result.counts.map((c) => card(`${result.baseline} → ${c.model}`, transitionTable(c, types), changedByLayer(c)))),
    card(`Heads that changed type (${result.changed.length})`, changedTable(result)),
    picker,
  );
}

function transitionTable(counts, types) {
  const cols = sortTypes([...types]);
  return el("table", { class: "transitions", dataset: { model: counts.model } },
    el("thead", {}, el("tr", {}, el("th", { class: "muted" }, "baseline ↓ / now →"), cols.map((t) => el("th", {}, swatch(t), typeLabel(t))))),
    el("tbody", {}, cols.map((from) => el("tr", {}, el("th", {}, swatch(from), typeLabel(from)), cols.map((to) => {
      const n = (counts.transitions[from] || {})[to] || 0;
      return el("td", { class: `num${from === to ? " same" : n ? " moved" : " zero"}` }, n);
    })))));
}

function changedByLayer(counts) {
  const max = Math.max(1, ...counts.by_layer);
  return el("div", { class: "by-layer" }, el("h3", {}, "changed heads per layer"),
    counts.by_layer.map((n, layer) => el("div", { class: "bar-row" }, el("span", { class: "muted" }, `layer ${layer}`),
      el("span", { class: "bar", style: `width:${(100 * n) / max}%` }), el("span", { class: "num" }, n))));
}

function changedTable(result) {
  if (!result.changed.length) return hint("No head changed type.");
  const names = result.models.map((m) => m.name);
  return el("table", { class: "compact changed" },
    el("thead", {}, el("tr", {}, el("th", {}, "layer"), el("th", {}, "head"), names.map((n) => el("th", {}, n)))),
    el("tbody", {}, result.changed.map((c) => el("tr", {}, el("td", { class: "num" }, c.layer), el("td", { class: "num" }, c.head),
      names.map((n) => el("td", { class: c.types[n] !== c.types[result.baseline] ? "moved" : "" },
        el("a", { href: modelHref(n, [c.layer, c.head]) }, swatch(c.types[n]), typeLabel(c.types[n]))))))));
}

// --- routing -----------------------------------------------------------------------------------

async function route() {
  tooltip.hide();
  const [path, query] = (location.hash || "#/").slice(1).split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  for (const link of document.querySelectorAll("header nav a")) {
    link.classList.toggle("active", link.getAttribute("href") === `#/${parts[0] === "compare" ? "compare" : ""}`);
  }
  try {
    if (parts[0] === "model" && parts[1]) {
      const stack = new URLSearchParams(query || "").get("stack");
      await showModel(parts[1], parts[2] === "head" ? [Number(parts[3]), Number(parts[4]), stack] : null);
    } else {
      state.model = null;
      if (parts[0] === "compare") await showCompare(new URLSearchParams(query || "").get("models"));
      else await showModels();
    }
  } catch (error) {
    state.model = null;
    showError(error);
  }
}

async function start() {
  const [palette, openapi] = await Promise.all([api("/palette.json"), api("/openapi.json").catch(() => ({ paths: {} }))]);
  state.palette = palette;
  state.paths = new Set(Object.keys(openapi.paths || {}));
  window.addEventListener("hashchange", route);
  await route();
}

start();
