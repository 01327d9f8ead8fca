// envhub's dashboard and trial viewer. Plain JavaScript, no build step, nothing loaded
// from elsewhere. Every piece of text that comes from the API (observations, actions,
// program output, errors, names) is put on the page with textContent or as an
// attribute value, never parsed as HTML: an episode's output is untrusted.
"use strict";

const KEY = "envhub.apiKey";
const POLL_MS = 2000;
const FOLD_LINES = 30;
const FOLD_CHARS = 3000;
const OUTCOMES = ["live", "error", "unscored", "passed", "failed"];

let role = null;
let timer = null; // the pending poll of the view on screen
let generation = 0; // bumped on every navigation: a stale poll draws nothing

// -- elements -------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function svg(tag, attrs, ...children) {
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

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

// -- formatting -----------------------------------------------------------------------

function fmtTime(t) {
  if (t === null || t === undefined) return "";
  return new Date(t * 1000).toLocaleString();
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

function fmtReward(r) {
  return r === null || r === undefined ? "" : Number(r).toFixed(3).replace(/\.?0+$/, "") || "0";
}

function asText(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

// A block of text that folds when long: the first lines, and a button for the rest.
function fold(value, cls) {
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

function episodeHref(trial, id) {
  return `#/trials/${encodeURIComponent(trial)}/${encodeURIComponent(id)}`;
}

function trialHref(trial, filters) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(filters || {})) if (v) q.set(k, v);
  const query = q.toString();
  return `#/trials/${encodeURIComponent(trial)}${query ? "?" + query : ""}`;
}

// -- the API --------------------------------------------------------------------------

class NeedsKey extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) headers["X-API-Key"] = key;
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    throw new NeedsKey(body.error || `HTTP ${response.status}`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.error) || `HTTP ${response.status}`);
  return body;
}

function askForKey(reason) {
  const form = document.getElementById("key-form");
  document.getElementById("key-reason").textContent =
    `${reason}. Enter an API key; it is kept in this browser tab only (sessionStorage).`;
  form.hidden = false;
  document.getElementById("key-input").focus();
}

function setStatus(text, bad) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("bad", !!bad);
}

// -- routing --------------------------------------------------------------------------

function parseHash() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(query || "") };
}

async function route() {
  clearTimeout(timer);
  const mine = ++generation;
  const { parts, params } = parseHash();
  for (const a of document.querySelectorAll("header nav a")) {
    a.classList.toggle("active", a.dataset.nav === (parts[0] === "trials" ? "trials" : "dashboard"));
  }
  // What a drawing of this page may draw into: nothing, once the page has changed.
  const view = { mine };
  let draw;
  if (parts[0] === "trials" && parts.length === 1) draw = () => drawTrials(view);
  else if (parts[0] === "trials" && parts.length === 2) draw = () => drawTrial(view, parts[1], params);
  else if (parts[0] === "trials" && parts.length >= 3) draw = () => drawEpisode(view, parts[1], parts[2]);
  else draw = () => (role === "scheduler" ? drawFleet(view) : drawNode(view));
  await run(draw, mine);
}

// Draw the view, then again while it is on screen and asks for it: every POLL_MS, or ten
// times as long as the last drawing took (a summary of a very large trial costs its node
// real work; a page left open must not cost it more than a tenth of its time).
async function run(draw, mine) {
  let again = false;
  const began = performance.now();
  try {
    again = await draw();
    if (mine !== generation) return;
    document.getElementById("key-form").hidden = true;
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if (mine !== generation) return;
    if (e instanceof NeedsKey) {
      askForKey(e.message);
      setStatus("needs an API key", true);
      return;
    }
    setStatus(`error: ${e.message}`, true);
    again = true;
  }
  const wait = Math.max(POLL_MS, 10 * (performance.now() - began));
  if (again && mine === generation) timer = setTimeout(() => run(draw, mine), wait);
}

