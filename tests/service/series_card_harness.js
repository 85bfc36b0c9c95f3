// The series card rendered under node from the served JSON (tests/service/test_series_web.py): a DOM just large
// enough for plots.js, app.js, detectors.js and series.js (elements with attributes, children, dataset,
// classList and listeners); api() answered from the JSON on stdin; the card rendered, its role switched to
// previous_token, head 1-0 clicked, and what each state shows written as JSON. Run with the static folder as
// the working directory.
const fs = require("fs");
const vm = require("vm");
const input = JSON.parse(fs.readFileSync(0, "utf8"));
class Node {
  constructor(tag) { this.tagName = tag; this.children = []; this.attributes = {}; this.dataset = {}; this.style = {};
    this.listeners = {}; const self = this;
    this.classList = { add: (c) => { self.attributes.class = `${self.attributes.class || ""} ${c}`.trim(); },
                       contains: (c) => (self.attributes.class || "").split(" ").includes(c), toggle() {} }; }
  setAttribute(k, v) { this.attributes[k] = String(v); }
  getAttribute(k) { return k in this.attributes ? this.attributes[k] : null; }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  addEventListener(type, f) { (this.listeners[type] ||= []).push(f); }
  get textContent() { return this.children.map((c) => c.textContent).join(""); }
}
class Text extends Node { constructor(text) { super("#text"); this.text = text; } get textContent() { return this.text; } }
globalThis.Node = Node;
globalThis.document = { createElement: (t) => new Node(t), createElementNS: (ns, t) => new Node(t),
  createTextNode: (t) => new Text(t), getElementById: () => null, querySelectorAll: () => [], body: new Node("body") };
globalThis.window = { addEventListener() {}, innerWidth: 1200, scrollX: 0, scrollY: 0 };
globalThis.location = { hash: "" };
globalThis.sessionStorage = { getItem: () => null, removeItem() {} };
for (const file of ["plots.js", "app.js", "detectors.js", "series.js"]) {
  let code = fs.readFileSync(file, "utf8");
  if (file === "app.js") code = code.replace(/\nstart\(\);\s*$/, "\n");  // no routing: the harness renders the card
  vm.runInThisContext(code, { filename: file });
}
vm.runInThisContext(`
state.palette = ${JSON.stringify(input.palette)};
api = async (path) => {
  if (!(path in ${JSON.stringify(input.responses)})) throw new Error("not served: " + path);
  return ${JSON.stringify(input.responses)}[path];
};
`);
const all = (node, test, out = []) => { if (test(node)) out.push(node); for (const c of node.children || []) all(c, test, out); return out; };
const cls = (node, c) => (node.attributes && (node.attributes.class || "").split(" ").includes(c));
const settle = () => new Promise((resolve) => setTimeout(resolve, 0));
function read(card) {
  const grid = all(card, (n) => n.tagName === "svg" && cls(n, "series-grid"))[0];
  const head = all(card, (n) => n.attributes && n.attributes.id === "series-head")[0];
  return {
    role: grid.dataset.role,
    cells: all(grid, (n) => n.tagName === "rect" && cls(n, "cell")).map((n) => [+n.dataset.layer, +n.dataset.head, n.attributes.fill, cls(n, "selected")]),
    head: { ...head.dataset },
    points: all(head, (n) => n.tagName === "circle" && cls(n, "point")).map((n) => [n.dataset.line, +n.dataset.step, +n.dataset.value]),
    threshold: all(head, (n) => cls(n, "threshold")).length,
    formedMark: all(head, (n) => cls(n, "formed")).map((n) => +n.dataset.step),
    band: all(card, (n) => n.tagName === "rect" && cls(n, "band")).map((n) => [+n.dataset.step, n.dataset.type, +n.dataset.count]),
    notMeasured: all(card, (n) => cls(n, "not-measured")).map((n) => n.dataset.what),
    xTicks: all(card, (n) => cls(n, "x-tick")).map((n) => n.textContent),
    titles: all(card, (n) => cls(n, "axis-title")).map((n) => n.textContent),
    hints: all(card, (n) => n.tagName === "p" && cls(n, "hint")).map((n) => n.textContent),
    text: card.textContent,
  };
}
(async () => {
  const card = await seriesCard(input.model);
  if (!card) { console.log("null"); return; }
  const seen = { first: read(card) };
  const pick = all(card, (n) => n.attributes && n.attributes.id === "series-role")[0];
  pick.value = "previous_token";
  pick.listeners.change[0]();
  await settle();
  seen.previous = read(card);
  const cell = all(card, (n) => n.tagName === "rect" && cls(n, "cell") && n.dataset.layer == 1 && n.dataset.head == 0)[0];
  cell.listeners.click[0]();
  await settle();
  seen.clicked = read(card);
  console.log(JSON.stringify(seen));
})().catch((e) => { console.error(e.stack); process.exit(1); });
