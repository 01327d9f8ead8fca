// How the trial viewer shows a value an episode produced (evaluation details, the fields
// of an observation, tool schemas, chat messages). The way is chosen by the value's shape
// alone: nothing here names an environment, so a built-in's per-test table is simply
// what any plugin's list of per-test records, or map of test name -> status, becomes.
//
// Shapes, tried in this order:
//   a scalar (string, number, boolean, null)   text; a long or multi-line string folds
//   a list of tool schemas (OpenAI's {type: "function", function: {...}}, or {name,
//     parameters | input_schema | inputSchema})  name, description, and a table of the
//                                                parameters: name, type, required
//   a list of chat messages ({role, content})  one block per message
//   a map of name -> status ("passed", ...)     a table of name and status
//   a list of records (objects)                a table, one row per record; with a status
//                                                column: name, status and what failed
//   a list of scalars                          inline when short, else a numbered list
//   an object                                  a key/value table of its short values (a
//                                                small flat object as a nested table), then
//                                                its long or structured values as labelled
//                                                blocks, each shown by these same rules
//
// Every string is put on the page as text (dom.js): a value is untrusted.

import { asText, el, fold } from "./dom.js";

const MAX_DEPTH = 8; // deeper than this, the rest is shown as folded JSON
const INLINE_CHARS = 120; // a longer string, or one of several lines, is a block
const REPEAT_MIN_CHARS = 16; // shorter text may be in an output by chance: shown anyway

// What a status word means, for its colour: a test's status as a test runner writes it.
const STATUS = new Map(
  [
    ["passed", ["passed", "pass", "ok", "success", "succeeded", "xpassed"]],
    ["failed", ["failed", "fail", "failure", "wrong", "incorrect"]],
    ["error", ["error", "errored", "timeout", "timed_out", "crashed"]],
    ["other", ["skipped", "skip", "xfail", "xfailed", "pending", "running"]],
  ].flatMap(([kind, words]) => words.map((w) => [w, kind]))
);
const EXPECTED_KEYS = ["expected", "want"];
const GOT_KEYS = ["got", "actual", "given", "received", "observed"];