// Replace the view's content in one go, so a poll never shows a half-drawn page; unless
// the person went elsewhere meanwhile, when a slow answer for the page they left must not
// draw over the one they are on.
function show(frame, ...children) {
  if (frame.mine !== generation) return;
  const view = document.getElementById("view");
  const scroll = window.scrollY;
  clear(view);
  append(view, children);
  window.scrollTo(0, scroll);
}

// -- the node's dashboard -------------------------------------------------------------

function card(label, value, testid) {
  return el("div", { class: "card" }, el("div", { class: "value", "data-testid": testid }, value), el("div", { class: "label" }, label));
}

function slotBar(used, capacity) {
  const pct = capacity ? Math.min(100, (100 * used) / capacity) : 0;
  const bar = el("div", { class: "bar-fill" + (pct >= 100 ? " full" : "") });
  bar.style.width = `${pct}%`; // a CSSOM property, which the CSP allows (no inline style attribute)
  return el("div", { class: "bar", title: `${used} of ${capacity} slots` }, bar);
}

async function drawNode(view) {
  const d = await api("/dashboard");
  const s = d.slots;
  const envs = [...new Set(d.instances.map((i) => i.environment))].sort();
  const states = ["creating", "active", "done", "released", "expired", "failed", "lost"].filter((st) =>
    d.instances.some((i) => i.state === st)
  );
  const count = (env, st) => (d.instances.find((i) => i.environment === env && i.state === st) || {}).count || 0;
  show(
    view,
    el("h1", {}, "Node ", el("span", { class: "muted", "data-testid": "node-id" }, d.node_id || "")),
    d.accepting ? null : el("p", { class: "warn" }, "This node is stopping and takes no new instances."),
    el(
      "section",
      { class: "cards" },
      card("capacity", s.capacity, "slots-capacity"),
      card("active", s.active, "slots-active"),
      card("free", s.free, "slots-free"),
      card("queued", s.queued, "slots-queued"),
      card("warm pool", s.pooled, "slots-pooled"),
      card("rollouts", s.rollouts, "slots-rollouts")
    ),
    slotBar(s.active, s.capacity),
    el("h2", {}, "Instances by environment and state"),
    el("p", { class: "muted" }, `live now, and ended since the node started (${fmtTime(d.started_at)})`),
    envs.length === 0
      ? el("p", { class: "muted" }, "No instance yet.")
      : el(
          "table",
          { "data-testid": "instances-table" },
          el("thead", {}, el("tr", {}, el("th", {}, "environment"), states.map((st) => el("th", {}, st)))),
          el(
            "tbody",
            {},
            envs.map((env) =>
              el(
                "tr",
                {},
                el("td", {}, env),
                states.map((st) => el("td", { class: "num", "data-testid": `count-${env}-${st}` }, count(env, st)))
              )
            )
          )
        ),
    d.pools.length
      ? [
          el("h2", {}, "Warm pools"),
          el(
            "table",
            {},
            el("thead", {}, el("tr", {}, ["environment", "task", "idle", "starting", "size"].map((h) => el("th", {}, h)))),
            el(
              "tbody",
              {},
              d.pools.map((p) =>
                el("tr", {}, el("td", {}, p.environment), el("td", {}, p.task_id), el("td", { class: "num" }, p.idle), el("td", { class: "num" }, p.starting), el("td", { class: "num" }, p.size))
              )
            )
          ),
        ]
      : null,
    el("h2", {}, "Recent episodes"),
    episodeTable(d.recent, { trialColumn: true, testid: "recent-table" })
  );
  return true;
}

