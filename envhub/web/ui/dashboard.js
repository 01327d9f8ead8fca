// The dashboards (#/): a node's slots, instances and recent episodes; a scheduler's
// fleet. Also the table of episodes the trial pages share.

import { el, episodeHref, fmtReward, fmtSeconds, fmtTime, trialHref } from "./dom.js";
import { api, show } from "./page.js";

function card(label, value, testid) {
  return el("div", { class: "card" }, el("div", { class: "value", "data-testid": testid }, value), el("div", { class: "label" }, label));
}

function slotBar(used, capacity) {
  const pct = capacity ? Math.min(100, (100 * used) / capacity) : 0;
  const bar = el("div", { class: "bar-fill" + (pct >= 100 ? " full" : "") });
  bar.style.width = `${pct}%`; // a CSSOM property, which the CSP allows (no inline style attribute)
  return el("div", { class: "bar", title: `${used} of ${capacity} slots` }, bar);
}

export async function drawNode(view) {
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

export function episodeTable(episodes, { trialColumn, nodeColumn, testid }) {
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

export async function drawFleet(view) {
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
            el(
              "td",
              {},
              el("div", {}, n.name),
              n.name !== n.url ? el("div", { class: "muted" }, n.url) : null,
              n.node_id && n.node_id !== n.name ? el("div", { class: "muted" }, n.node_id) : null,
              n.joined ? el("div", { class: "muted", "data-testid": "node-joined" }, "joined by itself") : null
            ),
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