export function isPlainObject(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function isScalar(v) {
  return v === null || ["string", "number", "boolean"].includes(typeof v);
}

function isShortText(v) {
  return typeof v === "string" && v.length <= INLINE_CHARS && !v.includes("\n");
}

export function statusKind(v) {
  return typeof v === "string" ? STATUS.get(v.trim().toLowerCase()) || null : null;
}

export function badge(status) {
  return el("span", { class: `badge ${statusKind(status) || "other"}` }, status);
}

// -- the way in ------------------------------------------------------------------------

export function renderValue(v, depth = 0) {
  if (isScalar(v)) return scalarBlock(v);
  if (depth > MAX_DEPTH) return fold(v);
  if (Array.isArray(v)) {
    if (v.length === 0) return el("span", { class: "muted" }, "none (an empty list)");
    if (v.every(toolOf)) return toolList(v);
    if (isMessageList(v)) return messageList(v);
    if (v.every(isPlainObject)) return recordTable(v, depth);
    if (v.every(isScalar)) return scalarList(v);
    return el("ol", { class: "items" }, v.map((x) => el("li", {}, renderValue(x, depth + 1))));
  }
  if (isPlainObject(v)) {
    const entries = Object.entries(v);
    if (entries.length === 0) return el("span", { class: "muted" }, "none (an empty object)");
    if (entries.every(([, s]) => statusKind(s))) {
      return recordTable(entries.map(([name, status]) => ({ name, status })), depth);
    }
    return objectView(entries, depth);
  }
  return fold(v);
}

// A scalar where a whole block is wanted.
function scalarBlock(v) {
  if (typeof v === "string" && !isShortText(v)) return fold(v);
  return el("div", { class: "scalar" }, inline(v));
}

// A scalar in a table cell or a line of text.
function inline(v) {
  if (v === null) return el("span", { class: "muted" }, "null");
  if (v === "") return el("span", { class: "muted" }, "(empty)");
  if (statusKind(v)) return badge(v);
  if (typeof v === "string" && !isShortText(v)) return fold(v);
  return el("span", { class: `value ${typeof v}` }, String(v));
}

function scalarList(items) {
  const text = items.map((x) => (typeof x === "string" ? x : JSON.stringify(x))).join(", ");
  if (isShortText(text)) return el("span", { class: "value list" }, text);
  return el("ol", { class: "items" }, items.map((x) => el("li", {}, inline(x))));
}

// -- objects ---------------------------------------------------------------------------

function fitsInRow(v) {
  if (isScalar(v)) return typeof v !== "string" || isShortText(v);
  if (Array.isArray(v)) return v.length === 0 || (v.every(isScalar) && isShortText(v.map(String).join(", ")));
  if (isPlainObject(v)) {
    const entries = Object.entries(v);
    if (entries.length && entries.every(([, s]) => statusKind(s))) return false; // a table of its own
    return entries.length <= 8 && entries.every(([, x]) => isScalar(x) && (typeof x !== "string" || isShortText(x)));
  }
  return false;
}

export function kvTable(rows, attrs) {
  if (!rows.length) return null;
  return el("table", { class: "kv", ...attrs }, el("tbody", {}, rows.map(([k, v]) => el("tr", { "data-key": k }, el("th", {}, k), el("td", {}, v)))));
}

function objectView(entries, depth) {
  const rows = [];
  const blocks = [];
  for (const [k, v] of entries) {
    if (!fitsInRow(v)) blocks.push(labelled(k, renderValue(v, depth + 1)));
    else if (isPlainObject(v)) rows.push([k, Object.keys(v).length ? objectView(Object.entries(v), depth + 1) : inline("")]);
    else if (Array.isArray(v)) rows.push([k, v.length ? scalarList(v) : el("span", { class: "muted" }, "none")]);
    else rows.push([k, inline(v)]);
  }
  return el("div", { class: "object" }, kvTable(rows), blocks);
}

export function labelled(name, content) {
  return el("div", { class: "field", "data-key": name }, el("div", { class: "field-name" }, name), content);
}

// -- tables of records -----------------------------------------------------------------

function recordTable(records, depth) {
  const keys = [...new Set(records.flatMap((r) => Object.keys(r)))];
  const has = (k) => records.filter((r) => r[k] !== undefined && r[k] !== null);
  const statusKey = keys.find((k) => has(k).length && has(k).every((r) => statusKind(r[k])));
  if (!statusKey) {
    return el(
      "table",
      { class: "records", "data-kind": "records" },
      el("thead", {}, el("tr", {}, keys.map((k) => el("th", {}, k)))),
      el("tbody", {}, records.map((r) => el("tr", {}, keys.map((k) => el("td", {}, cell(r[k], depth))))))
    );
  }
  // The record's name: its first text column other than the status.
  const nameKey = keys.find((k) => k !== statusKey && has(k).length === records.length && records.every((r) => isScalar(r[k])));
  const rows = records.map((r, i) => ({ r, name: nameKey ? r[nameKey] : i + 1, detail: whatHappened(r, nameKey, statusKey, depth) }));
  const anyDetail = rows.some((row) => row.detail);
  return el(
    "table",
    { class: "records tests", "data-kind": "tests" },
    el("thead", {}, el("tr", {}, el("th", {}, nameKey || "#"), el("th", {}, statusKey), anyDetail ? el("th", {}, "detail") : null)),
    el(
      "tbody",
      {},
      rows.map(({ r, name, detail }) =>
        el(
          "tr",
          { "data-status": statusKind(r[statusKey]) || "", "data-name": String(name) },
          el("td", { class: "name" }, typeof name === "string" && !isShortText(name) ? fold(name, "code") : el("code", {}, String(name))),
          el("td", { class: "status" }, r[statusKey] === undefined || r[statusKey] === null ? "" : badge(r[statusKey])),
          anyDetail ? el("td", { class: "detail" }, detail) : null
        )
      )
    )
  );
}

function cell(v, depth) {
  if (v === undefined) return "";
  return isScalar(v) ? inline(v) : renderValue(v, depth + 1);
}

// What a record says beyond its name and status; for a failure that says nothing more,
// what can be read from its name: the expression of an `assert`.
function whatHappened(record, nameKey, statusKey, depth) {
  const rest = Object.entries(record).filter(([k, v]) => k !== nameKey && k !== statusKey && v !== null && v !== undefined && v !== "");
  const expected = rest.find(([k]) => EXPECTED_KEYS.includes(k.toLowerCase()));
  const got = rest.find(([k]) => GOT_KEYS.includes(k.toLowerCase()));
  const parts = [];
  if (expected && got) {
    parts.push(el("div", { class: "expected-got" }, `${expected[0]} `, el("code", {}, asText(expected[1])), `, ${got[0]} `, el("code", {}, asText(got[1]))));
  }
  const others = rest.filter((e) => !(expected && got && (e === expected || e === got)));
  if (others.length === 1 && typeof others[0][1] === "string") parts.push(scalarBlock(others[0][1]));
  else if (others.length) parts.push(objectView(others, depth + 1));
  const failed = ["failed", "error"].includes(statusKind(record[statusKey]));
  if (!parts.length && failed && nameKey) {
    const assertion = assertionOf(record[nameKey]);
    if (assertion) parts.push(el("div", { class: "assertion" }, "assertion failed: ", el("code", {}, assertion.expr), " is false", assertion.message ? ` (${assertion.message})` : ""));
  }
  return parts.length ? parts : null;
}

// `assert EXPR[, MESSAGE]` split at its first comma outside brackets and quotes.
export function assertionOf(text) {
  const m = typeof text === "string" ? /^\s*assert\s+([\s\S]+?)\s*$/.exec(text) : null;
  if (!m) return null;
  const src = m[1];
  let depth = 0;
  let quote = null;
  for (let i = 0; i < src.length; i++) {
    const c = src[i];
    if (quote) {
      if (c === "\\") i++;
      else if (c === quote) quote = null;
    } else if (c === '"' || c === "'") quote = c;
    else if ("([{".includes(c)) depth++;
    else if (")]}".includes(c)) depth--;
    else if (c === "," && depth === 0) return { expr: src.slice(0, i).trim(), message: src.slice(i + 1).trim() };
  }
  return { expr: src, message: "" };
}

// -- tools -----------------------------------------------------------------------------

// A tool schema's parts, or null when the value is not one.
function toolOf(item) {
  if (!isPlainObject(item)) return null;
  const wrapped = item.type === "function" && isPlainObject(item.function);
  const f = wrapped ? item.function : item;
  const schema = f.parameters ?? f.input_schema ?? f.inputSchema;
  if (typeof f.name !== "string" || (!wrapped && !isPlainObject(schema))) return null;
  return { name: f.name, description: typeof f.description === "string" ? f.description : "", schema: isPlainObject(schema) ? schema : null };
}

function toolList(items) {
  return el(
    "ul",
    { class: "tools", "data-testid": "tools" },
    items.map(toolOf).map((t) =>
      el(
        "li",
        { class: "tool-schema", "data-tool": t.name },
        el("div", {}, el("code", { class: "tool-name" }, t.name), t.description ? el("span", { class: "tool-description" }, ` ${t.description}`) : null),
        paramTable(t.schema, 0)
      )
    )
  );
}

function paramTable(schema, depth) {
  const props = schema && isPlainObject(schema.properties) ? Object.entries(schema.properties) : [];
  if (!props.length) return el("div", { class: "muted" }, "no parameters");
  const required = new Set(Array.isArray(schema.required) ? schema.required : []);
  const described = props.some(([, p]) => isPlainObject(p) && (typeof p.description === "string" || p.default !== undefined || isPlainObject(p.properties)));
  return el(
    "table",
    { class: "params" },
    el("thead", {}, el("tr", {}, ["parameter", "type", "required"].concat(described ? ["description"] : []).map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      props.map(([name, p]) =>
        el(
          "tr",
          { "data-param": name },
          el("td", {}, el("code", {}, name)),
          el("td", { class: "type" }, typeOf(p)),
          el("td", {}, required.has(name) ? "required" : el("span", { class: "muted" }, "optional")),
          described ? paramDescription(p, depth) : null
        )
      )
    )
  );
}

function paramDescription(p, depth) {
  if (!isPlainObject(p)) return el("td", {});
  return el(
    "td",
    {},
    typeof p.description === "string" ? p.description : "",
    p.default !== undefined ? el("span", { class: "muted" }, ` (default ${JSON.stringify(p.default)})`) : null,
    isPlainObject(p.properties) && depth < MAX_DEPTH ? paramTable(p, depth + 1) : null
  );
}

function typeOf(p, depth = 0) {
  if (!isPlainObject(p) || depth > MAX_DEPTH) return "any";
  if (Array.isArray(p.enum)) return "one of " + p.enum.map((x) => JSON.stringify(x)).join(", ");
  if (p.const !== undefined) return JSON.stringify(p.const);
  let t = Array.isArray(p.type) ? p.type.join(" or ") : typeof p.type === "string" ? p.type : "";
  const alternatives = p.anyOf || p.oneOf;
  if (!t && Array.isArray(alternatives)) t = alternatives.map((a) => typeOf(a, depth + 1)).join(" or ");
  if (!t && typeof p.$ref === "string") t = p.$ref.split("/").pop();
  if (t === "array" && isPlainObject(p.items)) t = `array of ${typeOf(p.items, depth + 1)}`;
  return t || "any";
}

// -- chat messages ---------------------------------------------------------------------

export function isMessageList(v) {
  return Array.isArray(v) && v.length > 0 && v.every((m) => isPlainObject(m) && typeof m.role === "string" && ("content" in m || "tool_calls" in m));
}

export function messageList(messages, testid) {
  return el(
    "ol",
    { class: "conversation", "data-testid": testid },
    messages.map((m) =>
      el(
        "li",
        { class: `message role-${m.role}` },
        el("div", { class: "message-role" }, m.role, m.name ? ` (${m.name})` : "", m.tool_call_id ? ` · ${m.tool_call_id}` : ""),
        messageContent(m.content),
        (Array.isArray(m.tool_calls) ? m.tool_calls : []).map((c) =>
          el("div", { class: "tool-call" }, el("code", {}, (c && c.function && c.function.name) || (c && c.type) || "call"), fold((c && c.function && c.function.arguments) || c, "code"))
        )
      )
    )
  );
}

function messageContent(content) {
  if (content === null || content === undefined || content === "") return null;
  if (typeof content === "string") return fold(content);
  if (Array.isArray(content)) return content.map((part) => (isPlainObject(part) && typeof part.text === "string" ? fold(part.text) : renderValue(part, 1)));
  return renderValue(content, 1);
}

// -- repeated text ---------------------------------------------------------------------

// Whether a value only repeats text already on screen (``shown``): a field of an
// observation that holds the same traceback as its main output, or chat messages that
// are the prompt's parts again. Short text is never counted as repeated.
export function repeats(v, shown) {
  if (typeof v === "string") {
    const t = v.trim();
    return (t.length >= REPEAT_MIN_CHARS || t.includes("\n")) && shown.some((s) => s.includes(t));
  }
  if (isMessageList(v)) {
    const texts = v.filter((m) => m.content !== null && m.content !== undefined && m.content !== "");
    return texts.length > 0 && v.every((m) => !m.tool_calls) && texts.every((m) => repeats(m.content, shown));
  }
  return false;
}