function episodeTable(episodes, { trialColumn, nodeColumn, testid }) {
  if (!episodes.length) return el("p", { class: "muted" }, "No episode.");
  const head = ["created", "instance"]
    .concat(trialColumn ? ["trial"] : [])
    .concat(nodeColumn ? ["node"] : [])
    .concat(["environment", "task", "state", "outcome", "reward", "steps", "duration", "error"]);
  return el(
    "table",
    { class: "episodes", "data-testid": testid },
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      episodes.map((e) =>
        el(
          "tr",
          { "data-instance": e.instance_id, class: `outcome-${e.outcome}` },
          el("td", {}, fmtTime(e.created_at)),
          el("td", {}, el("a", { href: episodeHref(e.trial, e.instance_id) }, e.instance_id)),
          trialColumn ? el("td", {}, el("a", { href: trialHref(e.trial) }, e.trial)) : null,
          nodeColumn ? el("td", {}, e.node || "") : null,
          el("td", {}, e.environment),
          el("td", {}, e.task_id),
          el("td", {}, e.state),
          el("td", {}, el("span", { class: `badge ${e.outcome}` }, e.outcome)),
          el("td", { class: "num" }, fmtReward(e.reward)),
          el("td", { class: "num" }, e.step_count),
          el("td", { class: "num" }, fmtSeconds(e.duration_s)),
          el("td", { class: "error", title: e.error || "" }, e.error ? e.error.slice(0, 120) : "")
        )
      )
    )
  );
}

// -- the scheduler's dashboard --------------------------------------------------------

async function drawFleet(view) {
  const d = await api("/dashboard");
  const h = d.health;
  show(
    view,
    el("h1", {}, "Scheduler"),
    el(
      "section",
      { class: "cards" },
      card("nodes", h.nodes, "fleet-nodes"),
      card("healthy", h.healthy_nodes, "fleet-healthy"),
      card("slots (healthy nodes)", h.total_slots, "fleet-slots"),
      card("in use", h.active_slots, "fleet-active")
    ),
    slotBar(h.active_slots, h.total_slots),
    el("h2", {}, "Nodes"),
    el(
      "table",
      { "data-testid": "nodes-table" },
      el(
        "thead",
        {},
        el("tr", {}, ["node", "health", "load", "used / slots", "free ratio", "queued", "warm pool", "rollouts", "last seen", "environments"].map((x) => el("th", {}, x)))
      ),
      el(
        "tbody",
        {},
        d.nodes.map((n) =>
          el(
            "tr",
            { "data-node": n.name, class: n.healthy ? "" : "down" },
            el("td", {}, el("div", {}, n.name), n.name !== n.url ? el("div", { class: "muted" }, n.url) : null, n.node_id ? el("div", { class: "muted" }, n.node_id) : null),
            el("td", {}, el("span", { class: `badge ${n.healthy ? "passed" : "error"}`, "data-testid": "node-health" }, n.healthy ? "up" : "down"), n.error ? el("div", { class: "error" }, n.error) : null),
            el("td", {}, slotBar(n.active_slots, n.total_slots)),
            el("td", { class: "num", "data-testid": "node-load" }, `${n.active_slots} / ${n.total_slots}`),
            el("td", { class: "num" }, n.free_ratio),
            el("td", { class: "num" }, n.queued ?? ""),
            el("td", { class: "num" }, n.pooled ?? ""),
            el("td", { class: "num" }, n.rollouts ?? ""),
            el("td", { class: "num" }, n.last_seen_s === null ? "never" : fmtSeconds(n.last_seen_s) + " ago"),
            el("td", {}, (n.environments || []).join(", "))
          )
        )
      )
    )
  );
  return true;
}

// -- trials ---------------------------------------------------------------------------

function unreachable(list) {
  return list && list.length ? el("p", { class: "warn" }, `Not answering, so left out: ${list.join(", ")}`) : null;
}

