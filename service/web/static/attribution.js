// What a head reads and what it knows, on a model's page (loaded after app.js, which calls
// window.headcatExtras.model(data) when a model is drawn and .head(name, head) when a head is opened):
//   - Attribution (Pascual et al. 2021, SPEC 8): the mean discrepancy between attention and gradient
//     attribution per layer, and for the open head its attention rows beside its attribution rows.
//   - Syntax heads (Clark et al. 2019, SPEC 9): a relations x heads heat map of accuracy and the best
//     head per relation against the fixed-offset baseline.
"use strict";

(function () {
  const ATTRIBUTION_COLOR = "#4e79a7";
  const ATTENTION_COLOR = "#e15759";
  const SYNTAX_COLOR = "#59a14f";
  const extras = { name: null, attributions: null, token: 0 };

  /** A rows x columns matrix on a canvas (rows = queries or relations); the tooltip names both. */
  function matrixPlot(rows, rowLabels, columnLabels, { cell = 8, rowHeight = cell, color = ATTENTION_COLOR, title = "", what = "value", max = null } = {}) {
    const height = rows.length;
    const width = rows.length ? rows[0].length : 0;
    const canvas = el("canvas", { class: "heatmap", width: Math.max(1, width * cell), height: Math.max(1, height * rowHeight), role: "img", "aria-label": title });
    const ctx = canvas.getContext("2d");
    const top = max ?? Math.max(1e-9, ...rows.flat());
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
    rows.forEach((row, i) => row.forEach((value, j) => {
      const a = Math.sqrt(Math.max(0, value) / top);
      ctx.fillStyle = `rgb(${Math.round(255 - a * (255 - r))}, ${Math.round(255 - a * (255 - g))}, ${Math.round(255 - a * (255 - b))})`;
      ctx.fillRect(j * cell, i * rowHeight, cell, rowHeight);
    }));
    canvas.addEventListener("mousemove", (e) => {
      const box = canvas.getBoundingClientRect();
      const j = Math.min(width - 1, Math.floor(((e.clientX - box.left) / box.width) * width));
      const i = Math.min(height - 1, Math.floor(((e.clientY - box.top) / box.height) * height));
      tooltip.show(e, `${title ? `<b>${escapeHtml(title)}</b><br>` : ""}${escapeHtml(rowLabels[i] ?? i)} · ${escapeHtml(columnLabels[j] ?? j)}<br>${what} ${fmt(rows[i][j], 3)}`);
    });
    canvas.addEventListener("mouseleave", () => tooltip.hide());
    return canvas;
  }

  /** A matrix plot with its labels: one per row on the left, one per group of columns (a layer's heads) on top. */
  function labelledMatrix(plot, rowLabels, groups, { cell, rowHeight }) {
    return el("div", { class: "labelled-matrix" },
      el("span", { class: "matrix-corner" }),
      el("div", { class: "matrix-columns" }, groups.map((g) =>
        el("span", { class: "matrix-column", style: `width:${g.span * cell}px` }, g.label))),
      el("div", { class: "matrix-rows" }, rowLabels.map((r) =>
        el("span", { class: "matrix-row", style: `height:${rowHeight}px;line-height:${rowHeight}px` }, r))),
      plot);
  }

  /** Bars of the mean discrepancy per layer (does it grow with depth?). */
  function layerBars(values, { width = 300, height = 150 } = {}) {
    const left = 44, bottom = 34, top = 8;
    const svg = svgEl("svg", { class: "layer-discrepancy", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "mean discrepancy per layer" });
    const step = (width - left - 4) / Math.max(1, values.length);
    const y = (v) => height - bottom - v * (height - bottom - top);
    for (const tick of [0, 0.5, 1]) {
      svg.append(svgEl("line", { x1: left, x2: width - 4, y1: y(tick), y2: y(tick), class: "axis" }));
      svg.append(svgEl("text", { x: left - 4, y: y(tick) + 3, class: "axis tick", "text-anchor": "end" }, tick.toFixed(1)));
    }
    values.forEach((v, i) => {
      const bar = svgEl("rect", { x: left + i * step + 2, y: y(v), width: step - 4, height: y(0) - y(v), fill: ATTRIBUTION_COLOR, dataset: { layer: i } });
      withTooltip(bar, `layer ${i}: mean discrepancy ${fmt(v, 3)}`);
      svg.append(bar, svgEl("text", { x: left + i * step + step / 2, y: height - bottom + 12, class: "axis tick", "text-anchor": "middle" }, `L${i}`));
    });
    svg.append(svgEl("text", { x: left + (width - left - 4) / 2, y: height - 4, class: "axis axis-title", "text-anchor": "middle" }, "layer"),
      yTitle("discrepancy", 9, top + (height - bottom - top) / 2));
    return svg;
  }

  function binLabels(tokens, bins) {
    return Array.from({ length: bins }, (_, b) => {
      const from = Math.floor((b * tokens.length) / bins);
      const to = Math.max(from + 1, Math.floor(((b + 1) * tokens.length) / bins));
      return tokens.slice(from, to).join(" ");
    });
  }

  async function attributionCard(name) {
    if (!state.paths.has("/models/{name}/attributions")) return null;
    const detail = await api(`/models/${encodeURIComponent(name)}`).catch(() => null);
    const id = detail ? detail.current_runs.attribution : null;  // the run the catalog serves
    const runs = id ? [await api(`/attributions/${id}`)] : [];
    extras.attributions = runs.length ? runs[0] : null;
    if (!runs.length) {
      return card("Attribution (Pascual et al.)", hint("No attribution run yet: ", el("code", {}, `headcat attribute ${name}`),
        " estimates what each head reads from the input, beside what it attends to."));
    }
    const run = runs[0];
    return card("Attribution (Pascual et al.)",
      el("p", { class: "facts" }, el("span", {}, `run #${run.id}: ${count(run.num_samples, "sample")}, ${run.queries === null ? "every query" : count(run.queries, "query", "queries")}, ${run.scheme === "exact" ? "exact" : count(run.probes, "probe")}`),
        el("span", {}, `${run.passes.toLocaleString()} passes in ${run.seconds.toFixed(0)} s`)),
      el("div", { class: "row" },
        el("figure", {}, layerBars(run.layer_discrepancy), el("figcaption", { class: "muted" }, "mean discrepancy per layer")),
        el("div", { id: "attribution-head" }, hint("Open a head to see its attention rows beside its attribution rows."))),
      hint("Discrepancy: the mean total variation between a head's attention row and its gradient attribution row (0: the same, 1: disjoint)."));
  }

  async function syntaxCard(name) {
    if (!state.paths.has("/models/{name}/syntax")) return null;
    let data;
    try {
      data = await api(`/models/${encodeURIComponent(name)}/syntax?min_count=5`);
    } catch (error) {
      if (error.status !== 404) throw error;
      return card("Syntax heads (Clark et al.)", hint("No syntax run yet: ", el("code", {}, `headcat syntax ${name}`),
        " scores every head on dependency relations (spaCy parses, or --parses gold.conllu)."));
    }
    const relations = data.best.map((b) => b.relation);
    const columns = [];
    for (let l = 0; l < data.layers; l++) for (let h = 0; h < data.heads; h++) columns.push(`L${l} H${h}`);
    const rows = relations.map((r) => data.matrix[r].flat());
    return card("Syntax heads (Clark et al.)",
      el("p", { class: "facts" }, el("span", {}, `run #${data.run.id}: ${data.run.num_sentences} ${data.run.parses} sentences`),
        data.run.parser ? el("span", { class: "muted" }, data.run.parser) : null),
      el("div", { class: "row" },
        el("figure", { class: "syntax-map" },
          labelledMatrix(matrixPlot(rows, relations, columns, { cell: 5, rowHeight: 14, color: SYNTAX_COLOR, title: "accuracy", what: "accuracy", max: 1 }),
            relations, Array.from({ length: data.layers }, (_, l) => ({ label: `L${l}`, span: data.heads })), { cell: 5, rowHeight: 14 }),
          el("figcaption", { class: "muted" }, `relations (rows, ≥ 5 pairs) × heads (layer by layer, ${data.heads} heads each), accuracy of the better direction`)),
        el("table", { class: "compact syntax-best" },
          el("thead", {}, el("tr", {}, ["relation", "pairs", "head", "direction", "accuracy", "baseline"].map((t) => el("th", {}, t)))),
          el("tbody", {}, data.best.map((b) => el("tr", { dataset: { relation: b.relation } },
            el("td", {}, b.relation), el("td", { class: "num" }, b.count),
            el("td", {}, el("a", { href: modelHref(name, [b.layer, b.head]) }, `L${b.layer} H${b.head}`)),
            el("td", { class: "muted" }, b.direction === "dep2head" ? "dep → head" : "head → dep"),
            el("td", { class: "num" }, pct(b.accuracy)),
            el("td", { class: "num muted" }, `${pct(b.baseline)} (${b.baseline_offset > 0 ? "+" : ""}${b.baseline_offset})`)))))));
  }

  async function model(data) {
    extras.name = data.name;
    extras.attributions = null;
    const holder = el("div", { id: "headcat-extras" });
    document.getElementById("app").append(holder);
    let cards;
    try {
      cards = await Promise.all([attributionCard(data.name), syntaxCard(data.name)]);
    } catch (error) {
      holder.replaceChildren(el("div", { class: "error" }, error.message));
      return;
    }
    if (extras.name !== data.name) return; // another model was opened meanwhile
    holder.replaceChildren(...cards.filter(Boolean));
    if (extras.pending) head(data.name, extras.pending);
  }

  async function head(name, selected) {
    const target = document.getElementById("attribution-head");
    extras.pending = selected;
    if (!target || !selected || !extras.attributions || extras.name !== name) return;
    const token = ++extras.token;
    let maps;
    try {
      maps = await api(`/attributions/${extras.attributions.id}/maps?layer=${selected[0]}&head=${selected[1]}`);
    } catch (error) {
      target.replaceChildren(el("div", { class: "error" }, error.message));
      return;
    }
    if (token !== extras.token) return;
    const rows = maps.queries.map((q) => `query ${q}: ${maps.tokens[q] ?? q}`);
    const keys = binLabels(maps.tokens, maps.key_bins);
    const cell = Math.max(4, Math.floor(224 / Math.max(maps.key_bins, 1)));
    target.replaceChildren(
      el("h3", {}, `Layer ${maps.layer}, head ${maps.head}: discrepancy ${fmt(maps.discrepancy, 3)}`),
      el("div", { class: "map-row" },
        el("figure", {}, matrixPlot(maps.attention, rows, keys, { cell, color: ATTENTION_COLOR, title: "attention", what: "attention" }),
          el("figcaption", { class: "muted" }, "attention A[s, ·]")),
        el("figure", {}, matrixPlot(maps.attribution, rows, keys, { cell, color: ATTRIBUTION_COLOR, title: "attribution", what: "attribution" }),
          el("figcaption", { class: "muted" }, "attribution G[s, ·] to the input"))),
      hint(`Rows: ${maps.queries.length} queries of the run's first sample; keys in ${maps.key_bins} bins. Hover for tokens.`));
  }

  window.headcatExtras = { model, head };
})();
