// Building the page from data, never from HTML: every string that came from the API goes
// in as a text node or an attribute value (setAttribute), so markup an episode wrote is
// shown as the characters it is made of. Also the formats and links every page uses.

const FOLD_LINES = 30;
const FOLD_CHARS = 3000;

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

export function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "onclick" || name === "onchange") node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
}

export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

// -- formats ---------------------------------------------------------------------------

export function fmtTime(t) {
  if (t === null || t === undefined) return "";
  return new Date(t * 1000).toLocaleString();
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

export function fmtReward(r) {
  return r === null || r === undefined ? "" : Number(r).toFixed(3).replace(/\.?0+$/, "") || "0";
}

export function asText(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

// A block of text that folds when long: the first lines, and a button for the rest.
export function fold(value, cls) {
  const text = asText(value);
  const lines = text.split("\n");
  const long = lines.length > FOLD_LINES || text.length > FOLD_CHARS;
  const short = long ? lines.slice(0, FOLD_LINES).join("\n").slice(0, FOLD_CHARS) : text;
  const pre = el("pre", { class: cls || "text" }, short);
  if (!long) return pre;
  let open = false;
  const button = el("button", { type: "button", class: "link fold-toggle" });
  const label = () => (button.textContent = open ? "fold" : `show all ${lines.length} lines (${text.length} characters)`);
  label();
  button.addEventListener("click", () => {
    open = !open;
    pre.textContent = open ? text : short;
    label();
  });
  return el("div", { class: "fold", "data-folded": "true" }, pre, button);
}

// -- links -----------------------------------------------------------------------------

export function episodeHref(trial, id) {
  return `#/trials/${encodeURIComponent(trial)}/${encodeURIComponent(id)}`;
}

export function trialHref(trial, filters) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(filters || {})) if (v) q.set(k, v);
  const query = q.toString();
  return `#/trials/${encodeURIComponent(trial)}${query ? "?" + query : ""}`;
}