async function drawTrials(view) {
  const d = await api("/trials");
  show(
    view,
    el("h1", {}, "Trials"),
    unreachable(d.unreachable),
    d.trials.length === 0
      ? el("p", { class: "muted" }, "No trial yet.")
      : el(
          "table",
          { "data-testid": "trials-table" },
          el("thead", {}, el("tr", {}, ["trial", "episodes", "first", "newest"].concat(role === "scheduler" ? ["nodes"] : []).map((x) => el("th", {}, x)))),
          el(
            "tbody",
            {},
            d.trials
              .slice()
              .reverse()
              .map((t) =>
                el(
                  "tr",
                  {},
                  el("td", {}, el("a", { href: trialHref(t.name) }, t.name)),
                  el("td", { class: "num" }, t.instances),
                  el("td", {}, fmtTime(t.created_at)),
                  el("td", {}, fmtTime(t.last_created_at)),
                  role === "scheduler" ? el("td", {}, (t.nodes || []).join(", ")) : null
                )
              )
          )
        )
  );
  return false; // a list of trials changes slowly: drawn again on navigation
}

// The reward histogram as an SVG bar chart: one bar per tenth of [0, 1].
function rewardPlot(rewards) {
  const bins = rewards.bins || [];
  const W = 420, H = 170, left = 34, bottom = 26, top = 12;
  const plotW = W - left - 8, plotH = H - bottom - top;
  const max = Math.max(1, ...bins);
  const bw = plotW / Math.max(1, bins.length);
  const chart = svg("svg", {
    viewBox: `0 0 ${W} ${H}`,
    width: W,
    height: H,
    class: "plot",
    role: "img",
    "data-testid": "reward-plot",
    "aria-label": `reward distribution of ${rewards.scored} scored episodes`,
  });
  chart.append(svg("line", { x1: left, y1: top + plotH, x2: left + plotW, y2: top + plotH, class: "axis" }));
  chart.append(svg("line", { x1: left, y1: top, x2: left, y2: top + plotH, class: "axis" }));
  chart.append(svg("text", { x: left - 4, y: top + 4, class: "tick", "text-anchor": "end" }, String(max)));
  chart.append(svg("text", { x: left - 4, y: top + plotH, class: "tick", "text-anchor": "end" }, "0"));
  bins.forEach((n, i) => {
    const h = (plotH * n) / max;
    const lo = (i / bins.length).toFixed(1);
    const hi = ((i + 1) / bins.length).toFixed(1);
    chart.append(
      svg(
        "rect",
        { x: left + i * bw + 2, y: top + plotH - h, width: bw - 4, height: h, class: "bar-rect", "data-count": n, "data-bin": i },
        svg("title", {}, `reward ${lo}-${hi}${i === bins.length - 1 ? " (incl. 1.0)" : ""}: ${n}`)
      )
    );
    if (n) chart.append(svg("text", { x: left + i * bw + bw / 2, y: top + plotH - h - 2, class: "tick", "text-anchor": "middle" }, String(n)));
  });
  for (let i = 0; i <= bins.length; i += 2) {
    chart.append(svg("text", { x: left + i * bw, y: H - 8, class: "tick", "text-anchor": "middle" }, (i / bins.length).toFixed(1)));
  }
  return chart;
}

async function drawTrial(view, trial, params) {
  const filters = { task: params.get("task") || "", outcome: params.get("outcome") || "" };
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v) query.set(k, v);
  const limit = Number(params.get("limit") || 100);
  const [summary, page] = await Promise.all([
    api(`/trials/${encodeURIComponent(trial)}?${query}`),
    api(`/trials/${encodeURIComponent(trial)}/episodes?${query}&limit=${limit}`),
  ]);
  // The task list comes unfiltered by task, so that another task can be picked.
  const all = filters.task ? await api(`/trials/${encodeURIComponent(trial)}?${new URLSearchParams(filters.outcome ? { outcome: filters.outcome } : {})}`) : summary;
  const go = (change) => (location.hash = trialHref(trial, { ...filters, ...change }));
  const taskSelect = el(
    "select",
    { id: "task-filter", "data-testid": "task-filter", onchange: (e) => go({ task: e.target.value }) },
    el("option", { value: "" }, `all tasks (${all.tasks.length})`),
    all.tasks.map((t) => el("option", { value: t.task_id, selected: t.task_id === filters.task }, `${t.task_id} (${t.episodes})`))
  );
  const outcomeSelect = el(
    "select",
    { id: "outcome-filter", "data-testid": "outcome-filter", onchange: (e) => go({ outcome: e.target.value }) },
    el("option", { value: "" }, "all outcomes"),
    OUTCOMES.map((o) => el("option", { value: o, selected: o === filters.outcome }, o))
  );
  const mean = summary.rewards.mean;
  show(
    view,
    el("p", { class: "crumbs" }, el("a", { href: "#/trials" }, "Trials"), " / ", el("span", {}, trial)),
    el("h1", {}, "Trial ", el("span", { "data-testid": "trial-name" }, trial)),
    unreachable(summary.unreachable),
    el("div", { class: "filters" }, el("label", {}, "Task ", taskSelect), el("label", {}, "Outcome ", outcomeSelect)),
    el(
      "div",
      { class: "summary" },
      el(
        "div",
        {},
        el("h2", {}, "Reward distribution"),
        rewardPlot(summary.rewards),
        el("p", { class: "muted", "data-testid": "reward-summary" }, `${summary.rewards.scored} scored` + (mean === null || mean === undefined ? "" : `, mean ${fmtReward(mean)}`))
      ),
      el(
        "div",
        {},
        el("h2", {}, "Outcomes"),
        el(
          "table",
          { "data-testid": "outcomes-table" },
          el("tbody", {}, OUTCOMES.map((o) => el("tr", {}, el("td", {}, el("a", { href: trialHref(trial, { ...filters, outcome: o }) }, el("span", { class: `badge ${o}` }, o))), el("td", { class: "num", "data-testid": `outcome-${o}` }, summary.outcomes[o] || 0))))
        )
      )
    ),
    el("h2", {}, `Episodes (${page.total})`),
    episodeTable(page.episodes, { nodeColumn: role === "scheduler", testid: "episodes-table" }),
    page.total > page.episodes.length
      ? el("button", { type: "button", onclick: () => (location.hash = trialHref(trial, { ...filters, limit: String(Math.min(1000, limit * 2)) })) }, `show more (${page.episodes.length} of ${page.total})`)
      : null
  );
  return summary.outcomes.live > 0; // follows the trial while it has live episodes
}

// -- one episode ----------------------------------------------------------------------

function kv(rows) {
  return el(
    "table",
    { class: "kv" },
    el("tbody", {}, rows.filter(([, v]) => v !== null && v !== undefined && v !== "").map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v instanceof Node ? v : String(v)))))
  );
}

function observationBlock(observation) {
  if (observation === null || observation === undefined) return el("p", { class: "muted" }, "none");
  if (typeof observation !== "object") return fold(observation);
  const main = observation.content !== undefined ? "content" : null;
  return el(
    "div",
    { class: "observation" },
    main ? fold(observation.content, "text output") : null,
    Object.entries(observation)
      .filter(([k, v]) => k !== main && v !== null && v !== false && v !== "")
      .map(([k, v]) => el("div", { class: "field" }, el("div", { class: "field-name" }, k), fold(v)))
  );
}

function actionBlock(action) {
  if (!action) return null;
  const args = action.arguments || {};
  return el(
    "div",
    { class: "action" },
    el("div", { class: "tool" }, el("span", { class: "muted" }, "tool "), el("code", {}, action.tool)),
    Object.entries(args).map(([k, v]) => el("div", { class: "field" }, el("div", { class: "field-name" }, k), fold(v, typeof v === "string" ? "code" : "text")))
  );
}

function evaluationBlock(event) {
  const details = event.details;
  const parts = [el("div", {}, "reward ", el("strong", { "data-testid": "evaluation-reward" }, fmtReward(event.reward)))];
  if (typeof details === "string") {
    parts.push(el("p", { class: "muted", "data-testid": "evaluation-hidden" }, `Per-test details are ${details}.`));
  } else if (details && Array.isArray(details.tests)) {
    const rest = Object.fromEntries(Object.entries(details).filter(([k]) => k !== "tests"));
    parts.push(kv(Object.entries(rest).map(([k, v]) => [k, typeof v === "object" ? asText(v) : v])));
    parts.push(
      el(
        "table",
        { class: "tests", "data-testid": "evaluation-tests" },
        el("thead", {}, el("tr", {}, el("th", {}, "test"), el("th", {}, "status"), el("th", {}, "detail"))),
        el(
          "tbody",
          {},
          details.tests.map((t, i) => {
            const test = typeof t === "object" && t !== null ? t : { test: i, status: t };
            const extra = Object.fromEntries(Object.entries(test).filter(([k]) => k !== "test" && k !== "status"));
            return el(
              "tr",
              {},
              el("td", {}, fold(test.test ?? test.name ?? String(i), "code")),
              el("td", {}, el("span", { class: `badge ${test.status === "passed" ? "passed" : "failed"}` }, test.status)),
              el("td", {}, Object.keys(extra).length ? fold(Object.keys(extra).length === 1 && extra.error ? extra.error : extra) : "")
            );
          })
        )
      )
    );
  } else if (details && typeof details.tests === "object") {
    parts.push(kv(Object.entries(details.tests).map(([k, v]) => [k, v])));
    const rest = Object.fromEntries(Object.entries(details).filter(([k]) => k !== "tests"));
    if (Object.keys(rest).length) parts.push(fold(rest));
  } else if (details !== undefined) {
    parts.push(fold(details));
  }
  return el("div", { class: "evaluation" }, parts);
}

function conversationBlock(conversation) {
  const messages = (conversation && conversation.messages) || [];
  if (!messages.length) return null;
  return [
    el("h2", {}, `Conversation with the model (${messages.length} messages)`),
    el(
      "ol",
      { class: "conversation", "data-testid": "conversation" },
      messages.map((m) =>
        el(
          "li",
          { class: `message role-${m.role}` },
          el("div", { class: "message-role" }, m.role, m.name ? ` (${m.name})` : "", m.tool_call_id ? ` · ${m.tool_call_id}` : ""),
          m.content !== null && m.content !== undefined && m.content !== "" ? fold(m.content) : null,
          (m.tool_calls || []).map((c) =>
            el("div", { class: "tool-call" }, el("code", {}, (c.function && c.function.name) || c.type || "call"), fold((c.function && c.function.arguments) || c, "code"))
          )
        )
      )
    ),
  ];
}

async function drawEpisode(view, trial, id) {
  const d = await api(`/trials/${encodeURIComponent(trial)}/episodes/${encodeURIComponent(id)}`);
  const inst = d.instance;
  const t0 = (d.events.find((e) => e.event === "created") || d.events[0] || {}).time;
  const at = (e) => (t0 && e.time ? `+${fmtSeconds(e.time - t0)}` : "");
  const timeline = d.events.map((e) => {
    const head = (title) =>
      el("div", { class: "event-head" }, el("span", { class: "event-name" }, title), el("span", { class: "muted" }, ` ${at(e)}`), e.duration_s !== undefined ? el("span", { class: "muted" }, ` · took ${fmtSeconds(e.duration_s)}`) : null);
    if (e.event === "created") {
      return el("li", { class: "event created", "data-event": "created" }, head("created: the observation the model saw"), observationBlock(e.observation));
    }
    if (e.event === "step") {
      return el(
        "li",
        { class: "event step", "data-event": "step", "data-step": e.step, "data-testid": "step" },
        head(`step ${e.step}`),
        el("div", { class: "label" }, "action"),
        actionBlock(e.action),
        el("div", { class: "label" }, "observation"),
        observationBlock(e.observation),
        el("div", { class: "muted" }, `reward ${fmtReward(e.reward)}`, e.done ? " · done" : "", e.info && Object.keys(e.info).length ? ` · info ${JSON.stringify(e.info)}` : "")
      );
    }
    if (e.event === "evaluation") {
      return el("li", { class: "event evaluation", "data-event": "evaluation" }, head("evaluation"), evaluationBlock(e));
    }
    const rest = Object.fromEntries(Object.entries(e).filter(([k]) => k !== "event" && k !== "time"));
    return el("li", { class: `event other ${e.event}`, "data-event": e.event }, head(e.event), Object.keys(rest).length ? fold(rest) : null);
  });
  const runInfo = d.run_info;
  show(
    view,
    el("p", { class: "crumbs" }, el("a", { href: "#/trials" }, "Trials"), " / ", el("a", { href: trialHref(trial) }, trial), " / ", el("span", {}, id)),
    el("h1", {}, "Episode ", el("span", { "data-testid": "episode-id" }, id)),
    d.live ? el("p", { class: "warn", "data-testid": "live-note" }, "This episode is live: it updates itself, and its evaluation's details are shown once it has ended.") : null,
    kv([
      ["environment", inst.environment],
      ["task", inst.task_id],
      ["trial", inst.trial],
      ["node", inst.node_id],
      ["state", inst.state],
      ["reward", fmtReward(inst.reward)],
      ["steps", inst.step_count],
      ["created", fmtTime(inst.created_at)],
      ["ended", fmtTime(inst.ended_at)],
      ["duration", inst.ended_at ? fmtSeconds(inst.ended_at - inst.created_at) : ""],
      ["params", Object.keys(inst.params || {}).length ? JSON.stringify(inst.params) : ""],
      ["error", inst.error],
    ]),
    runInfo
      ? [
          el("h2", {}, "Rollout"),
          kv([
            ["agent", runInfo.agent_summary && runInfo.agent_summary.agent],
            ["termination", runInfo.agent_summary && runInfo.agent_summary.termination_reason],
            ["model calls", runInfo.agent_summary && runInfo.agent_summary.model_calls],
            ["tokens", runInfo.agent_summary && runInfo.agent_summary.tokens],
            ["error", runInfo.error_info && runInfo.error_info.error_message ? `${runInfo.error_info.stage}: ${runInfo.error_info.error_message}` : ""],
          ]),
          el("h3", {}, "Timings"),
          kv(Object.entries(runInfo.timings || {}).map(([k, v]) => [k, fmtSeconds(v)])),
        ]
      : null,
    el("h2", {}, "Trajectory"),
    d.events.length ? el("ol", { class: "timeline", "data-testid": "timeline" }, timeline) : el("p", { class: "muted" }, "The trial log has no event for this episode (yet)."),
    d.events_cut ? el("p", { class: "warn" }, "The log is longer than the viewer reads; the rest is on the node.") : null,
    conversationBlock(d.conversation),
    d.verifier && d.verifier.length
      ? [el("h2", {}, "Verifier output"), d.verifier.map((f) => el("div", { class: "field" }, el("div", { class: "field-name" }, `${f.name} (${f.size} bytes${f.cut ? ", cut" : ""})`), fold(f.text)))]
      : null
  );
  return d.live;
}

// -- start ----------------------------------------------------------------------------

async function start() {
  document.getElementById("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key-input").value);
    document.getElementById("key-input").value = "";
    document.getElementById("forget-key").hidden = false;
    route();
  });
  const forget = document.getElementById("forget-key");
  forget.hidden = !sessionStorage.getItem(KEY);
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    forget.hidden = true;
    route();
  });
  window.addEventListener("hashchange", route);
  try {
    const health = await (await fetch("/health", { cache: "no-store" })).json();
    role = health.role;
    document.getElementById("role").textContent = role === "scheduler" ? "scheduler" : `node ${health.node_id || ""}`;
    document.title = `envhub ${role}`;
  } catch (e) {
    setStatus(`cannot reach envhub: ${e.message}`, true);
  }
  route();
}

start();
